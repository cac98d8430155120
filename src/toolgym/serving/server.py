"""``toolgym serve``: any registered environment as an HTTP service, one session per episode.

Protocol (JSON over HTTP; :class:`toolgym.serving.client.ServedEnv` is its client):

* ``GET /health`` -> ``{"status": "ok", "env_id", "sessions", "max_sessions"}`` (no auth);
* ``GET /info`` -> ``{"env_id", "max_turns", "task_ids", "description", "fingerprint"}``: what a run
  manifest records about the served environment (:func:`toolgym.records.manifest.env_fingerprint`);
* ``POST /sessions`` ``{"seed": int|null, "options": {...}}`` -> ``{"session", "observation", "info"}``:
  a new episode (``options`` as for ``reset``: ``task_id``, ``task_index``, ``tools``, ``unlocks``);
* ``POST /sessions/{id}/step`` ``{"action": str}`` -> ``{"observation", "reward", "terminated",
  "truncated", "info"}``;
* ``DELETE /sessions/{id}`` -> 204: the episode's resources are released (sandbox containers too).

Failures keep their meaning across the wire: an exception raised by the environment is answered as
``{"error": {"type", "message"}}`` with its toolgym class name, and the client raises it again (an
:class:`~toolgym.errors.InfraError` still makes an ``infra_error`` trajectory; a verifier bug still
stops the run). Status codes: 400 a bad request (malformed body, a value of the wrong type or range,
oversized action, a step after the end), 401 a missing or wrong bearer token, 403 a foreign ``Host`` or
``Origin`` on a loopback bind, 404 an unknown or expired session, 408 a body that did not arrive in
time, 409 a session busy with another request, 413 a body too large, 415 a body that is not
``application/json``, 503 every session slot taken (``Retry-After``) or an infrastructure failure,
500 an environment bug. A client's own mistake, whatever its shape or depth, is never a 500.

Sessions. At most ``max_sessions`` episodes hold an environment at once, counted atomically: a slot is
taken before the environment is built and given back only once the environment is released, so
clients opening together cannot exceed the limit; one more is refused (503) instead of slowing
everyone down. One request at a time runs on a session, and it runs to its end even if its client
goes away. Ending a session (``DELETE``, the reaper of sessions idle for ``session_timeout`` seconds,
the server's shutdown) waits for its running step before the episode's resources are released and
the environment is handed to another session: no step of one session ever runs in another's episode.
Environments are reused across sessions and closed when the server stops.

Security. Binding a non-loopback address without a bearer token is refused at start: an environment
server runs code (CodeExec) and reads files on request. ``--token`` (or ``TOOLGYM_SERVE_TOKEN``) makes
every request but ``/health`` carry ``Authorization: Bearer TOKEN``. Connection and body limits,
content types and the ``Host``/``Origin`` checks are :mod:`toolgym.serving.guards`.

Stopping. SIGTERM and SIGINT end the server as a normal exit does: sessions are closed, environments
released and the process's exit handlers run (CodeExec's sandbox removes its containers); the exit
status is 128 + the signal number.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import resource
import secrets
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from toolgym.errors import ConfigError, InfraError, MissingDependencyError, ToolgymError
from toolgym.serving.guards import (
    BODY_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    MAX_ACTION_CHARS,
    MAX_BODY_BYTES,
    Refused,
    check_browser,
    check_reset_args,
    is_loopback,
    parse_json,
    read_body,
    uvicorn_options,
)

__all__ = [
    "MAX_ACTION_CHARS",
    "MAX_BODY_BYTES",
    "EnvServer",
    "create_app",
    "error_payload",
    "is_loopback",
    "serve_command",
]

log = logging.getLogger(__name__)

_BAD_REQUEST = ("ConfigError", "ToolCallError", "ToolgymError")
_T = TypeVar("_T")


def error_payload(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The status code and JSON body that carry ``exc`` to the client."""
    name = type(exc).__name__
    if isinstance(exc, InfraError):
        status = 503
    elif isinstance(exc, ToolgymError) and name in _BAD_REQUEST:
        status = 400
    else:
        status = 500  # a verifier bug or any other environment bug: never a reward
    toolgym_error = isinstance(exc, ToolgymError)
    return status, {"error": {"type": name, "message": str(exc), "toolgym": toolgym_error}}


