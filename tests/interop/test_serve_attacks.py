"""``toolgym serve`` under attack: one session never sees another's, and hostile clients get a 4xx.

Each attack states what it did before the server's guards: a deleted session's step still running
into the next session's environment, connections held open forever, a body read in full before its
size was refused, more sessions than ``--max-sessions``, requests a web page could send, inputs that
answered 500 (which a client takes for an environment bug that stops its run), and a server that
left its sandbox containers running on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import gymnasium
import httpx
import pytest

from toolgym.core import FunctionTool, Task, Tool
from toolgym.env import ToolEnv
from toolgym.serving.server import MAX_BODY_BYTES

SEARCH = "toolgym/SearchQA-v0"
SLOW = "toolgym-test/Memory-v0"


def wait_until(predicate: Any, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


class MemoryEnv(ToolEnv):
    """An episode-scoped note: ``remember`` stores it after a pause, ``recall`` shows it (tests only)."""

    description = "Remember a note, recall it (tests only)."

    def __init__(self) -> None:
        super().__init__(max_turns=8)
        self.tasks = [Task(id="t0", prompt="Remember something.", reference="")]
        self.note: str | None = None

    async def episode_tools(self, task: Task) -> Sequence[Tool]:
        async def remember(note: str, pause: float = 0.0) -> str:
            await asyncio.sleep(pause)
            self.note = note
            return "ok"

        async def recall() -> str:
            return repr(self.note)

        note = {"type": "object", "properties": {"note": {"type": "string"}, "pause": {"type": "number"}}}
        return [
            FunctionTool("remember", "Store a note.", {**note, "required": ["note"]}, fn=remember),
            FunctionTool("recall", "Show the note.", {"type": "object", "properties": {}}, fn=recall),
        ]

    async def close_episode(self) -> None:
        self.note = None


gymnasium.register(id=SLOW, entry_point=MemoryEnv)


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def raw(url: str, data: bytes, *, wait: float = 10.0) -> bytes:
    """Send ``data`` on a fresh connection; what the server answers within ``wait`` seconds."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        s.sendall(data)
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
                if b"\r\n\r\n" in b"".join(chunks):
                    break
        except TimeoutError:
            pass
        except ConnectionResetError:  # the server closed with our unread bytes in its buffer
            chunks.append(b"RESET")
    return b"".join(chunks)


def status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


# --------------------------------------------------------------------------- one session, one episode


def test_attack_a_delete_during_a_step_does_not_hand_the_step_to_the_next_session(serve) -> None:
    # Before: DELETE released the environment at once; the next session got it while the deleted
    # session's step still ran, and that step's note landed in the new episode.
    with serve(SLOW) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        a = http.post("/sessions", json={"seed": 0}).json()["session"]
        step = threading.Thread(
            target=lambda: http.post(
                f"/sessions/{a}/step", json={"action": call("remember", note="A", pause=1)}
            )
        )
        step.start()
        time.sleep(0.3)
        assert http.delete(f"/sessions/{a}").status_code == 204
        b = http.post("/sessions", json={"seed": 0}).json()["session"]
        step.join()
        seen = http.post(f"/sessions/{b}/step", json={"action": call("recall")}).json()
        assert seen["observation"][0]["content"].strip() == "None", seen


def test_attack_the_reaper_does_not_release_an_environment_mid_step(serve) -> None:
    with (
        serve(SLOW, session_timeout=0.2, reap_every=0.05) as (url, server),
        httpx.Client(base_url=url, timeout=60) as http,
    ):
        a = http.post("/sessions", json={"seed": 0}).json()["session"]
        reply = http.post(f"/sessions/{a}/step", json={"action": call("remember", note="A", pause=1)})
        assert reply.status_code == 200, reply.text  # still A's own episode while it ran
        wait_until(lambda: not server.sessions)
        b = http.post("/sessions", json={"seed": 0}).json()["session"]
        seen = http.post(f"/sessions/{b}/step", json={"action": call("recall")}).json()
        assert seen["observation"][0]["content"].strip() == "None", seen


