"""One exec in a sandbox container: feed stdin, read the capped output, enforce the deadline, judge the end.

Docker multiplexes an exec's stdout and stderr on one socket: each frame is an 8-byte header (stream
number, three zero bytes, big-endian length) and that many bytes. :class:`Output` keeps at most
``cap`` bytes in all; past the cap it keeps draining (and discarding) until the stream ends, because
the engine only completes a kill once nobody is blocked writing the stream.

:func:`exec_in` enforces the wall-clock limit from the calling thread: it waits with a deadline and
kills the container, while separate threads drain output and feed stdin. (Killing from the reader
thread would block until the API call's own timeout, because the reader owns the stream the kill must
close.) An exec that ends by a signal in a container that is no longer running was stopped from
outside (the code cannot reach PID 1): that raises :class:`~toolgym.errors.SandboxError`.

Also here, shared by every path: :class:`ExecResult`, :func:`program_source` (the text of an
in-container program) and :func:`cpu_seconds` (a run's CPU-time limit).
"""

from __future__ import annotations

import contextlib
import functools
import math
import socket
import struct
import threading
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

from toolgym.errors import SandboxError
from toolgym.tools.sandbox.policy import HARNESS_USER, WORKDIR, sandbox_user

__all__ = [
    "EXIT_CPU_LIMIT",
    "EXIT_FILE_LIMIT",
    "Box",
    "ExecResult",
    "Output",
    "cpu_seconds",
    "exec_in",
    "program_source",
]

#: Exit statuses (128 + signal) that the in-container programs use for the CPU-time and file size limits.
EXIT_CPU_LIMIT, EXIT_FILE_LIMIT = 152, 153


@dataclass(frozen=True)
class ExecResult:
    """The outcome of running code in a sandbox.

    Attributes:
        exit_code: the process's exit status, or ``None`` when the host killed it (timeout, output cap).
        stdout: captured standard output (UTF-8, undecodable bytes replaced), at most the output cap.
        stderr: captured standard error, same rules.
        timed_out: the wall-clock limit ran out and the host killed the code.
        oom_killed: the kernel's OOM killer ended the process (the memory limit was hit).
        output_truncated: stdout + stderr exceeded the output cap; the run was stopped there.
        duration_s: wall-clock seconds from start to end, as seen from the host.
        cpu_time_exceeded: the CPU-time limit (``cpu_limit_s``) ended the run (exit status 152).
        file_size_exceeded: a write past the file size limit (``file_limit_mb``) ended the run
            (exit status 153). A program that catches the error itself goes on and is not flagged.
        cpu_limit_s: the CPU-time limit the run had, in seconds (0: not recorded).
        file_limit_mb: the file size limit the run had, in MB (0: not recorded).
    """

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    oom_killed: bool
    output_truncated: bool
    duration_s: float
    cpu_time_exceeded: bool = False
    file_size_exceeded: bool = False
    cpu_limit_s: int = 0
    file_limit_mb: int = 0

    @property
    def ok(self) -> bool:
        """Exited 0 without timeout, OOM or truncation."""
        return self.exit_code == 0 and not (self.timed_out or self.oom_killed or self.output_truncated)


@dataclass
class Box:
    """A started container, when it started, and the uid its untrusted code runs as (one per container)."""

    container: Any
    created: float
    uid: int

    @property
    def user(self) -> str:
        """The exec ``user`` of the container's sandbox user (``uid:gid``)."""
        return sandbox_user(self.uid)


@functools.cache
def program_source(package: str, name: str) -> str:
    """The text of in-container program ``name`` shipped in ``package`` (e.g. ``programs/boot``)."""
    return (resources.files(package) / f"{name}.py").read_text(encoding="utf-8")


def cpu_seconds(timeout: float, cpu_time_s: float | None) -> int:
    """The whole CPU seconds a run may use: ``cpu_time_s`` rounded up, or the ``timeout`` when ``None``."""
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    if cpu_time_s is not None and cpu_time_s <= 0:
        raise ValueError(f"cpu_time_s must be > 0 seconds, got {cpu_time_s}")
    return max(1, math.ceil(timeout if cpu_time_s is None else cpu_time_s))


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


