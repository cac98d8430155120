"""``ServedEnv`` against a hostile or broken server: every bad reply is an ``InfraError``, never a hang.

The fake server here speaks just enough HTTP to answer ``/info`` correctly and then replies to the
next request with whatever the attack needs: values of the wrong type, a non-finite reward, a huge
body, a body dripped one byte at a time. Before the client checked replies against the protocol and
enforced a total deadline, these passed through as observations and rewards (a NaN reward reached
the trainer), crashed the run (an ``AttributeError``), were read in full (200 MB), or held ``step()``
long past its timeout.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from toolgym.agents.harness import get_harness
from toolgym.agents.policies.base import ScriptedPolicy
from toolgym.agents.rollout import run_episode
from toolgym.errors import InfraError
from toolgym.serving.client import ServedEnv

INFO = {"env_id": "fake/Env-v0", "max_turns": 4, "task_ids": ["t0"], "description": "", "fingerprint": {}}
OBS = [{"role": "user", "content": "hi"}]
RESET = {"session": "a" * 32, "observation": OBS, "info": {"task_id": "t0", "allowed_tools": []}}
STEP = {"observation": OBS, "reward": 0.0, "terminated": False, "truncated": False, "info": {}}

Reply = Callable[[socket.socket], None]


def send_json(data: object, status: str = "200 OK") -> Reply:
    body = json.dumps(data).encode() if not isinstance(data, bytes) else data

    def reply(conn: socket.socket) -> None:
        head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        conn.sendall(head.encode() + body)

    return reply


def read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    while len(body) < length:
        body += conn.recv(65536)
    return head


@contextmanager
def fake_server(replies: dict[bytes, Reply]) -> Iterator[str]:
    """Answer ``GET /info`` properly and each other request by the first reply whose key its line starts with."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()
    routes = {b"GET /info": send_json(INFO), **replies}

    def handle(conn: socket.socket) -> None:
        with conn:
            while not stop.is_set():
                try:
                    head = read_request(conn)
                except OSError:
                    return
                if not head:
                    return
                for prefix, reply in routes.items():
                    if head.startswith(prefix):
                        try:
                            reply(conn)
                        except OSError:
                            return
                        break
                else:
                    send_json(b"", "204 No Content")(conn)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()


def stepped(reply: Reply, **env_args: object) -> None:
    """Reset a ServedEnv on a server whose step answers with ``reply``, then step it."""
    with fake_server({b"POST /sessions ": send_json(RESET), b"POST /sessions/": reply}) as url:
        env = ServedEnv(url, **env_args)  # type: ignore[arg-type]
        env.reset(seed=0)
        try:
            env.step("hello")
        finally:
            env.close()


@pytest.mark.parametrize(
    "step",
    [
        {**STEP, "reward": float("nan")},
        {**STEP, "reward": float("inf")},
        {**STEP, "reward": "1.0"},
        {**STEP, "reward": True},
        {**STEP, "terminated": "no"},
        {**STEP, "truncated": 0},
        {**STEP, "observation": "hi"},
        {**STEP, "observation": [{"role": "tool", "content": 5}]},
        {**STEP, "observation": [["role", "tool"]]},
        {**STEP, "info": []},
        {k: v for k, v in STEP.items() if k != "reward"},
        [STEP],
    ],
    ids=["nan", "inf", "str-reward", "bool-reward", "str-flag", "int-flag", "str-obs", "int-content",
         "list-message", "list-info", "no-reward", "array"],
)  # fmt: skip
def test_attack_a_step_reply_that_breaks_the_protocol_is_an_infra_error(step: object) -> None:
    with pytest.raises(InfraError, match="protocol"):
        stepped(send_json(json.dumps(step).encode()))  # NaN and Infinity as Python's json writes them


@pytest.mark.parametrize(
    "reset",
    [
        {**RESET, "session": "../../admin"},
        {**RESET, "session": "a\r\nX-Injected: 1"},
        {**RESET, "session": 7},
        {**RESET, "observation": {"role": "user"}},
        {**RESET, "info": "x"},
    ],
    ids=["path", "crlf", "int", "dict-obs", "str-info"],
)
def test_attack_a_reset_reply_that_breaks_the_protocol_is_an_infra_error(reset: object) -> None:
    with fake_server({b"POST /sessions ": send_json(reset)}) as url:
        env = ServedEnv(url)
        with pytest.raises(InfraError, match="protocol"):
            env.reset(seed=0)
        env.close()


@pytest.mark.parametrize(
    "info",
    [
        {**INFO, "max_turns": "4"},
        {**INFO, "max_turns": 0},
        {**INFO, "task_ids": "t0"},
        {**INFO, "env_id": None},
    ],
    ids=["str-turns", "zero-turns", "str-tasks", "no-id"],
)
def test_attack_an_info_reply_that_breaks_the_protocol_is_an_infra_error(info: object) -> None:
    with fake_server({b"GET /info": send_json(info)}) as url, pytest.raises(InfraError, match="protocol"):
        ServedEnv(url)


@pytest.mark.parametrize(
    "error",
    [{"error": [1]}, {"error": {"type": 5, "message": None}}, {"error": "boom"}, [1, 2]],
    ids=["list", "types", "str", "array"],
)
def test_attack_a_malformed_error_reply_is_an_infra_error_not_a_crash(error: object) -> None:
    with pytest.raises(InfraError):
        stepped(send_json(error, "500 Internal Server Error"))


def test_attack_a_huge_reply_is_refused_without_reading_it() -> None:
    # Before: a 200 MB reply was read into memory and parsed.
    sent = []

    def huge(conn: socket.socket) -> None:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 200000000\r\n\r\n"
        )
        block = b" " * (1 << 20)
        for _ in range(200):
            conn.sendall(block)
            sent.append(len(block))

    with pytest.raises(InfraError, match="bytes"):
        stepped(huge)
    assert sum(sent) < 200_000_000


def test_attack_a_huge_chunked_reply_is_cut_off_at_the_limit() -> None:
    def chunked(conn: socket.socket) -> None:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        piece = b"%x\r\n%s\r\n" % (1 << 16, b" " * (1 << 16))
        for _ in range(64):
            conn.sendall(piece)
        conn.sendall(b"0\r\n\r\n")

    with pytest.raises(InfraError, match="bytes"):
        stepped(chunked, max_reply_bytes=1 << 20)


def test_attack_a_reply_dripped_byte_by_byte_hits_the_deadline() -> None:
    # Before: every byte came within the socket timeout, so step() waited as long as the server liked.
    body = json.dumps(STEP).encode()

    def drip(conn: socket.socket) -> None:
        head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        for byte in head.encode() + body:
            conn.sendall(bytes([byte]))
            time.sleep(0.05)

    with pytest.raises(InfraError, match="deadline|within"):
        stepped(drip, timeout=1.0)


def test_attack_a_server_that_never_answers_hits_the_deadline() -> None:
    def silent(conn: socket.socket) -> None:
        time.sleep(30)

    with pytest.raises(InfraError):
        stepped(silent, timeout=1.0)


async def test_a_bad_reply_ends_the_episode_as_infra_error_and_the_run_goes_on() -> None:
    bad = {**STEP, "reward": float("nan"), "terminated": True}  # before: an "ok" episode of reward NaN
    with fake_server({b"POST /sessions ": send_json(RESET), b"POST /sessions/": send_json(bad)}) as url:
        env = ServedEnv(url)
        trajectory = await run_episode(env, ScriptedPolicy(["hello"]), get_harness("bare"), seed=0)
        await env.aclose()
    assert trajectory.status == "infra_error" and "protocol" in trajectory.error
