"""``RemoteEnv``: a gymnasium environment whose episodes run on a ``toolgym serve`` server.

``toolgym.make("http://host:port")`` (or ``RemoteEnv(url)``) gives an environment that
:func:`toolgym.agents.rollout.run_episode`, ``toolgym eval --env URL`` and the trainer
(``env.id = "http://host:port"``) drive like a local one: ``areset`` opens a session on the server,
``astep`` steps it, ``aclose``/a new reset ends it. Only chat messages cross the wire, so the token
sequence, its masks and logprobs are built by the caller exactly as in-process.

Errors keep their meaning (:mod:`toolgym.serve` sends each with its class name): the environment's
:class:`~toolgym.errors.InfraError` is raised again as itself, and so are its configuration and usage
errors; a verifier or environment bug is a :class:`RemoteEnvError` (never a reward, never
``infra_error``). A server that cannot be reached, dies mid-episode, times out or is full is an
:class:`~toolgym.errors.InfraError`: the trajectory is marked ``infra_error`` and the run goes on.

The token, if the server wants one: ``token=`` or ``TOOLGYM_SERVE_TOKEN``.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import gymnasium

from toolgym import errors
from toolgym.core import Message
from toolgym.env import MessagesSpace, TextSpace
from toolgym.errors import ConfigError, InfraError, ToolgymError
from toolgym.registry import is_remote_id

__all__ = ["RemoteEnv", "RemoteEnvError"]

#: a kept-alive connection idle for longer is replaced before use (the server keeps it 75 s)
_REUSE_S = 30.0


class RemoteEnvError(ToolgymError):
    """The served environment raised something that is neither a usage nor an infrastructure error:
    a verifier or environment bug. It stops the run, as it would in-process."""


class RemoteEnv(gymnasium.Env[list[Message], str]):
    """One episode at a time on a ``toolgym serve`` server (see the module docstring)."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 300.0) -> None:
        if not is_remote_id(url):
            raise ConfigError(f"a served environment's address starts with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout = timeout
        token = token if token is not None else os.environ.get("TOOLGYM_SERVE_TOKEN")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.observation_space = MessagesSpace()
        self.action_space = TextSpace()
        self._session: str | None = None
        self._parts = urllib.parse.urlsplit(self.url)
        self._conn: http.client.HTTPConnection | None = None
        self._last_used = 0.0
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False
        self.served_id = self.url
        self._info = self._request_sync("GET", "/info")
        self.served_id = str(self._info["env_id"])
        self.description: str = self._info.get("description", "")

    # ------------------------------------------------------------------ what the server serves
    @property
    def max_turns(self) -> int:
        return int(self._info["max_turns"])

    def task_ids(self) -> list[str]:
        return list(self._info["task_ids"])

    def provenance(self) -> dict[str, Any]:
        """The served environment's own fingerprint (its data, prompts, index or image), for manifests."""
        return {"served": self._info["fingerprint"]}

    # ------------------------------------------------------------------ async API (the rollout loop's)
    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        super().reset(seed=seed)
        self._check_open()
        await self._end_session()
        data = await self._request("POST", "/sessions", {"seed": seed, "options": options or {}})
        self._session = data["session"]
        return data["observation"], data["info"]

    async def astep(self, action: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        if self._session is None:
            raise ToolgymError("the episode is over (or never started): call reset() before step()")
        data = await self._request("POST", f"/sessions/{self._session}/step", {"action": action})
        return data["observation"], data["reward"], data["terminated"], data["truncated"], data["info"]

    async def aclose(self) -> None:
        if self._closed:
            return
        await self._end_session()
        self._closed = True
        self._release()

    # ------------------------------------------------------------------ sync API (gymnasium)
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        super().reset(seed=seed)
        self._check_open()
        self._end_session_sync()
        data = self._request_sync("POST", "/sessions", {"seed": seed, "options": options or {}})
        self._session = data["session"]
        return data["observation"], data["info"]

    def step(self, action: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        if self._session is None:
            raise ToolgymError("the episode is over (or never started): call reset() before step()")
        data = self._request_sync("POST", f"/sessions/{self._session}/step", {"action": action})
        return data["observation"], data["reward"], data["terminated"], data["truncated"], data["info"]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._end_session_sync()
        self._release()

    def _release(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    # ------------------------------------------------------------------ transport
    def _check_open(self) -> None:
        if self._closed:
            raise ToolgymError("this environment is closed; make a new one")

    async def _end_session(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            # gone already (expired, server restarted): the server reaps what is left
            with contextlib.suppress(ToolgymError):
                await self._request("DELETE", f"/sessions/{session}")

    def _end_session_sync(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            with contextlib.suppress(ToolgymError):
                self._request_sync("DELETE", f"/sessions/{session}")

    async def _request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        # NOTE (transport): one keep-alive connection per environment, driven by one private thread, so
        # the event loop never blocks and requests of an episode stay in order; the standard library's
        # client costs ~0.4 ms per loopback request where httpx's cost ~1.1 ms (bench/serve.py)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="toolgym-remote")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._request_sync, method, path, payload)

    def _connection(self) -> http.client.HTTPConnection:
        now = time.monotonic()
        if self._conn is not None and now - self._last_used > _REUSE_S:
            self._conn.close()  # the server may have dropped it: never send a step on a stale one
            self._conn = None
        if self._conn is None:
            kind = (
                http.client.HTTPSConnection if self._parts.scheme == "https" else http.client.HTTPConnection
            )
            self._conn = kind(self._parts.hostname or "", self._parts.port, timeout=self.timeout)
        self._last_used = now
        return self._conn

    def _request_sync(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        body = json.dumps(payload).encode() if payload is not None else None
        headers = {**self._headers, "Content-Type": "application/json"}
        try:
            conn = self._connection()
            conn.request(method, self._parts.path.rstrip("/") + path, body=body, headers=headers)
            response = conn.getresponse()
            status, raw = response.status, response.read()
        except (OSError, http.client.HTTPException) as exc:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self._session = None  # whatever the server held for us, it reaps
            raise InfraError(
                f"environment server {self.url} unreachable: {type(exc).__name__}: {exc}"
            ) from exc
        self._last_used = time.monotonic()
        return self._decode(status, raw, method, path)

    def _decode(self, status: int, raw: bytes, method: str, path: str) -> Any:
        if status == 204:
            return None
        try:
            data = json.loads(raw)
        except ValueError:
            data = None
        if 200 <= status < 300 and isinstance(data, dict):
            return data
        error = data.get("error", {}) if isinstance(data, dict) else {}
        kind = str(error.get("type", ""))
        message = str(error.get("message", raw[:300].decode(errors="replace")))
        where = f"{method} {self.url}{path} -> {status}"
        if status == 401:
            raise ConfigError(f"{where}: {message} (pass token= or set TOOLGYM_SERVE_TOKEN)")
        if status == 404 and kind == "UnknownSession":
            self._session = None
            raise InfraError(f"{where}: {message}")  # the server lost our episode (expired or restarted)
        cls = getattr(errors, kind, None)
        if error.get("toolgym") and isinstance(cls, type) and issubclass(cls, ToolgymError):
            exc = cls.__new__(cls)  # raised again as itself, with the server's message
            Exception.__init__(exc, f"{message} [{self.served_id} at {self.url}]")
            raise exc
        if status >= 500 and status != 503 and kind:
            raise RemoteEnvError(f"{where}: the environment raised {kind}: {message}")
        if status in (400, 409):
            raise ToolgymError(f"{where}: {message}")
        raise InfraError(f"{where}: {kind or 'no error body'}: {message}")