class Output:
    """Accumulates the demultiplexed exec stream (reader thread) up to a byte cap."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.parts: dict[int, list[bytes]] = {1: [], 2: []}
        self.size = 0
        self.truncated = False
        self.done = threading.Event()
        self.wake = threading.Event()

    def drain(self, sock: socket.socket) -> None:
        """Read frames until the stream ends; set ``wake`` at the cap and ``done`` + ``wake`` at the end."""
        try:
            while True:
                header = _read_exact(sock, 8)
                if header is None:
                    break
                stream, length = header[0], struct.unpack(">I", header[4:])[0]
                left = length
                while left:
                    chunk = sock.recv(min(left, 1 << 16))
                    if not chunk:
                        return
                    left -= len(chunk)
                    room = self.cap - self.size
                    if room > 0:
                        self.parts.setdefault(stream, []).append(chunk[:room])
                    self.size += len(chunk)
                    if self.size > self.cap and not self.truncated:
                        self.truncated = True
                        self.wake.set()
        except OSError:
            pass
        finally:
            self.done.set()
            self.wake.set()

    def text(self, stream: int) -> str:
        """What was kept of ``stream`` (1 stdout, 2 stderr), decoded as UTF-8 with replacement."""
        return b"".join(self.parts.get(stream, [])).decode("utf-8", "replace")


def exec_in(
    client: Any,
    box: Box,
    cmd: list[str],
    stdin: bytes,
    timeout: float,
    *,
    cap: int,
    user: str | None = None,
    cpu_limit_s: int = 0,
    file_limit_mb: int = 0,
) -> ExecResult:
    """Run ``cmd`` in ``box`` as ``user`` (the box's sandbox user by default) feeding ``stdin``; enforce
    ``timeout`` and the output ``cap``.

    Raises:
        SandboxError: the exec could not start, or the container stopped underneath it.
    """
    import docker.errors

    api = client.api
    user = user or box.user
    start = time.monotonic()
    try:
        exec_id = api.exec_create(box.container.id, cmd, stdin=True, user=user, workdir=WORKDIR)["Id"]
        stream = api.exec_start(exec_id, socket=True)
    except (docker.errors.DockerException, OSError) as exc:
        raise SandboxError(f"exec in sandbox container {box.container.short_id} failed: {exc}") from exc
    sock: socket.socket = getattr(stream, "_sock", stream)
    sock.settimeout(None)
    out = Output(cap)

    def feed() -> None:
        with contextlib.suppress(OSError):
            if stdin:
                sock.sendall(stdin)
            sock.shutdown(socket.SHUT_WR)

    reader = threading.Thread(target=out.drain, args=(sock,), daemon=True)
    writer = threading.Thread(target=feed, daemon=True)
    reader.start()
    writer.start()
    out.wake.wait(timeout)
    timed_out = not out.wake.is_set()
    killed = timed_out or out.truncated
    if killed:
        # NOTE: the kill comes from this (waiting) thread, never from the reader.
        with contextlib.suppress(docker.errors.DockerException, OSError):
            box.container.kill()
        if not out.done.wait(30):
            raise SandboxError(f"sandbox container {box.container.short_id} did not stop after a kill")
    duration = time.monotonic() - start
    with contextlib.suppress(OSError):
        sock.close()
    exit_code: int | None = None
    oom = False
    if not killed:
        exit_code = _exit_code(client, box, exec_id)
        if exit_code is None or exit_code > 128:
            # Ended by a signal: by the OOM killer, by the code itself, or by a stop from outside (the
            # code cannot reach PID 1). A probe tells them apart.
            oom = _probe(client, box) and exit_code == 137
    return ExecResult(
        exit_code=exit_code,
        stdout=out.text(1),
        stderr=out.text(2),
        timed_out=timed_out,
        oom_killed=oom,
        output_truncated=out.truncated,
        duration_s=duration,
        cpu_time_exceeded=exit_code == EXIT_CPU_LIMIT and cpu_limit_s > 0,
        file_size_exceeded=exit_code == EXIT_FILE_LIMIT and user != HARNESS_USER,
        cpu_limit_s=cpu_limit_s,
        file_limit_mb=file_limit_mb,
    )


def _exit_code(client: Any, box: Box, exec_id: str) -> int | None:
    import docker.errors

    for _ in range(50):
        try:
            info = client.api.exec_inspect(exec_id)
        except (docker.errors.DockerException, OSError) as exc:
            require_running(client, box)
            raise SandboxError(f"lost track of an exec in container {box.container.short_id}: {exc}") from exc
        if not info.get("Running"):
            return info.get("ExitCode")
        time.sleep(0.01)
    return None


def require_running(client: Any, box: Box) -> None:
    """Raise :class:`SandboxError` unless ``box``'s container is still running."""
    import docker.errors

    try:
        state = client.api.inspect_container(box.container.id)["State"]
    except docker.errors.NotFound:
        state = {"Status": "removed"}
    except (docker.errors.DockerException, OSError) as exc:
        raise SandboxError(f"cannot inspect sandbox container {box.container.short_id}: {exc}") from exc
    if not state.get("Running"):
        raise SandboxError(
            f"sandbox container {box.container.short_id} stopped while code ran in it (state "
            f"{state.get('Status')!r}, {time.time() - box.created:.0f} s after its start): stopped from outside "
            "(engine restart, `docker kill`) or its lifetime ran out"
        )


def _probe(client: Any, box: Box) -> bool:
    """Whether the container's memory cgroup recorded an OOM kill (cgroup v1 or v2).

    Raises :class:`SandboxError` when the container does not answer: it stopped (or is stopping)
    underneath the exec. The exec's own end can be reported before the container's, so a failed probe
    counts, not only the container's state.
    """
    import docker.errors

    probe = (
        "for f in /sys/fs/cgroup/memory.events /sys/fs/cgroup/memory/memory.oom_control; do "
        '[ -r "$f" ] && grep -E "^oom_kill " "$f"; done; echo alive'
    )
    try:
        _, output = box.container.exec_run(["sh", "-c", probe], user=box.user)
    except (docker.errors.DockerException, OSError):
        output = b""
    fields = [line.split() for line in output.decode(errors="replace").splitlines()]
    if ["alive"] not in fields:
        require_running(client, box)
        raise SandboxError(
            f"sandbox container {box.container.short_id} stopped answering while code ran in it"
        )
    return any(len(f) == 2 and f[0] == "oom_kill" and f[1].isdigit() and int(f[1]) > 0 for f in fields)
