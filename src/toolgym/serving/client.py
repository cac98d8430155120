"""``ServedEnv``: a gymnasium environment whose episodes run on a ``toolgym serve`` server.

``toolgym.make("http://host:port")`` (or ``ServedEnv(url)``) gives an environment that
:func:`toolgym.agents.rollout.run_episode`, ``toolgym eval --env URL`` and the trainer
(``env.id = "http://host:port"``) drive like a local one: ``areset`` opens a session on the server,
``astep`` steps it, ``aclose``/a new reset ends it. Only chat messages cross the wire, so the token
sequence, its masks and logprobs are built by the caller exactly as in-process.

Errors keep their meaning (:mod:`toolgym.serving.server` sends each with its class name): the environment's
:class:`~toolgym.errors.InfraError` is raised again as itself, and so are its configuration and usage
errors; a verifier or environment bug is a :class:`ServedEnvError` (never a reward, never
``infra_error``). A server that cannot be reached, dies mid-episode, times out or is full is an
:class:`~toolgym.errors.InfraError`: the trajectory is marked ``infra_error`` and the run goes on.

The server is not trusted. Every reply is checked against the protocol before use
(:mod:`toolgym.serving.protocol`: types, a finite reward, a well-formed session id); a reply longer
than ``max_reply_bytes`` is refused from its ``Content-Length`` (or cut off at the limit when it has
none); and ``timeout`` is one deadline for the whole request, connection, upload and reply together,
so a server that drips its reply a byte at a time cannot hold a step longer. Each of these is an
:class:`~toolgym.errors.InfraError`, like an unreachable server.

The token, if the server wants one: ``token=`` or ``TOOLGYM_SERVE_TOKEN``.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import http.client
import itertools
import json
import os
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import gymnasium

from toolgym import errors
from toolgym.core import Message
from toolgym.env import MessagesSpace, TextSpace
from toolgym.errors import ConfigError, InfraError, ToolgymError, VerifierError
from toolgym.serving.protocol import check_error, check_info, check_reset, check_step

__all__ = ["MAX_REPLY_BYTES", "ServedEnv", "ServedEnvError"]

#: a kept-alive connection idle for longer is replaced before use (the server closes one idle 15 s)
_REUSE_S = 5.0
#: the longest reply a client accepts by default (observations are text; sandbox output is capped at 1 MiB)
MAX_REPLY_BYTES = 16 << 20


class ServedEnvError(VerifierError):
    """The served environment raised something that is neither a usage nor an infrastructure error:
    a verifier or environment bug. It stops the run, as it would in-process."""


class ServedEnv(gymnasium.Env[list[Message], str]):
    """One episode at a time on a ``toolgym serve`` server (see the module docstring)."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout: float = 300.0,
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"a served environment's address starts with http:// or https://, got {url!r}")
        if timeout <= 0 or max_reply_bytes < 1:
            raise ConfigError(
                f"ServedEnv needs timeout > 0 and max_reply_bytes >= 1, got {timeout} and {max_reply_bytes}"
            )
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.max_reply_bytes = max_reply_bytes
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
        self._info = check_info(self._request_sync("GET", "/info"), f"GET {self.url}/info")
        self.served_id = str(self._info["env_id"])
        self.description: str = self._info.get("description", "")

    # ------------------------------------------------------------------ what the server serves
    @property
    def max_turns(self) -> int:
        return int(self._info["max_turns"])

    @property
    def episode_metrics(self) -> dict[str, float]:
        """None on this side: the served episode's metrics come in the steps' ``info``."""
        return {}

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
        self._session, obs, info = check_reset(data, f"POST {self.url}/sessions")
        return obs, info

    async def astep(self, action: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        if self._session is None:
            raise ToolgymError("the episode is over (or never started): call reset() before step()")
        path = f"/sessions/{self._session}/step"
        return check_step(await self._request("POST", path, {"action": action}), f"POST {self.url}{path}")

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
        self._session, obs, info = check_reset(data, f"POST {self.url}/sessions")
        return obs, info

    def step(self, action: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        if self._session is None:
            raise ToolgymError("the episode is over (or never started): call reset() before step()")
        path = f"/sessions/{self._session}/step"
        return check_step(self._request_sync("POST", path, {"action": action}), f"POST {self.url}{path}")

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
        where = f"{method} {self.url}{path}"
        alarm: _Alarm | None = None
        done = False
        deadline = time.monotonic() + self.timeout
        try:
            conn = self._connection()
            if conn.sock is None:
                conn.connect()  # bounded by the connection's own timeout, which is ``timeout``
            alarm = _WATCHDOG.arm(deadline, conn.sock)
            conn.request(method, self._parts.path.rstrip("/") + path, body=body, headers=headers)
            response = conn.getresponse()
            status, raw = response.status, self._read(response, where)
            if alarm.fired:  # the read ended because the socket was shut down: the reply is partial
                raise TimeoutError("the deadline passed")
            done = True
        except (OSError, http.client.HTTPException) as exc:
            self._session = None  # whatever the server held for us, it reaps
            if alarm is not None and alarm.fired:
                raise InfraError(
                    f"{where}: no complete reply within {self.timeout:g} s (the request's deadline)"
                ) from exc
            raise InfraError(
                f"environment server {self.url} unreachable: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            late = alarm is not None and _WATCHDOG.disarm(alarm)
            if (not done or late) and self._conn is not None:
                self._conn.close()  # a half-read or shut-down connection is never reused
                self._conn = None
        self._last_used = time.monotonic()
        return self._decode(status, raw, where)

    def _read(self, response: http.client.HTTPResponse, where: str) -> bytes:
        """The reply's body, at most ``max_reply_bytes`` of it (a longer one is refused)."""
        declared = response.getheader("Content-Length", "")
        if declared.strip().isdigit() and int(declared) > self.max_reply_bytes:
            raise InfraError(
                f"{where}: the server sends a reply of {int(declared)} bytes; this client accepts "
                f"{self.max_reply_bytes} (max_reply_bytes)"
            )
        raw = response.read(self.max_reply_bytes + 1)
        if len(raw) > self.max_reply_bytes:
            raise InfraError(
                f"{where}: the server's reply runs past {self.max_reply_bytes} bytes (max_reply_bytes)"
            )
        if declared.strip().isdigit() and len(raw) < int(declared):
            raise http.client.IncompleteRead(raw, int(declared) - len(raw))
        return raw

    def _decode(self, status: int, raw: bytes, where: str) -> Any:
        if status == 204:
            return None
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            data = None
        if 200 <= status < 300:
            if data is None:
                raise InfraError(f"{where} -> {status}: the reply breaks the protocol: it is not JSON")
            return data
        where = f"{where} -> {status}"
        if status == 401:
            raise ConfigError(f"{where}: a bearer token is required (pass token= or set TOOLGYM_SERVE_TOKEN)")
        error = check_error(data, where)
        kind, message = error.kind, error.message
        if status == 404 and kind == "UnknownSession":
            self._session = None
            raise InfraError(f"{where}: {message}")  # the server lost our episode (expired or restarted)
        cls = getattr(errors, kind, None)
        if error.toolgym and isinstance(cls, type) and issubclass(cls, ToolgymError):
            exc = cls.__new__(cls)  # raised again as itself, with the server's message
            Exception.__init__(exc, f"{message} [{self.served_id} at {self.url}]")
            raise exc
        if status >= 500 and status != 503 and kind:
            raise ServedEnvError(f"{where}: the environment raised {kind}: {message}")
        if status in (400, 409, 413, 415):
            raise ConfigError(f"{where}: {message}")  # a request the server refuses: the caller's mistake
        raise InfraError(f"{where}: {kind or 'no error type'}: {message}")


class _Alarm:
    """One request's deadline: at it, the watchdog shuts the request's socket down."""

    __slots__ = ("done", "fired", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.done, self.fired = sock, False, False


class _Watchdog:
    """Enforces requests' total deadlines with one thread for the whole process.

    A socket timeout bounds each read, not a reply: a server that sends one byte just before each
    timeout would hold a request forever. Shutting the socket down at the deadline ends whatever
    read or write is blocked on it. Arming costs a heap push, so requests stay sub-millisecond.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Alarm]] = []
        self._order = itertools.count()
        self._live = 0
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float, sock: socket.socket) -> _Alarm:
        alarm = _Alarm(sock)
        with self._cond:
            if len(self._heap) > 64 and len(self._heap) > 4 * self._live:  # drop disarmed entries
                self._heap = [entry for entry in self._heap if not entry[2].done]
                heapq.heapify(self._heap)
            heapq.heappush(self._heap, (deadline, next(self._order), alarm))
            self._live += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="toolgym-remote-deadlines", daemon=True
                )
                self._thread.start()
            if self._heap[0][2] is alarm:
                self._cond.notify()
        return alarm

    def disarm(self, alarm: _Alarm) -> bool:
        """Stop ``alarm``; whether it had already fired (its socket is then shut down)."""
        with self._cond:
            if not alarm.done:
                alarm.done = True
                self._live -= 1
            return alarm.fired

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                left = self._heap[0][0] - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                alarm = heapq.heappop(self._heap)[2]
                alarm.done = alarm.fired = True
                self._live -= 1
                with contextlib.suppress(OSError):
                    alarm.sock.shutdown(socket.SHUT_RDWR)


_WATCHDOG = _Watchdog()