@dataclass
class _Session:
    env: Any
    last_used: float = field(default_factory=time.monotonic)
    running: asyncio.Task[Any] | None = None  # the request now running on the episode, if any
    done: bool = False

    def busy(self) -> bool:
        return self.running is not None and not self.running.done()


class EnvServer:
    """Sessions over one registered environment id (what the HTTP routes call)."""

    def __init__(
        self,
        env_id: str,
        env_kwargs: Mapping[str, Any] | None = None,
        *,
        max_sessions: int = 64,
        session_timeout: float = 600.0,
    ) -> None:
        if max_sessions < 1:
            raise ConfigError(f"max_sessions must be >= 1, got {max_sessions}")
        if session_timeout <= 0:
            raise ConfigError(f"session_timeout must be > 0 seconds, got {session_timeout}")
        self.env_id = env_id  # checked where it is built (registry.make): info() or the first session
        self.env_kwargs = dict(env_kwargs or {})
        self.max_sessions = max_sessions
        self.session_timeout = session_timeout
        self.sessions: dict[str, _Session] = {}
        self._held = 0  # slots taken: sessions opening, open, or still releasing their environment
        self._idle: list[Any] = []
        self._all: list[Any] = []
        self._info: dict[str, Any] | None = None

    def _make(self) -> Any:
        from toolgym.registry import make

        env = make(self.env_id, **self.env_kwargs)
        self._all.append(env)
        return env

    def info(self) -> dict[str, Any]:
        """The served environment's id, turn budget, task ids and fingerprint (computed once)."""
        if self._info is None:
            from toolgym.records.manifest import env_fingerprint

            probe = self._make()
            base = probe.unwrapped
            task_ids = list(base.task_ids()) if hasattr(base, "task_ids") else []
            self._info = {
                "env_id": self.env_id,
                "max_turns": int(base.max_turns),
                "task_ids": task_ids,
                "description": str(getattr(base, "description", "")),
                "fingerprint": env_fingerprint(probe, self.env_id, self.env_kwargs),
            }
            self._idle.append(probe)
        return self._info

    async def _exclusive(self, session: _Session, work: Awaitable[_T]) -> _T:
        """Run ``work`` as the session's one running request, to its end even if the caller goes away."""
        task = asyncio.ensure_future(work)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved even if nobody waits
        session.running = task
        return await asyncio.shield(task)

    async def open(self, seed: int | None, options: Mapping[str, Any] | None) -> tuple[str, Any, Any]:
        """A new session: ``(id, observation, info)``; :class:`_Full` when every slot is taken."""
        if self._held >= self.max_sessions:  # NOTE: checked and taken with no await in between
            raise _Full(self.max_sessions)
        self._held += 1
        try:
            env = self._idle.pop() if self._idle else await asyncio.to_thread(self._make)
        except BaseException:
            self._held -= 1
            raise
        session_id = secrets.token_hex(16)
        session = _Session(env)
        self.sessions[session_id] = session
        try:
            obs, info = await self._exclusive(
                session, env.unwrapped.areset(seed=seed, options=dict(options or {}))
            )
        except BaseException:
            await self.close(session_id)
            raise
        return session_id, obs, info

    def get(self, session_id: str) -> _Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise KeyError(session_id)
        session.last_used = time.monotonic()
        return session

    async def step(self, session_id: str, action: str) -> tuple[Any, float, bool, bool, Any]:
        session = self.get(session_id)
        if session.busy():
            raise _Busy(session_id)

        async def run() -> tuple[Any, float, bool, bool, Any]:
            try:
                obs, reward, terminated, truncated, info = await session.env.unwrapped.astep(action)
            finally:
                session.last_used = time.monotonic()
            session.done = bool(terminated or truncated)
            return obs, float(reward), bool(terminated), bool(truncated), info

        return await self._exclusive(session, run())

    async def close(self, session_id: str) -> bool:
        """End a session: wait for its running request, release its episode's resources, free its slot.

        The environment is kept for reuse only once it is released.
        """
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        try:
            if session.running is not None:
                await asyncio.wait([session.running])  # its outcome is its own request's business
            base = session.env.unwrapped
            try:
                release = getattr(base, "close_episode", None)
                if release is not None:
                    await release()
                    self._idle.append(session.env)
                else:
                    await base.aclose()
            except Exception:  # an environment that cannot release its episode is not reused
                log.exception("closing session %s failed; its environment is discarded", session_id)
                with contextlib.suppress(Exception):
                    await base.aclose()
        finally:
            self._held -= 1
        return True

    async def reap(self) -> int:
        """Close the sessions idle for longer than ``session_timeout``; how many were closed."""
        now = time.monotonic()
        stale = [
            sid
            for sid, s in self.sessions.items()
            if now - s.last_used > self.session_timeout and not s.busy()
        ]
        for sid in stale:
            log.info("session %s idle for more than %.0f s: closed", sid, self.session_timeout)
            await self.close(sid)
        return len(stale)

    async def shutdown(self) -> None:
        for sid in list(self.sessions):
            await self.close(sid)
        for env in self._all:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(env.close)
        self._all.clear()
        self._idle.clear()


