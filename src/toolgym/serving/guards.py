"""What a request to ``toolgym serve`` must pass before it reaches a session.

The server runs code on request (CodeExec) and often listens on loopback without a token, so it
assumes hostile clients, including a web page in the user's own browser:

* **Connections.** A connection with no request in progress (just opened, between requests, or
  still sending a request's head) is closed after ``idle_timeout`` seconds, so idle or half-sent
  connections cannot pile up until the server runs out of descriptors. At most
  :data:`MAX_CONNECTIONS` are served at once (uvicorn answers 503 past it). A connection upgraded to a
  WebSocket leaves this rule at the upgrade (its server closes it when idle, and uvicorn pings it); a
  WebSocket message is capped at :data:`MAX_BODY_BYTES` like a body (close code 1009 past it).
* **Bodies.** A body longer than :data:`MAX_BODY_BYTES` is refused (413) from its
  ``Content-Length`` before a byte of it is read, or as soon as it grows past the limit while being
  read (chunked); the whole body must arrive within ``body_timeout`` seconds (408). Both close the
  connection.
* **Browsers.** A POST body must be ``application/json`` (415): the content types a web page may send
  to another origin without a CORS preflight (``text/plain``, forms, none at all) never reach a
  session. On a loopback bind, the ``Host`` header must name a loopback host and an ``Origin``
  header, when sent, a loopback origin (403): a page on another origin, or one whose own name was
  rebound to 127.0.0.1 (DNS rebinding), cannot drive the server. A WebSocket upgrade is checked the
  same way (:func:`check_browser` with ``GET``): browsers send ``Origin`` on every upgrade.
* **Token.** With a bearer token, every request but the health check carries
  ``Authorization: Bearer TOKEN`` (:func:`check_token`, 401).
* **JSON.** Strictly UTF-8, no ``NaN``/``Infinity`` (nor a number too large for a float), nesting
  within the parser's limits, and the shared reset arguments of the right type and range
  (:func:`check_reset_args`): anything else is a 400 with a message, never a 500 (which a client
  reads as an environment bug).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import math
import urllib.parse
from collections.abc import Mapping
from typing import Any

from toolgym.spaces import MAX_ACTION_CHARS  # the longest action (characters) a step may carry

__all__ = [
    "BODY_TIMEOUT_S",
    "IDLE_TIMEOUT_S",
    "MAX_ACTION_CHARS",
    "MAX_BODY_BYTES",
    "MAX_CONNECTIONS",
    "Refused",
    "check_browser",
    "check_reset_args",
    "check_token",
    "is_loopback",
    "parse_json",
    "read_body",
    "uvicorn_options",
]

#: The longest request body: an action of MAX_ACTION_CHARS characters, each escaped, plus the rest.
MAX_BODY_BYTES = 4 * MAX_ACTION_CHARS + 4096
#: Seconds a connection may go without a request in progress (its head included).
IDLE_TIMEOUT_S = 15.0
#: Seconds a request's whole body may take to arrive.
BODY_TIMEOUT_S = 30.0
#: Connections (and their requests) served at once; more are answered 503.
MAX_CONNECTIONS = 2048


class Refused(Exception):
    """A request refused before any session sees it: HTTP ``status``, error ``kind`` and a message."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def is_loopback(host: str) -> bool:
    """``True`` for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(authority: str) -> str:
    """The host of a ``Host`` header value (``name``, ``name:port``, ``[v6]:port``)."""
    if authority.startswith("["):
        return authority[1 : authority.find("]")] if "]" in authority else ""
    name, _, port = authority.rpartition(":")
    return name if name and port.isdigit() else authority


def check_browser(method: str, headers: Mapping[str, str], *, loopback: bool) -> None:
    """Refuse what a web page could send (see the module docstring); raises :class:`Refused`."""
    if loopback:
        host = headers.get("host", "")
        if not is_loopback(_host_name(host.strip())):
            raise Refused(403, "ForeignHost", f"Host {host!r:.80} is not this loopback server's name")
        origin = headers.get("origin")
        if origin is not None and not is_loopback(urllib.parse.urlsplit(origin).hostname or ""):
            raise Refused(403, "ForeignOrigin", f"requests from the web origin {origin!r:.80} are refused")
    if method == "POST":
        kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if kind != "application/json":
            raise Refused(
                415, "UnsupportedMediaType", f"the body must be application/json, got {kind or 'no type'!r}"
            )


def check_token(headers: Mapping[str, str], token: str | None) -> None:
    """Refuse (401) a request without ``Authorization: Bearer token``; nothing to check without a token."""
    if token is None:
        return
    given = headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        raise Refused(401, "Unauthorized", "a bearer token is required: Authorization: Bearer TOKEN")


async def read_body(request: Any, *, limit: int = MAX_BODY_BYTES, timeout: float = BODY_TIMEOUT_S) -> bytes:
    """The request's body: refused past ``limit`` bytes (413) or ``timeout`` seconds (408)."""
    declared = request.headers.get("content-length", "")
    if declared.strip().isdigit() and int(declared) > limit:
        raise Refused(
            413, "BodyTooLarge", f"the request body has {int(declared)} bytes; this server accepts {limit}"
        )
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise Refused(
                        413,
                        "BodyTooLarge",
                        f"the request body runs past {limit} bytes, more than this server accepts",
                    )
                chunks.append(chunk)
    except TimeoutError:
        raise Refused(
            408, "RequestTimeout", f"the request body did not arrive within {timeout:g} s"
        ) from None
    return b"".join(chunks)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):  # 1e999: Infinity spelled as a number
        raise ValueError(f"the number {literal:.40} is out of range")
    return value


