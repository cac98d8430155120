"""The key check a vLLM server toolgym starts puts in front of every route (``--middleware``).

vLLM's own ``--api-key`` (or ``VLLM_API_KEY``) checks only the paths under ``/v1``, ``/v2``,
``/inference`` and ``/cohere``. The routes a token-exact policy needs to push weights in
(``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc``, ``/pause``, ``/resume``, ``/sleep``,
``/reset_prefix_cache``, the RL weight-update routes) and others besides (``/invocations``,
``/tokenize``) answer anyone who reaches the port, a web page in the user's browser included: a
``text/plain`` POST needs no CORS preflight. :class:`KeyGuard` is a plain ASGI middleware that vLLM
loads by import path (``--middleware toolgym.agents.policies.vllm_guard.KeyGuard``) as the outermost layer of
its app, so it sees every request before any route, and:

* refuses a request that carries an ``Origin`` header (403): toolgym's clients never send one and
  browsers always do on a cross-origin POST and on every WebSocket upgrade, so no page can drive the
  server even if it learnt the key;
* refuses a request without ``Authorization: Bearer KEY`` (401), on every path and method, the
  health check and CORS preflights included.

The key is read from ``VLLM_API_KEY`` in the server's environment (:data:`KEY_ENV`), the variable
vLLM's own check reads, so ``/v1`` is checked twice with the same key. An environment is readable
only by its own user, unlike a command line (``ps``), which is why the key is not passed as
``--api-key``. A guard started without a key refuses to start (vLLM fails at start-up, naming the
variable): it never serves open.

The module imports nothing beyond the standard library: it runs in vLLM's API server process.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["KEY_ENV", "KeyGuard"]

#: The environment variable holding the key (the one vLLM's own ``--api-key`` check also reads).
KEY_ENV = "VLLM_API_KEY"

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _digest(value: bytes) -> bytes:
    # NOTE: compared as fixed-length digests, so the comparison's time says nothing about the key.
    return hashlib.sha256(value).digest()


class KeyGuard:
    """ASGI middleware: every HTTP request and WebSocket needs the key and no ``Origin`` (module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(
                f"toolgym's KeyGuard needs the server's key in the environment variable {KEY_ENV}; "
                "it does not serve without one"
            )
        self.app = app
        self._expected = _digest(b"Bearer " + key.encode("utf-8"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan: start-up and shut-down
            await self.app(scope, receive, send)
            return
        headers = [(k.lower(), v) for k, v in scope.get("headers", ())]
        if any(k == b"origin" for k, _ in headers):
            await _refuse(scope, send, 403, "cross-origin requests are refused")
            return
        keys = [v for k, v in headers if k == b"authorization"]
        if len(keys) != 1 or not hmac.compare_digest(_digest(keys[0]), self._expected):
            await _refuse(scope, send, 401, "Unauthorized: this server needs its key as a bearer token")
            return
        await self.app(scope, receive, send)


async def _refuse(scope: Scope, send: Send, status: int, message: str) -> None:
    if scope["type"] == "websocket":  # closing before accepting: the server answers the upgrade with 403
        await send({"type": "websocket.close", "code": 1008})
        return
    body = json.dumps({"error": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