class _Full(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(
            f"the server holds its maximum of {limit} sessions; retry later, or start it with a larger "
            "--max-sessions"
        )


class _Busy(Exception):
    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id} is still answering another request: one request at a time")


def create_app(
    server: EnvServer,
    *,
    token: str | None = None,
    reap_every: float = 5.0,
    host: str = "127.0.0.1",
    body_timeout: float = BODY_TIMEOUT_S,
) -> Any:
    """The Starlette application serving ``server`` (routes in the module docstring).

    ``host`` is the address the server binds: on a loopback one, ``Host`` and ``Origin`` are checked
    (:mod:`toolgym.serving.guards`).
    """
    try:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route
    except ImportError as exc:
        raise MissingDependencyError("starlette", "serve", "toolgym serve") from exc
    loopback = is_loopback(host)

    def fail(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> Any:
        body = {"error": {"type": kind, "message": message, "toolgym": False}}
        return JSONResponse(body, status_code=status, headers=headers)

    def authorized(request: Request) -> bool:
        if token is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())

    async def body(request: Request) -> dict[str, Any]:
        return parse_json(await read_body(request, limit=MAX_BODY_BYTES, timeout=body_timeout))

    def guarded(handler: Any, *, auth: bool = True) -> Any:
        async def route(request: Request) -> Any:
            try:
                check_browser(request.method, request.headers, loopback=loopback)
            except Refused as exc:
                return fail(exc.status, exc.kind, str(exc), {"Connection": "close"})
            if auth and not authorized(request):
                return fail(401, "Unauthorized", "a bearer token is required: Authorization: Bearer TOKEN")
            try:
                return await handler(request)
            except Refused as exc:  # the body was not read to its end: the connection cannot go on
                return fail(exc.status, exc.kind, str(exc), {"Connection": "close"})
            except ValueError as exc:
                return fail(400, "BadRequest", str(exc))
            except KeyError as exc:
                return fail(
                    404, "UnknownSession", f"no session {exc.args[0]!r} (ended, expired or never opened)"
                )
            except _Full as exc:
                return fail(503, "ServerFull", str(exc), {"Retry-After": "1"})
            except _Busy as exc:
                return fail(409, "SessionBusy", str(exc))
            except Exception as exc:  # the environment's own failure, carried to the client
                status, payload = error_payload(exc)
                if status == 500:
                    log.exception("environment error")
                return JSONResponse(payload, status_code=status)

        return route

    async def health(request: Request) -> Any:
        return JSONResponse(
            {
                "status": "ok",
                "env_id": server.env_id,
                "sessions": len(server.sessions),
                "max_sessions": server.max_sessions,
            }
        )

    async def info(request: Request) -> Any:
        return JSONResponse(await asyncio.to_thread(server.info))

    async def open_session(request: Request) -> Any:
        data = await body(request)
        seed, options = check_reset_args(data.get("seed"), data.get("options") or {})
        session_id, obs, reset_info = await server.open(seed, options)
        return JSONResponse({"session": session_id, "observation": obs, "info": reset_info})

    async def step(request: Request) -> Any:
        session_id = request.path_params["session"]
        server.get(session_id)  # 404 before reading a large body
        action = (await body(request)).get("action")
        if not isinstance(action, str):
            raise ValueError(f'"action" must be a string (the assistant\'s raw text), got {action!r:.80}')
        if len(action) > MAX_ACTION_CHARS:
            raise ValueError(
                f"the action has {len(action)} characters; this server accepts {MAX_ACTION_CHARS}"
            )
        obs, reward, terminated, truncated, step_info = await server.step(session_id, action)
        return JSONResponse(
            {
                "observation": obs,
                "reward": reward,
                "terminated": terminated,
                "truncated": truncated,
                "info": json.loads(json.dumps(step_info, default=str)),
            }
        )

    async def close(request: Request) -> Any:
        if not await server.close(request.path_params["session"]):
            raise KeyError(request.path_params["session"])
        return Response(status_code=204)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        async def reaper() -> None:
            while True:
                await asyncio.sleep(reap_every)
                await server.reap()

        task = asyncio.create_task(reaper())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await server.shutdown()

    routes = [
        Route("/health", guarded(health, auth=False), methods=["GET"]),
        Route("/info", guarded(info), methods=["GET"]),
        Route("/sessions", guarded(open_session), methods=["POST"]),
        Route("/sessions/{session}/step", guarded(step), methods=["POST"]),
        Route("/sessions/{session}", guarded(close), methods=["DELETE"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def serve_command(
    env_id: str,
    env_kwargs: Mapping[str, Any],
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    max_sessions: int = 64,
    session_timeout: float = 600.0,
    token: str | None = None,
    openenv: bool = False,
) -> None:
    """Run the server until interrupted (``toolgym serve``; ``openenv``: OpenEnv's protocol and server).

    Raises:
        SystemExit: with status 128 + the signal's number, after a clean shutdown on SIGTERM/SIGINT.
    """
    if not is_loopback(host) and not token:
        raise ConfigError(
            f"refusing to serve {env_id} on {host}, which other machines can reach, without a bearer token: "
            "pass --token (or set TOOLGYM_SERVE_TOKEN), or bind 127.0.0.1"
        )
    try:
        import uvicorn
    except ImportError as exc:
        raise MissingDependencyError("uvicorn", "serve", "toolgym serve") from exc
    if openenv:
        from toolgym.interop.openenv import OpenEnvAdapter
        from toolgym.serving.openenv_server import openenv_app

        OpenEnvAdapter(env_id, env_kwargs).close()  # a broken environment fails here, not on a client
        app = openenv_app(
            env_id,
            env_kwargs,
            max_sessions=max_sessions,
            session_timeout=session_timeout,
            token=token,
            host=host,
        )
    else:
        server = EnvServer(env_id, env_kwargs, max_sessions=max_sessions, session_timeout=session_timeout)
        server.info()  # build the environment once now: a broken one fails here, not on the first client
        app = create_app(server, token=token, host=host)
    _raise_descriptor_limit()
    protocol = "OpenEnv protocol" if openenv else "toolgym protocol"
    print(f"serving {env_id} on http://{host}:{port} ({protocol}, max {max_sessions} sessions)", flush=True)
    # NOTE: uvicorn shuts down gracefully on these signals, then raises the signal again with the
    # handler that was installed before it started. The default one would end the process there,
    # skipping its exit handlers (a sandbox's containers would keep running); this one exits instead.
    previous = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        uvicorn.run(
            app, host=host, port=port, log_level="warning", **uvicorn_options(idle_timeout=IDLE_TIMEOUT_S)
        )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _raise_descriptor_limit() -> None:
    """Every connection is a descriptor: take the hard limit, so connections run out after the guards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
