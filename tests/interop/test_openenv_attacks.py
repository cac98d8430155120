"""``toolgym serve --openenv`` under attack: OpenEnv's server behind ``toolgym serve``'s guards.

Each attack states what OpenEnv's own application did before the guards: it accepted any ``Origin``
(a web page's WebSocket ran CodeExec's python tool) and any ``Host`` (DNS rebinding), let a page's
``text/plain`` POSTs hold every session, read a 300 MB body whole, and the connection idle timer cut
every WebSocket 15 s after its upgrade, in use or not.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import gymnasium
import httpx
import pytest
from servers import uvicorn_thread
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from toolgym.core import FunctionTool, Task, Tool
from toolgym.env import ToolEnv
from toolgym.serving.guards import IDLE_TIMEOUT_S, MAX_ACTION_CHARS, MAX_BODY_BYTES, uvicorn_options
from toolgym.serving.openenv_server import GuardedOpenEnv, openenv_app

SEARCH = "toolgym/SearchQA-v0"
CODE = "toolgym/CodeExec-v0"
PAUSE = "toolgym-test/OpenEnvPause-v0"
UPGRADE = (
    "GET /ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


class PauseEnv(ToolEnv):
    """One tool, ``pause``, that sleeps before answering: a step longer than a short idle limit."""

    description = "Pause, then answer (tests only)."

    def __init__(self) -> None:
        super().__init__(max_turns=8)
        self.tasks = [Task(id="t0", prompt="Pause.", reference="")]

    async def episode_tools(self, task: Task) -> Sequence[Tool]:
        async def pause(seconds: float) -> str:
            await asyncio.sleep(seconds)
            return "done"

        schema = {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]}
        return [FunctionTool("pause", "Sleep, then answer.", schema, fn=pause)]


gymnasium.register(id=PAUSE, entry_point=PauseEnv)


@contextmanager
def openenv_server(
    env_id: str, *, idle_timeout: float = IDLE_TIMEOUT_S, **app_args: Any
) -> Iterator[tuple[str, GuardedOpenEnv]]:
    """The application and connection rules ``toolgym serve --openenv`` runs, on a free loopback port."""
    app = openenv_app(env_id, **app_args)
    with uvicorn_thread(app, **uvicorn_options(idle_timeout=idle_timeout)) as url:
        yield url, app


def ws_url(url: str, path: str = "/ws") -> str:
    return url.replace("http://", "ws://") + path


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def ask(ws: ClientConnection, message: dict[str, Any], *, timeout: float = 60) -> dict[str, Any]:
    ws.send(json.dumps(message))
    return dict(json.loads(ws.recv(timeout=timeout)))


def refused_upgrade(url: str, path: str = "/ws", **options: Any) -> int:
    """The HTTP status a WebSocket upgrade is refused with (fails the test if it is accepted)."""
    with (
        pytest.raises(InvalidStatus) as refused,
        connect(ws_url(url, path), open_timeout=30, **options) as ws,
    ):
        ask(ws, {"type": "reset", "data": {"seed": 0}})
    return int(refused.value.response.status_code)


def raw(url: str, data: bytes, *, wait: float = 10.0) -> bytes:
    """Send ``data`` on a fresh connection; the head of what the server answers within ``wait`` s."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        s.sendall(data)
        reply = b""
        try:
            while b"\r\n\r\n" not in reply and (chunk := s.recv(65536)):
                reply += chunk
        except TimeoutError:
            pass
        except ConnectionResetError:  # the server closed with our unread bytes in its buffer
            reply += b"RESET"
    return reply


def status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


# --------------------------------------------------------------------------- what a web page could send


def test_attack_a_cross_origin_websocket_is_refused() -> None:
    # Before: a WebSocket from any origin was accepted and played episodes; browsers let any page
    # open one to 127.0.0.1 (WebSockets have no same-origin policy, only the Origin header).
    with openenv_server(SEARCH) as (url, app):
        for origin in ("http://evil.example", "null", "http://127.0.0.1.evil.example"):
            assert refused_upgrade(url, origin=origin) == 403
        assert app.held == 0  # refused before any environment was built
        port = url.rsplit(":", 1)[1]
        for origin in (f"http://localhost:{port}", None):
            with connect(ws_url(url), origin=origin) as ws:
                reply = ask(ws, {"type": "reset", "data": {"seed": 0}})
                assert reply["type"] == "observation", reply


@pytest.mark.docker
def test_attack_a_cross_origin_websocket_cannot_run_python() -> None:
    # Before: a page on http://evil.example opened /ws and ran CodeExec's python tool
    # (its output came back: "ran as <uid>").
    with openenv_server(CODE) as (url, app):
        page = "http://evil.example"
        with pytest.raises(InvalidStatus) as refused, connect(ws_url(url), origin=page) as ws:
            ask(ws, {"type": "reset", "data": {"seed": 0}})
            ask(ws, {"type": "step", "data": {"text": call("python", code="print('ran')")}})
        assert refused.value.response.status_code == 403
        assert b"ForeignOrigin" in refused.value.response.body
        assert app.held == 0


def test_attack_a_rebound_host_is_refused() -> None:
    # Before: Host: evil.example (a page whose name was rebound to 127.0.0.1) got 200 from every
    # route and 101 for the WebSocket upgrade.
    with openenv_server(SEARCH) as (url, app), httpx.Client(base_url=url) as http:
        rebound = {"Host": "evil.example"}
        assert http.get("/health", headers=rebound).status_code == 403
        assert http.get("/schema", headers=rebound).status_code == 403
        assert http.post("/reset", json={"seed": 0}, headers=rebound).status_code == 403
        assert status(raw(url, UPGRADE.format(host="evil.example:80").encode())) == 403
        port = url.rsplit(":", 1)[1]
        assert status(raw(url, UPGRADE.format(host=f"localhost:{port}").encode())) == 101
        assert http.get("/health", headers={"Host": f"localhost:{port}"}).status_code == 200


def test_attack_simple_cross_origin_posts_are_refused() -> None:
    # Before: a text/plain body (what a page may POST to another origin without a preflight) reset an
    # environment; so did a body with no content type.
    with openenv_server(SEARCH) as (url, _), httpx.Client(base_url=url) as http:
        body = json.dumps({"seed": 0})
        assert http.post("/reset", content=body, headers={"Content-Type": "text/plain"}).status_code == 415
        assert http.post("/reset", content=body).status_code == 415
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        assert http.post("/step", content=body, headers=form).status_code == 415
        ok = http.post("/reset", content=body, headers={"Content-Type": "application/json; charset=utf-8"})
        assert ok.status_code == 200 and ok.json()["done"] is False, ok.text


def test_attack_a_web_page_cannot_hold_every_session() -> None:
    # Before: three cross-origin text/plain POSTs to /mcp ("openenv/session/create") each took a session
    # that nothing ever released; the next real client got CAPACITY_REACHED.
    create = json.dumps({"jsonrpc": "2.0", "method": "openenv/session/create", "id": 1})
    with openenv_server(SEARCH, max_sessions=3) as (url, app), httpx.Client(base_url=url) as http:
        page = {"Content-Type": "text/plain", "Origin": "http://evil.example"}
        assert [http.post("/mcp", content=create, headers=page).status_code for _ in range(3)] == [403] * 3
        simple = {"Content-Type": "text/plain"}  # no Origin: a form or a non-browser client
        assert http.post("/mcp", content=create, headers=simple).status_code == 415
        assert (
            http.post("/mcp", content=create, headers={"Content-Type": "application/json"}).status_code == 404
        )
        assert refused_upgrade(url, "/mcp") == 404
        assert app.held == 0
        with connect(ws_url(url)) as ws:
            assert ask(ws, {"type": "reset", "data": {"seed": 0}})["type"] == "observation"


# --------------------------------------------------------------------------- bodies and messages