def parse_json(raw: bytes) -> dict[str, Any]:
    """A JSON object from a request body; :class:`ValueError` (a 400) for anything else."""
    try:
        data = json.loads(raw.decode("utf-8") or "{}", parse_constant=_no_constant, parse_float=_finite)
    except UnicodeDecodeError as exc:
        raise ValueError(f"the request body is not UTF-8 ({exc})") from exc
    except RecursionError:
        raise ValueError(
            "the request body is not JSON this server accepts: it is nested too deeply"
        ) from None
    except ValueError as exc:
        raise ValueError(f"the request body is not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def check_reset_args(seed: Any, options: Any) -> tuple[int | None, dict[str, Any]]:
    """A session's ``seed`` and the reset options every environment shares, by JSON type.

    :class:`ValueError` (a 400) for a wrong type or range; what the values mean (a known task id, a
    tool's name) the environment checks itself.
    """
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"seed must be a non-negative integer or null, got {seed!r:.80}")
    if not isinstance(options, dict):
        raise ValueError(f"options must be a JSON object, got {options!r:.80}")
    if "task_id" in options and not isinstance(options["task_id"], str):
        raise ValueError(f"options.task_id must be a string, got {options['task_id']!r:.80}")
    index = options.get("task_index", 0)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"options.task_index must be a non-negative integer, got {index!r:.80}")
    tools = options.get("tools", [])
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, str) for t in tools)):
        raise ValueError(f"options.tools must be a list of tool names, got {tools!r:.80}")
    if "unlocks" in options and not isinstance(options["unlocks"], list):
        raise ValueError(f"options.unlocks must be a list of rules, got {options['unlocks']!r:.80}")
    return seed, options


def uvicorn_options(*, idle_timeout: float = IDLE_TIMEOUT_S) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config``/``uvicorn.run``: the connection rules above."""
    return {
        "http": guarded_protocol(idle_timeout),
        "timeout_keep_alive": max(1, round(idle_timeout)),
        "limit_concurrency": MAX_CONNECTIONS,
        "ws_max_size": MAX_BODY_BYTES,
    }


def guarded_protocol(idle_timeout: float) -> type:
    """uvicorn's HTTP protocol (httptools when installed, else h11) with the idle-connection rule.

    A timer runs whenever no request is in progress: from the connection's start and from the end of
    each response. When it fires before a request's head is complete, the connection is closed. (uvicorn
    alone closes idle kept-alive connections only after a first response, and never a connection whose
    head stops half-way.) The timer stops for good when the connection is upgraded to a WebSocket: the
    transport then belongs to the WebSocket protocol, whose messages this timer never sees, so it would
    cut a WebSocket in use ``idle_timeout`` seconds after its upgrade.
    """
    base: type
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # pragma: no cover - httptools is optional for uvicorn
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    class GuardedProtocol(base):
        _idle: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._idle is not None:
                self._idle.cancel()
            self._idle = self.loop.call_later(idle_timeout, self._expire)

        def _expire(self) -> None:
            cycle = self.cycle
            if (cycle is None or cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def _disarm(self) -> None:
            if self._idle is not None:
                self._idle.cancel()
                self._idle = None

        def handle_websocket_upgrade(self, *args: Any) -> None:
            self._disarm()
            super().handle_websocket_upgrade(*args)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedProtocol
