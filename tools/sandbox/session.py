"""Sessions: one container for one episode, interpreter state kept across cells.

A server process inside the container (``programs/repl_server.py``, run by the sandbox user)
holds the globals; each cell is a short ``exec`` client (``repl_client.py``) that hands the server its
stdout/stderr (``SCM_RIGHTS``), so output streams back exactly like a one-shot run. A timeout or output
flood kills the container; the session then starts over in a fresh one (the result says the state was
lost). See :mod:`toolgym.tools.sandbox` for the threat model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from toolgym.errors import SandboxError
from toolgym.tools.sandbox.execution import Box, ExecResult, cpu_seconds, program_source
from toolgym.tools.sandbox.policy import WORKDIR

__all__ = ["Boxes", "SandboxSession"]

_SOCKET_PATH = WORKDIR + "/.session.sock"


@dataclass(frozen=True)
class Boxes:
    """What a session needs of its sandbox (``DockerSandbox.session`` hands it over; the session does
    not import the sandbox): a hardened container to take, one to throw away, a command run in one with
    its limits, Docker's low-level API (the interpreter is started detached through it) and the errors
    that API raises."""

    take: Callable[[], Box]
    discard: Callable[[Box], None]
    run: Callable[..., ExecResult]  # (box, cmd, stdin bytes, timeout, *, cpu_limit_s)
    api: Any
    api_errors: tuple[type[BaseException], ...]


class SandboxSession:
    """One container for one episode; ``run`` keeps interpreter state (see the module docstring)."""

    def __init__(self, boxes: Boxes) -> None:
        self.boxes = boxes
        self._box: Box | None = None
        self._closed = False
        self.restarts = 0

    def _ensure(self) -> Box:
        if self._closed:
            raise SandboxError("this sandbox session is closed")
        if self._box is None:
            box = self.boxes.take()
            api = self.boxes.api
            server = program_source("toolgym.tools.sandbox", "programs/repl_server")
            try:
                exec_id = api.exec_create(
                    box.container.id,
                    ["python3", "-c", server, _SOCKET_PATH],
                    user=box.user,
                    workdir=WORKDIR,
                )["Id"]
                api.exec_start(exec_id, detach=True)
            except self.boxes.api_errors as exc:
                self.boxes.discard(box)
                raise SandboxError(f"could not start the session interpreter: {exc}") from exc
            self._box = box
        return self._box

    def run(self, code: str, *, timeout: float, cpu_time_s: float | None = None) -> ExecResult:
        """Run one cell; the value of a final bare expression is printed, as in a REPL.

        ``cpu_time_s`` (default: ``timeout``) is the CPU time the cell may use, threads it leaves
        running included; a cell stopped by it keeps the interpreter's state. A timeout, output flood
        or lost interpreter kills the container: the next call starts from a fresh interpreter.
        """
        cpu = cpu_seconds(timeout, cpu_time_s)
        box = self._ensure()
        client = program_source("toolgym.tools.sandbox", "programs/repl_client")
        cmd = ["python3", "-c", client, _SOCKET_PATH, str(cpu)]
        try:
            result = self.boxes.run(box, cmd, code.encode("utf-8"), timeout, cpu_limit_s=cpu)
        except SandboxError:
            self._box = None
            self.boxes.discard(box)
            raise
        if result.timed_out or result.output_truncated or result.oom_killed or result.exit_code == 124:
            # The interpreter (and its state) is gone or untrustworthy: start over next time.
            self.restarts += 1
            self.boxes.discard(box)
            self._box = None
        return result

    def close(self) -> None:
        """Remove the container. Idempotent."""
        self._closed = True
        if self._box is not None:
            self.boxes.discard(self._box)
            self._box = None

    def __enter__(self) -> SandboxSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
