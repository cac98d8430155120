"""``toolgym serve ENV_ID --openenv``: OpenEnv's own application for a toolgym environment, guarded.

The environment side is :class:`~toolgym.interop.openenv.OpenEnvAdapter` (OpenEnv's ``Environment``
for any registered id); this module serves it. OpenEnv's application checks nothing (any ``Host``, any ``Origin``, any content type, bodies
read whole, WebSocket sessions held forever), yet a session runs code (CodeExec). :func:`openenv_app`
puts ``toolgym serve``'s rules (:mod:`toolgym.serving.guards`) in front of it, for HTTP requests and
WebSocket upgrades alike:

* on a loopback bind, a foreign ``Host`` (DNS rebinding) or ``Origin`` (a web page) is refused (403),
  the WebSocket upgrade included; with a token, everything but ``/health`` needs it (401);
* a POST body must be ``application/json`` (415), at most ``MAX_BODY_BYTES`` (413, refused from its
  ``Content-Length`` or as it grows, never read whole), within ``body_timeout`` (408), and strict
  JSON (400); a WebSocket message is capped at the same size by uvicorn (``uvicorn_options``);
* at most ``max_sessions`` environments exist at once: an open WebSocket holds one slot for its life,
  and an HTTP ``/reset``, ``/step``, ``/state`` or ``/metadata`` (each builds a throwaway environment)
  holds one while it runs; past that the upgrade or request is refused (503, ``Retry-After``);
* a WebSocket with no message from its client for ``session_timeout`` seconds is closed (code 1001)
  and its environment released; one in use stays open however long it lives (the connection idle timer
  stops at the upgrade);
* only OpenEnv's environment routes are served: ``/mcp`` (HTTP and WebSocket) is refused (404), since
  the adapter has no MCP server and those routes only build environments (HTTP ones that outlive any
  connection).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from toolgym.errors import ConfigError
from toolgym.interop.openenv import OpenEnvAdapter, ToolgymAction, ToolgymObservation
from toolgym.serving.guards import (
    BODY_TIMEOUT_S,
    MAX_BODY_BYTES,
    Refused,
    check_browser,
    check_token,
    is_loopback,
    parse_json,
    read_body,
)

__all__ = ["GuardedOpenEnv", "openenv_app"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

#: HTTP routes of OpenEnv's application that are served; those that build an environment per request.
_HTTP_ROUTES = frozenset(
    {"/health", "/schema", "/metadata", "/state", "/reset", "/step", "/docs", "/redoc", "/openapi.json"}
)
_BUILDS_AN_ENVIRONMENT = frozenset({"/metadata", "/state", "/reset", "/step"})
_WEBSOCKET_ROUTES = frozenset({"/ws"})


def openenv_app(
    env_id: str,
    env_kwargs: Mapping[str, Any] | None = None,
    *,
    max_sessions: int = 64,
    session_timeout: float = 600.0,
    token: str | None = None,
    host: str = "127.0.0.1",
    body_timeout: float = BODY_TIMEOUT_S,
) -> Any:
    """OpenEnv's own application serving ``env_id`` (one :class:`OpenEnvAdapter` per session), guarded.

    ``host`` is the address the server binds (``Host``/``Origin`` are checked on a loopback one); the
    rules are in the module docstring. Serve it with ``uvicorn_options()`` from
    :mod:`toolgym.serving.guards`, as ``toolgym serve --openenv`` does.
    """
    from openenv.core.env_server.http_server import create_fastapi_app

    if max_sessions < 1:
        raise ConfigError(f"max_sessions must be >= 1, got {max_sessions}")
    if session_timeout <= 0:
        raise ConfigError(f"session_timeout must be > 0 seconds, got {session_timeout}")
    kwargs = dict(env_kwargs or {})
    factory: Callable[[], OpenEnvAdapter] = lambda: OpenEnvAdapter(env_id, kwargs)  # noqa: E731
    app = create_fastapi_app(factory, ToolgymAction, ToolgymObservation, max_concurrent_envs=max_sessions)
    return GuardedOpenEnv(
        app,
        loopback=is_loopback(host),
        token=token,
        max_sessions=max_sessions,
        session_timeout=session_timeout,
        body_timeout=body_timeout,
    )


class GuardedOpenEnv:
    """An ASGI application: ``toolgym serve``'s guards in front of OpenEnv's (module docstring).

    ``held`` counts the environments the guard lets exist: open WebSockets and running HTTP requests
    that build one. It is checked and taken with no ``await`` in between, and given back only once the
    wrapped application has returned (OpenEnv closes a session's environment before that).
    """

    def __init__(
        self,
        app: Any,
        *,
        loopback: bool,
        token: str | None,
        max_sessions: int,
        session_timeout: float,
        body_timeout: float,
    ) -> None:
        self.app, self.loopback, self.token = app, loopback, token
        self.max_sessions, self.session_timeout = max_sessions, session_timeout
        self.body_timeout = body_timeout
        self.held = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
        else:  # lifespan
            await self.app(scope, receive, send)

    def _check(self, scope: Scope, method: str, routes: frozenset[str]) -> None:
        from starlette.datastructures import Headers

        headers = Headers(scope=scope)
        check_browser(method, headers, loopback=self.loopback)
        if scope["path"] != "/health":
            check_token(headers, self.token)
        if scope["path"] not in routes:
            raise Refused(404, "NotFound", f"{scope['path']!r:.80} is not served here")

    def _take(self) -> None:
        if self.held >= self.max_sessions:  # NOTE: checked and taken with no await in between
            raise Refused(
                503,
                "ServerFull",
                f"the server holds its maximum of {self.max_sessions} sessions; retry later, or start it "
                "with a larger --max-sessions",
            )
        self.held += 1

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        from starlette.requests import Request

        method = scope["method"]
        try:
            self._check(scope, method, _HTTP_ROUTES)
            if method == "POST":
                raw = await read_body(
                    Request(scope, receive), limit=MAX_BODY_BYTES, timeout=self.body_timeout
                )
                parse_json(raw)  # strict JSON (no NaN, bounded nesting), or a 400
                receive = _replay(raw, receive)
        except Refused as exc:  # the body may be unread: the connection cannot go on
            await _refuse_http(scope, receive, send, exc, close=True)
            return
        except ValueError as exc:
            await _refuse_http(scope, receive, send, Refused(400, "BadRequest", str(exc)), close=False)
            return
        if scope["path"] not in _BUILDS_AN_ENVIRONMENT:
            await self.app(scope, receive, send)
            return
        try:
            self._take()
        except Refused as exc:
            await _refuse_http(scope, receive, send, exc, close=False, retry=True)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.held -= 1

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        connect = await receive()  # websocket.connect: the upgrade request, not yet answered
        if connect["type"] != "websocket.connect":
            return
        try:
            self._check(scope, "GET", _WEBSOCKET_ROUTES)
            self._take()
        except Refused as exc:
            await _refuse_websocket(scope, send, exc)
            return
        idle = _IdleWebSocket(connect, receive, send, self.session_timeout)
        try:
            await self.app(scope, idle.receive, idle.send)
        finally:
            idle.stop()
            self.held -= 1


class _IdleWebSocket:
    """A WebSocket's ``receive``/``send`` that close it after ``timeout`` seconds without a client message.

    The clock runs only while the application waits for the client: a step that takes long is not
    idleness. On expiry the client gets a close frame (1001) and the application a disconnect, so it
    ends its session and releases its environment as when a client leaves.
    """

    def __init__(
        self, connect: MutableMapping[str, Any], receive: Receive, send: Send, timeout: float
    ) -> None:
        self._first: MutableMapping[str, Any] | None = connect
        self._receive, self._send, self.timeout = receive, send, timeout
        self._pending: asyncio.Future[MutableMapping[str, Any]] | None = None
        self.expired = False

    async def receive(self) -> MutableMapping[str, Any]:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        if self.expired:
            return {"type": "websocket.disconnect", "code": 1001}
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._receive())
        done, _ = await asyncio.wait({self._pending}, timeout=self.timeout)
        if not done:
            self.expired = True
            reason = f"no message for {self.timeout:g} s: session closed"
            await self._send({"type": "websocket.close", "code": 1001, "reason": reason})
            return {"type": "websocket.disconnect", "code": 1001}
        message, self._pending = self._pending.result(), None
        return message

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if not self.expired:  # once closed for idleness, the application's own close is moot
            await self._send(message)

    def stop(self) -> None:
        if self._pending is not None:
            self._pending.cancel()


def _replay(raw: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields the already-read body once, then waits on the connection as before."""
    given = False

    async def replay() -> MutableMapping[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replay


def _error(exc: Refused) -> bytes:
    return json.dumps({"error": {"type": exc.kind, "message": str(exc), "toolgym": False}}).encode()


async def _refuse_http(
    scope: Scope, receive: Receive, send: Send, exc: Refused, *, close: bool, retry: bool = False
) -> None:
    from starlette.responses import Response

    headers = {"Connection": "close"} if close else {}
    if retry:
        headers["Retry-After"] = "1"
    response = Response(_error(exc), status_code=exc.status, media_type="application/json", headers=headers)
    await response(scope, receive, send)


async def _refuse_websocket(scope: Scope, send: Send, exc: Refused) -> None:
    """Answer the upgrade with ``exc``'s HTTP status and message (or a bare 403 where uvicorn cannot)."""
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008})
        return
    body = _error(exc)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if exc.status == 503:
        headers.append((b"retry-after", b"1"))
    await send({"type": "websocket.http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body})