@pytest.mark.docker
def test_attack_a_deleted_code_session_leaves_no_variable_to_the_next(serve) -> None:
    # The CodeExec form of the first attack: A's step sets a variable and sleeps; A is deleted; the
    # next session's fresh interpreter held A's variable.
    code = "secret = 'A'\nimport time\ntime.sleep(3)"
    with (
        serve("toolgym/CodeExec-v0", max_sessions=4) as (url, _),
        httpx.Client(base_url=url, timeout=120) as http,
    ):
        a = http.post("/sessions", json={"seed": 0, "options": {"task_id": "HumanEval/0"}}).json()["session"]
        warm = http.post(f"/sessions/{a}/step", json={"action": call("python", code="1")})
        assert warm.status_code == 200, warm.text
        step = threading.Thread(
            target=lambda: http.post(f"/sessions/{a}/step", json={"action": call("python", code=code)})
        )
        step.start()
        time.sleep(1.0)
        http.delete(f"/sessions/{a}")
        b = http.post("/sessions", json={"seed": 0, "options": {"task_id": "HumanEval/0"}}).json()["session"]
        step.join()
        seen = http.post(
            f"/sessions/{b}/step", json={"action": call("python", code="print(globals().get('secret'))")}
        )
        assert seen.json()["observation"][0]["content"].strip() == "None", seen.text


def test_attack_many_clients_at_once_cannot_exceed_max_sessions(serve) -> None:
    # Before: the limit was checked before building an environment and counted after, so 24 clients
    # opening at once got 4-16 sessions from --max-sessions 2.
    with serve(SEARCH, max_sessions=2) as (url, server):
        barrier = threading.Barrier(24)
        codes: list[int] = []

        def client() -> None:
            with httpx.Client(base_url=url, timeout=120) as http:
                barrier.wait()
                codes.append(http.post("/sessions", json={"seed": 0}).status_code)

        threads = [threading.Thread(target=client) for _ in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(codes) == [200] * 2 + [503] * 22 and len(server.sessions) == 2


# --------------------------------------------------------------------------- connections and bodies


def test_attack_idle_and_half_sent_connections_are_closed(serve) -> None:
    # Before: a connection that never sent a request, or stopped mid-header, stayed open forever;
    # enough of them exhaust the server's descriptors and lock every client out.
    with serve(SEARCH, idle_timeout=0.5) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port))) for _ in range(20)]
        half = [socket.create_connection((host, int(port))) for _ in range(20)]
        for s in half:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        for s in idle + half:
            s.settimeout(30)
            while s.recv(1024):  # until the server closes it (a timeout here fails the test)
                pass
            s.close()
        assert httpx.get(f"{url}/health").status_code == 200


def test_attack_a_body_dripped_byte_by_byte_is_cut_off(serve) -> None:
    # Before: the server waited for the body as long as its bytes kept coming.
    with serve(SEARCH, body_timeout=1.0) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(
                b"POST /sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n{"
            )
            reply, sent = b"", 0
            while sent < 200 and not reply:  # 20 s of dripping at most
                if select.select([s], [], [], 0.1)[0]:
                    try:
                        reply = s.recv(4096) or b"CLOSED"
                    except ConnectionResetError:
                        reply = b"RESET"
                    break
                try:
                    s.sendall(b" ")
                    sent += 1
                except OSError:
                    reply = b"RESET"
        assert sent < 200 and (status(reply) == 408 or reply in (b"CLOSED", b"RESET")), reply[:200]


def test_attack_an_oversized_body_is_refused_before_it_is_read(serve) -> None:
    # Before: a 300 MB body was read in full, then refused.
    with serve(SEARCH) as (url, _):
        head = (
            b"POST /sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 300000000\r\n\r\n"
        )
        reply = raw(url, head + b" " * 65536)
        assert status(reply) == 413 or reply == b"RESET", reply[:200]
        chunked = b"POST /sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        piece = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(chunked)
            sent = 0
            with pytest.raises(OSError):  # the server stops reading and closes past the limit
                while sent < 64 * MAX_BODY_BYTES:
                    s.sendall(piece)
                    sent += 1 << 20
        assert sent <= 2 * MAX_BODY_BYTES + (8 << 20), sent


# --------------------------------------------------------------------------- what a web page could send