def test_attack_an_oversized_body_is_refused_before_it_is_read() -> None:
    # Before: a 300 MB body to /reset was read whole (+294 MB server memory), then answered 400.
    with openenv_server(SEARCH) as (url, _):
        head = (
            b"POST /reset HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 300000000\r\n\r\n"
        )
        reply = raw(url, head + b" " * 65536)
        assert status(reply) == 413 or reply == b"RESET", reply[:200]
        chunked = (
            b"POST /reset HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
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


def test_attack_a_body_dripped_byte_by_byte_is_cut_off() -> None:
    # Before: OpenEnv's server waited for a body as long as its bytes kept coming.
    with openenv_server(SEARCH, body_timeout=1.0) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(
                b"POST /reset HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
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


@pytest.mark.parametrize(
    "payload",
    [b'{"seed": NaN}', b'{"seed": 1e999}', b"[" * 100_000 + b"]" * 100_000, b'\xff\xfe{"seed": 0}'],
    ids=["nan", "inf", "deep", "utf8"],
)
def test_attack_malformed_json_gets_400(payload: bytes) -> None:
    # Before: NaN and 1e999 as a seed answered 500, which a client reads as an environment bug.
    with openenv_server(SEARCH) as (url, _), httpx.Client(base_url=url) as http:
        reply = http.post("/reset", content=payload, headers={"Content-Type": "application/json"})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["type"] == "BadRequest"


def test_attack_an_oversized_websocket_message_closes_the_websocket() -> None:
    # Before: uvicorn's default let a 16 MiB message through, four times the HTTP body limit.
    with openenv_server(SEARCH) as (url, app):
        with connect(ws_url(url), max_size=None) as ws:
            assert ask(ws, {"type": "reset", "data": {"seed": 0}})["type"] == "observation"
            ws.send(json.dumps({"type": "step", "data": {"text": "x" * (MAX_BODY_BYTES + 1)}}))
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=30)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
        deadline = time.monotonic() + 30
        while app.held and time.monotonic() < deadline:  # its session is released
            time.sleep(0.05)
        assert app.held == 0


def test_an_action_past_the_limit_is_refused_and_the_session_goes_on() -> None:
    with openenv_server(SEARCH) as (url, _), connect(ws_url(url)) as ws:
        assert ask(ws, {"type": "reset", "data": {"seed": 0}})["type"] == "observation"
        long = ask(ws, {"type": "step", "data": {"text": "x" * (MAX_ACTION_CHARS + 1)}})
        assert long["type"] == "error" and long["data"]["code"] == "VALIDATION_ERROR", str(long)[:300]
        step = ask(ws, {"type": "step", "data": {"text": call("search", query="Panthers")}})
        assert step["type"] == "observation", step


# --------------------------------------------------------------------------- sessions and timeouts


def test_attack_a_full_server_refuses_the_upgrade() -> None:
    # Before: past the limit OpenEnv accepted the WebSocket, then sent an error and closed it; and
    # every HTTP /reset built one more environment, however many sessions were open.
    with openenv_server(SEARCH, max_sessions=2) as (url, app):
        barrier = threading.Barrier(12)
        outcomes: list[int] = []
        release = threading.Event()

        def client() -> None:
            barrier.wait()
            try:
                with connect(ws_url(url), open_timeout=60) as ws:
                    reply = ask(ws, {"type": "reset", "data": {"seed": 0}})
                    outcomes.append(101 if reply["type"] == "observation" else 0)
                    release.wait(60)
            except InvalidStatus as exc:
                outcomes.append(exc.response.status_code)

        threads = [threading.Thread(target=client) for _ in range(12)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(outcomes) < 12 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(outcomes) == [101] * 2 + [503] * 10, outcomes
        busy = httpx.post(f"{url}/reset", json={"seed": 0})
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        release.set()
        for t in threads:
            t.join()
        # the slots come back: the server frees one once it has seen its client close, which may come
        # a moment after the client's own close returns (seen on a loaded machine)
        deadline = time.monotonic() + 30
        while True:
            try:
                with connect(ws_url(url)) as ws:
                    assert ask(ws, {"type": "reset", "data": {"seed": 0}})["type"] == "observation"
                break
            except InvalidStatus as exc:
                assert exc.response.status_code == 503, exc
                assert time.monotonic() < deadline, "the sessions' slots never came back"
                time.sleep(0.1)
        while (code := httpx.post(f"{url}/reset", json={"seed": 0}).status_code) == 503:
            assert time.monotonic() < deadline, "the sessions' slots never came back"
            time.sleep(0.1)
        assert code == 200


def test_an_idle_websocket_is_closed_and_its_session_released() -> None:
    # Before: an idle WebSocket held its session until the connection timer cut it (or forever,
    # without that timer); nothing was tied to --session-timeout.
    with openenv_server(SEARCH, max_sessions=1, session_timeout=1.0) as (url, app):
        with connect(ws_url(url)) as ws:
            assert ask(ws, {"type": "reset", "data": {"seed": 0}})["type"] == "observation"
            started = time.monotonic()
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
            assert 0.9 < time.monotonic() - started < 5
        deadline = time.monotonic() + 30
        while app.held and time.monotonic() < deadline:
            time.sleep(0.05)
        with connect(ws_url(url)) as ws:  # its one slot is free again
            assert ask(ws, {"type": "reset", "data": {"seed": 0}})["type"] == "observation"


@pytest.mark.slow
def test_a_websocket_in_use_outlives_the_connection_idle_timeout() -> None:
    # Before: the connection idle timer kept running after the upgrade and cut every WebSocket
    # idle_timeout seconds (15 by default) after it opened, however busy it was.
    server = openenv_server(SEARCH, idle_timeout=1.0, session_timeout=3.0)
    with server as (url, _), connect(ws_url(url)) as ws:
        assert ask(ws, {"type": "reset", "data": {"seed": 0}})["type"] == "observation"
        started = time.monotonic()
        while time.monotonic() - started < 4:
            assert ask(ws, {"type": "state"})["type"] == "state"
            time.sleep(0.3)
        time.sleep(2)  # quiet for longer than the idle timer, within the session timeout
        step = ask(ws, {"type": "step", "data": {"text": call("search", query="Panthers")}})
        assert step["type"] == "observation", step


def test_a_long_step_is_not_idleness() -> None:
    with openenv_server(PAUSE, session_timeout=1.0) as (url, _), connect(ws_url(url)) as ws:
        assert ask(ws, {"type": "reset", "data": {"seed": 0}})["type"] == "observation"
        step = ask(ws, {"type": "step", "data": {"text": call("pause", seconds=2.5)}})
        assert step["data"]["observation"]["messages"][0]["content"] == "done", step


def test_a_token_guards_every_route_and_the_upgrade() -> None:
    with openenv_server(SEARCH, token="s3cret") as (url, _), httpx.Client(base_url=url) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/schema").status_code == 401
        assert http.post("/reset", json={"seed": 0}).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert http.post("/reset", json={"seed": 0}, headers=wrong).status_code == 401
        assert refused_upgrade(url) == 401
        bearer = {"Authorization": "Bearer s3cret"}
        assert http.get("/schema", headers=bearer).status_code == 200
        with connect(ws_url(url), additional_headers=bearer) as ws:
            assert ask(ws, {"type": "reset", "data": {"seed": 0}})["type"] == "observation"
