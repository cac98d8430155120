"""One-shot runs through a resident runner: one ``docker exec`` per container, not one per call.

A :class:`ResidentRunner` is the host's end of ``programs/resident.py``, a trusted program
started once in a warm container (as :data:`~toolgym.tools.sandbox.policy.HARNESS_USER`) whose
attached stdin/stdout stream is the channel: a call writes a request to that socket and reads frames
back (see the program's docstring for the protocol). Each call runs in a fresh interpreter process,
forked from a pre-imported zygote that never holds call data, as the container's sandbox user, with
the same limits as an exec'd run; afterwards a cleaner kills every process of the sandbox user and
empties the writable directories and IPC namespace.

When a container is clean. Removing what a call left by name is not enough: a call can hold
resources no process owns (descriptors in flight in a unix socket that holds itself, a port in
``TIME_WAIT``). So after the clean-up the runner *measures* the container against its state before
the first call (``programs/baseline.py`` says exactly what "clean" means): free space and
inodes of every writable mount, the memory cgroup's unreclaimable usage (within 16 MiB), the unix
and inet sockets of its network namespace, and (when the call left anything to clean up) file
locks on its own file systems. A container serves the next call only when all of these match, the
cleaner succeeded, and clean-up and checks together took at most :data:`CLEANUP_BOUND_S`; anything
else retires it. The verdict is part of the
call: :meth:`ResidentRunner.call` returns only once it is known, so a call that leaves a slow
clean-up (hundreds of thousands of names) pays for it (up to the bound) and the next call never
waits for it. What the checks cost is in each verdict (``ms``) and in ``bench/sandbox.py``.

Why the exec stream and not a Unix socket in a bind-mounted host directory: the stream works with
any engine the docker SDK reaches (remote, rootless, Docker Desktop), adds no mount the code could
see, and leaves nothing on the host to create, secure or clean; its file descriptors belong to a root
process the code cannot open. The frames pass through the engine, at well under a millisecond.

A worker differs from an exec'd ``python3 -c`` in a few ways a program could notice: the modules
the zygote pre-imported are already in ``sys.modules``; ``str`` hashes share the zygote's seed (one
per container, not per call); ``sys.flags.isolated`` is set (the working directory is still first on
``sys.path``); its ``oom_score_adj`` is 1000; and at its end, after non-daemon threads, ``atexit``
functions and the standard streams, objects still alive are not finalised (that would copy most of
the zygote's memory and cost more than the rest of the call). Environment, user, groups, working
directory, ``argv``, stdio and limits are the same (a test compares them).

The host keeps the rules of :func:`~toolgym.tools.sandbox.execution.exec_in`: the calling thread waits
with the deadline and kills the container on timeout or past the output cap (while another thread
drains the stream); a container that stops while a call runs is a
:class:`~toolgym.errors.SandboxError`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import threading
import time
from typing import Any

from toolgym.errors import SandboxError
from toolgym.tools.sandbox.execution import (
    EXIT_CPU_LIMIT,
    EXIT_FILE_LIMIT,
    Box,
    ExecResult,
    _probe,
    require_running,
)
from toolgym.tools.sandbox.policy import HARNESS_USER

__all__ = ["CLEANUP_BOUND_S", "MAX_RUNS", "ResidentRunner"]

log = logging.getLogger(__name__)

#: Calls one container serves before it is retired anyway (a bound on anything slow to accumulate).
MAX_RUNS = 500
#: Seconds a runner may take to start and to answer a liveness check.
START_TIMEOUT_S = 30.0
#: Seconds the clean-up after a call and the checks of the container may take; past them the
#: container is retired (the call that caused it waits that long, the next one not at all).
CLEANUP_BOUND_S = 1.0
#: Seconds the host waits for a verdict beyond the bound (the frame's way out through the engine).
_VERDICT_MARGIN_S = 2.0


class _Deadline(Exception):
    """The wall-clock limit ran out while waiting on the stream."""


class ResidentRunner:
    """The host's end of one container's resident runner; one call at a time.

    Attributes:
        box: the container.
        runs: calls served so far.
        reusable: the last call ended without a kill, its clean-up verdict was clean and the runner
            is fine so far: the container may serve another call.
        retired_because: why the container may not serve another call (``"timeout"``, ``"output
            cap"``, ``"slow clean-up"``, ``"held resources"``, ``"cleaner failed"``, ``"max runs"``,
            ``"lost"``), once it may not.
        verdict: the last call's clean-up verdict as the runner sent it (``clean``, ``kind``,
            ``why``, ``ms``: milliseconds of clean-up and checks, ``check_ms``: of the checks alone).
    """

    def __init__(self, client: Any, box: Box, sock: socket.socket) -> None:
        self.client = client
        self.box = box
        self.runs = 0
        self.reusable = True
        self.retired_because: str | None = None
        self.verdict: dict[str, Any] = {}
        self._sock = sock
        self._raw = b""  # engine frames not yet demultiplexed
        self._out = b""  # the runner's stdout: our frames

    @classmethod
    def start(cls, client: Any, box: Box, program: str, boot: str, checks: str) -> ResidentRunner:
        """Start ``program`` (the runner's text) in ``box`` with one exec and wait until it is ready.

        ``boot`` and ``checks`` are the texts of ``boot.py`` and ``baseline.py``.

        Raises:
            SandboxError: the exec failed or the runner did not come up.
        """
        import docker.errors

        try:
            exec_id = client.api.exec_create(
                box.container.id,
                ["python3", "-I", "-B", "-c", program, boot, checks, str(box.uid), f"{CLEANUP_BOUND_S:g}"],
                stdin=True,
                user=HARNESS_USER,
                workdir="/",
            )["Id"]
            stream = client.api.exec_start(exec_id, socket=True)
        except (docker.errors.DockerException, OSError) as exc:
            raise SandboxError(
                f"could not start the resident runner in {box.container.short_id}: {exc}"
            ) from exc
        runner = cls(client, box, getattr(stream, "_sock", stream))
        try:
            frame = runner._frame(time.monotonic() + START_TIMEOUT_S)
        except _Deadline:
            frame = None
        if frame is None or frame[0] != b"R":
            runner.close("lost")
            require_running(client, box)
            raise SandboxError(f"the resident runner in {box.container.short_id} did not start")
        return runner

    def call(
        self, code: bytes, stdin: bytes, *, cpu_s: int, timeout: float, cap: int, file_limit_mb: int
    ) -> ExecResult:
        """Run ``code`` with ``stdin`` in a fresh worker; enforce ``timeout`` and the output ``cap``.

        Returns once the clean-up's verdict is known (see the module docstring); ``reusable`` then
        says whether the container may serve another call.

        Raises:
            SandboxError: the container stopped underneath the call, or the runner broke down.
        """
        if not self.reusable:
            raise SandboxError(f"sandbox container {self.box.container.short_id} was retired; take another")
        start = time.monotonic()
        deadline = start + timeout
        self.runs += 1
        self.reusable = False
        parts: dict[bytes, list[bytes]] = {b"1": [], b"2": []}
        size = 0
        try:
            self._send(b"RUN %d %d %d\n" % (cpu_s, len(code), len(stdin)) + code + stdin, deadline)
            while True:
                frame = self._frame(deadline)
                if frame is None:
                    return self._lost(start, cpu_s, file_limit_mb)
                kind, payload = frame
                if kind == b"X":
                    break
                if kind in parts:
                    if cap - size > 0:
                        parts[kind].append(payload[: cap - size])
                    size += len(payload)
                    if size > cap:
                        return self._killed(start, parts, False, cpu_s, file_limit_mb)
        except _Deadline:
            return self._killed(start, parts, True, cpu_s, file_limit_mb)
        duration = time.monotonic() - start
        report = json.loads(payload)
        status = int(report["status"])
        clean = self._verdict()
        if status > 128:
            # Ended by a signal: by the OOM killer, by the code itself, or by a stop of the whole
            # container from outside, which the runner may have lived just long enough to report.
            if clean:
                self._ping()
            else:
                _probe(self.client, self.box)  # raises unless the container still answers
        return ExecResult(
            exit_code=status,
            stdout=b"".join(parts[b"1"]).decode("utf-8", "replace"),
            stderr=b"".join(parts[b"2"]).decode("utf-8", "replace"),
            timed_out=False,
            oom_killed=bool(report["oom"]) and status == 137,
            output_truncated=False,
            duration_s=duration,
            cpu_time_exceeded=status == EXIT_CPU_LIMIT and cpu_s > 0,
            file_size_exceeded=status == EXIT_FILE_LIMIT,
            cpu_limit_s=cpu_s,
            file_limit_mb=file_limit_mb,
        )

    def close(self, reason: str = "closed") -> None:
        """Close the stream; the runner ends at the end of its input. Idempotent."""
        self.reusable = False
        if self.retired_because is None:
            self.retired_because = reason
        with contextlib.suppress(OSError):
            self._sock.close()

    # ----------------------------------------------------------------- internals

    def _verdict(self) -> bool:
        """Read the clean-up verdict that follows a call's end; whether the container stays usable."""
        try:
            frame = self._frame(time.monotonic() + CLEANUP_BOUND_S + _VERDICT_MARGIN_S)
        except _Deadline:
            frame = None
        try:
            verdict = json.loads(frame[1]) if frame is not None and frame[0] == b"C" else {}
        except ValueError:
            verdict = {}
        self.verdict = verdict if isinstance(verdict, dict) else {}
        if self.verdict.get("clean") is True:
            if self.runs >= MAX_RUNS:
                self.close("max runs")
            else:
                self.reusable = True
            return True
        reason = str(self.verdict.get("kind") or ("slow clean-up" if frame is None else "lost"))
        log.debug(
            "retiring sandbox container %s: %s (%s)",
            self.box.container.short_id,
            reason,
            self.verdict.get("why", "no verdict in time"),
        )
        self.close(reason)
        return False

    def _send(self, data: bytes, deadline: float) -> None:
        self._sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        try:
            self._sock.sendall(data)
        except TimeoutError:
            raise _Deadline from None
        except OSError as exc:
            require_running(self.client, self.box)
            raise SandboxError(f"lost the resident runner in {self.box.container.short_id}: {exc}") from exc

    def _frame(self, deadline: float) -> tuple[bytes, bytes] | None:
        """The runner's next frame, or ``None`` at the end of the stream."""
        while True:
            if len(self._out) >= 5:
                length = struct.unpack(">I", self._out[1:5])[0]
                if len(self._out) >= 5 + length:
                    kind, payload = self._out[:1], self._out[5 : 5 + length]
                    self._out = self._out[5 + length :]
                    return kind, payload
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Deadline
            self._sock.settimeout(left)
            try:
                data = self._sock.recv(1 << 17)
            except TimeoutError:
                raise _Deadline from None
            except OSError:
                data = b""
            if not data:
                return None
            self._raw += data
            while len(self._raw) >= 8:
                stream, length = self._raw[0], struct.unpack(">I", self._raw[4:8])[0]
                if len(self._raw) < 8 + length:
                    break
                chunk, self._raw = self._raw[8 : 8 + length], self._raw[8 + length :]
                if stream == 1:
                    self._out += chunk
                else:
                    log.debug("resident runner stderr: %s", chunk[:2000].decode(errors="replace"))

    def _killed(
        self, start: float, parts: dict[bytes, list[bytes]], timed_out: bool, cpu_s: int, file_limit_mb: int
    ) -> ExecResult:
        """Kill the container (timeout or output cap) from this thread while another drains the stream."""
        import docker.errors

        self.reusable = False
        self.retired_because = "timeout" if timed_out else "output cap"
        done = threading.Event()

        def drain() -> None:
            with contextlib.suppress(OSError):
                self._sock.settimeout(None)
                while self._sock.recv(1 << 16):
                    pass
            done.set()

        threading.Thread(target=drain, daemon=True).start()
        with contextlib.suppress(docker.errors.DockerException, OSError):
            self.box.container.kill()
        if not done.wait(30):
            raise SandboxError(f"sandbox container {self.box.container.short_id} did not stop after a kill")
        self.close()
        return ExecResult(
            exit_code=None,
            stdout=b"".join(parts[b"1"]).decode("utf-8", "replace"),
            stderr=b"".join(parts[b"2"]).decode("utf-8", "replace"),
            timed_out=timed_out,
            oom_killed=False,
            output_truncated=not timed_out,
            duration_s=time.monotonic() - start,
            cpu_limit_s=cpu_s,
            file_limit_mb=file_limit_mb,
        )

    def _lost(self, start: float, cpu_s: int, file_limit_mb: int) -> ExecResult:
        """The stream ended mid-call: a stop from outside (an error) or the runner OOM-killed."""
        self.close("lost")
        for _ in range(20):  # the engine may report the stream's end before the container's
            require_running(self.client, self.box)
            time.sleep(0.1)
        if _probe(self.client, self.box):
            return ExecResult(
                137, "", "", False, True, False, time.monotonic() - start, False, False, cpu_s, file_limit_mb
            )
        raise SandboxError(
            f"the resident runner in sandbox container {self.box.container.short_id} ended mid-call"
        )

    def _ping(self) -> None:
        try:
            self._send(b"PING\n", time.monotonic() + START_TIMEOUT_S)
            frame = self._frame(time.monotonic() + START_TIMEOUT_S)
        except _Deadline:
            frame = None
        if frame is None or frame[0] != b"P":
            self.close("lost")
            require_running(self.client, self.box)
            raise SandboxError(
                f"the resident runner in sandbox container {self.box.container.short_id} stopped answering"
            )