def test_attack_requests_a_web_page_could_send_are_refused(serve) -> None:
    # Before: a text/plain body (a "simple" cross-origin request, no preflight), a foreign Origin and a
    # foreign Host (DNS rebinding) all opened sessions on an unauthenticated loopback server.
    with serve(SEARCH) as (url, server), httpx.Client(base_url=url) as http:
        body = json.dumps({"seed": 0})
        assert http.post("/sessions", content=body, headers={"Content-Type": "text/plain"}).status_code == 415
        assert http.post("/sessions", content=body).status_code == 415  # no type at all
        foreign = http.post("/sessions", json={"seed": 0}, headers={"Origin": "http://evil.example"})
        assert foreign.status_code == 403
        rebound = http.post("/sessions", json={"seed": 0}, headers={"Host": "evil.example:8765"})
        assert rebound.status_code == 403
        assert http.get("/info", headers={"Host": "evil.example"}).status_code == 403
        assert not server.sessions
        port = url.rsplit(":", 1)[1]
        for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
            ok = http.post("/sessions", json={"seed": 0}, headers={"Host": host, "Origin": f"http://{host}"})
            assert ok.status_code == 200, ok.text
            http.delete(f"/sessions/{ok.json()['session']}")
        typed = http.post(
            "/sessions", content=body, headers={"Content-Type": "application/json; charset=utf-8"}
        )
        assert typed.status_code == 200


@pytest.mark.parametrize(
    "payload",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"seed": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        b'{"seed": -1}',
        b'{"seed": NaN}',
        b'{"seed": 1e999}',
        b'{"seed": 1' + b"0" * 5000 + b"}",
        b'{"options": {"tools": 5}}',
        b'{"options": {"task_index": "0"}}',
        b'{"options": {"task_id": ["a"]}}',
        b'{"options": {"unlocks": {"a": [[[[]]]]}}}',
        b'{"options": "x"}',
        b'\xff\xfe{"seed": 0}',
    ],
    ids=[
        "deep",
        "deep-seed",
        "negative",
        "nan",
        "inf",
        "huge-literal",
        "tools",
        "index",
        "id",
        "unlocks",
        "options",
        "utf8",
    ],
)
def test_attack_malformed_session_requests_get_400(serve, payload: bytes) -> None:
    # Before: several of these answered 500, which the client reports as an environment bug that stops its run.
    with serve(SEARCH) as (url, _):
        reply = httpx.post(f"{url}/sessions", content=payload, headers={"Content-Type": "application/json"})
        assert reply.status_code == 400, reply.text[:300]
        assert reply.json()["error"]["type"] in ("BadRequest", "ConfigError")


@pytest.mark.parametrize(
    "payload",
    [
        b'{"action": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"action": null}',
        b'{"action": "x", "n": NaN}',
    ],
    ids=["deep", "null", "nan"],
)
def test_attack_malformed_steps_get_400_and_leave_the_episode_intact(serve, payload: bytes) -> None:
    with serve(SEARCH) as (url, _), httpx.Client(base_url=url) as http:
        sid = http.post("/sessions", json={"seed": 0, "options": {"task_index": 0}}).json()["session"]
        reply = http.post(
            f"/sessions/{sid}/step", content=payload, headers={"Content-Type": "application/json"}
        )
        assert reply.status_code == 400, reply.text[:300]
        answer = call("answer", answer="308")
        done = http.post(f"/sessions/{sid}/step", json={"action": answer}).json()
        assert done["terminated"] and done["reward"] == 1.0


# --------------------------------------------------------------------------- stopping the server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.docker
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signalled_server_removes_its_sandbox_containers(signum: int) -> None:
    # Before: uvicorn re-raised SIGTERM with the default action after its shutdown, so the process
    # died without its exit handlers and the sandbox's warm pool kept running.
    if os.environ.get("TOOLGYM_SKIP_DOCKER") == "1":
        pytest.skip("TOOLGYM_SKIP_DOCKER=1")
    import docker

    port = _free_port()
    cmd = [sys.executable, "-m", "toolgym.cli", "serve", "toolgym/CodeExec-v0", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    client = docker.from_env()
    label = f"toolgym.sandbox={socket.gethostname()}:{proc.pid}"
    try:
        wait_until(lambda: _healthy(url), seconds=120)
        with httpx.Client(base_url=url, timeout=120) as http:
            sid = http.post("/sessions", json={"seed": 0, "options": {"task_id": "HumanEval/0"}}).json()[
                "session"
            ]
            step = http.post(f"/sessions/{sid}/step", json={"action": call("python", code="print(6 * 7)")})
            assert step.json()["observation"][0]["content"].strip() == "42"
        wait_until(lambda: len(client.containers.list(filters={"label": label})) >= 2)
        proc.send_signal(signum)
        assert proc.wait(120) == 128 + signum, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
        wait_until(lambda: client.containers.list(all=True, filters={"label": label}) == [], seconds=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for c in client.containers.list(all=True, filters={"label": label}):
            c.remove(force=True)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
