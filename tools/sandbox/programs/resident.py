"""Resident runner, inside a warm container: serves one-shot runs over its exec stream, one at a time.

Trusted. Started once per container by the host as the container's root (CAP_SETUID, CAP_SETGID,
CAP_KILL only): ``python3 -I -B -c <this file's text> <boot.py's text> <baseline.py's text> <uid>
<clean-up bound, s>``; the exec's attached stdin and stdout are the channel, so a call needs no
``docker exec``. ``uid`` is the container's sandbox user (its gid is the same number). Two long-lived
root processes:

* the runner (this process) talks to the host and moves bytes; it is the only one that ever holds a
  call's code, input or output;
* the zygote, forked before the first call, pre-imports common modules and forks a cleaner and a
  worker per call.
  It receives only pipe ends and a CPU limit, never call data, so a worker forked from it inherits
  nothing of an earlier call. It is the subreaper of everything the calls start.

A worker sets ``oom_score_adj`` to 1000, becomes the sandbox user (setgroups/setgid/setuid: every
capability is gone), makes itself dumpable again (as an exec'd process is), starts a new session in
``/work`` and runs ``boot.py``'s ``main`` (CPU-time limit, ``main.py``, exit statuses 152/153).

A cleaner, forked the same way before a worker whenever none is waiting, waits as root (so the call
can neither signal it nor take the process slot it needs). When the call left anything the clean-up
removes by name (``baseline.py``'s ``left_by_name``: a process, a file, an IPC object), the runner
lets it go; it switches at once to real and saved uid :data:`CLEANER_UID` and effective uid the
sandbox user's: it may signal the call's processes and remove their files, while they can signal
nothing of it (kill permission needs their uid to be its real or saved one). It kills every process
of the sandbox user (``kill(-1)``) until none is left, empties ``/work``, ``/tmp``, ``/dev/shm`` and
``/dev/mqueue`` and removes System V IPC objects. When the call left nothing, the cleaner waits on,
for the next call.

Then the runner measures the container against the baseline it took before the first call
(``baseline.py``: free space and inodes of every writable mount, unreclaimable memory, sockets; file
locks after a clean-up). The container serves another call only if the cleaner (when let go) succeeded, the
measurement matches, and both took at most the clean-up bound; otherwise the verdict retires it and
the runner ends.

Protocol. Host -> runner: ``RUN <cpu s> <code bytes> <stdin bytes>\\n`` then those bytes, or
``PING\\n``. Runner -> host (stdout): frames ``<kind: 1 byte><length: 4 bytes,
big-endian><payload>``: ``R`` ready, ``1``/``2`` a chunk of the worker's stdout/stderr, ``X`` the end
(JSON: ``status``, the exit status with 128 + signal for a signal; ``oom``, the container's OOM-kill
count grew), then ``C`` the verdict (JSON: ``clean``; ``kind`` and ``why`` when not; ``ms``, the
milliseconds of clean-up and measurement, ``check_ms`` of the measurement alone), ``P`` the answer
to ``PING``. ``X`` comes as soon as the output is complete: when nothing but the worker held its
pipes, before the clean-up; otherwise after it. The runner reads the next request only after ``C``.
The runner ends at end of input, and after a verdict that retires its container. Imported as a
module it does nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from typing import Any

SANDBOX_UID = SANDBOX_GID = -1  # the container's sandbox user: set by main() from its argument
#: The cleaner's real and saved uid: no process of the sandbox can signal a process holding it.
CLEANER_UID = 2_147_000_000
CLEANUP_BOUND_S = 1.0  # set by main() from its argument
CHECKS: dict[str, Any] = {}  # baseline.py's names, executed by main() before the first fork
WORKDIR = "/work"
PRELOAD = ("json", "re", "collections", "itertools", "functools", "math", "string", "heapq", "bisect")
PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36
IPC_RMID = 0
EXIT_CLEANER_FAILED = 3
EXIT_FORK_FAILED = 125


def prctl(option: int, value: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def become_sandbox_user() -> None:
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    os.setgroups([SANDBOX_GID])
    os.setresgid(SANDBOX_GID, SANDBOX_GID, SANDBOX_GID)
    os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)


def oom_kills() -> int:
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        with contextlib.suppress(OSError), open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == "oom_kill" and value.strip().isdigit():
                    return int(value)
    return 0


# --------------------------------------------------------------------------- zygote side


def worker(cpu_s: int, fds: list[int], boot: dict[str, object], env: dict[str, str]) -> None:
    """In a fresh fork of the zygote: become the sandbox user and run the call.

    It never returns: the program's end goes to :func:`finish`.
    """
    try:
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        os.closerange(3, 1 << 16)
        become_sandbox_user()
        prctl(PR_SET_DUMPABLE, 1)
        os.setsid()
        os.chdir(WORKDIR)
        os.environ.clear()
        os.environ.update(env)
        sys.path.insert(0, "")
        if "random" in sys.modules:
            sys.modules["random"].seed()
        sys.argv = ["boot", str(cpu_s)]
    except BaseException:
        os._exit(125)
    try:
        boot["main"]()  # type: ignore[operator]
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            with contextlib.suppress(Exception):
                print(exc.code, file=sys.stderr)
            code = 1
    finish(code)


def finish(code: int) -> None:
    """End the worker as the interpreter would, minus tearing down every object (never returns).

    Non-daemon threads are joined, ``atexit`` functions run and the standard streams are flushed;
    then ``os._exit``. A full finalisation would touch every object inherited from the zygote,
    copying most of its memory page by page: it costs more than the rest of a call.
    """
    threading = sys.modules.get("threading")
    with contextlib.suppress(BaseException):
        if threading is not None:
            threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(BaseException):
            stream.flush()  # type: ignore[union-attr]
    os._exit(code & 255)


def clear_dir(top: str) -> bool:
    """Remove everything under ``top`` that the sandbox user can; whether ``top`` ended up empty."""

    def remove(path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            with contextlib.suppress(OSError):
                os.chmod(path, 0o700)
            with contextlib.suppress(OSError):
                for name in os.listdir(path):
                    remove(os.path.join(path, name))
            with contextlib.suppress(OSError):
                os.rmdir(path)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)

    try:
        names = os.listdir(top)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    for name in names:
        remove(os.path.join(top, name))
    return not os.listdir(top)


def cleaner(go: int) -> None:
    """In a fresh fork of the zygote: wait for ``go``, then remove what a call left (never returns).

    It is forked before the call's worker and waits as root, so the call can neither stop it nor
    take the last process slot it needs (a fork bomb that leaves its children sleeping). Let go, it
    takes uids the call cannot signal (see the module docstring) before anything else.
    """
    ok = False
    try:
        os.closerange(3, go)
        os.closerange(go + 1, 1 << 16)
        if os.read(go, 1) != b"g":
            os._exit(EXIT_CLEANER_FAILED)  # the runner is gone
        os.close(go)
        os.setgroups([SANDBOX_GID])
        os.setresgid(SANDBOX_GID, SANDBOX_GID, SANDBOX_GID)
        os.setresuid(CLEANER_UID, SANDBOX_UID, CLEANER_UID)
        for _ in range(500):
            with contextlib.suppress(ProcessLookupError):
                os.kill(-1, signal.SIGKILL)
            if not CHECKS["alive"]():
                break
            time.sleep(0.002)
        else:
            os._exit(EXIT_CLEANER_FAILED)
        ok = all([clear_dir(top) for top in CHECKS["SCRATCH"]])
        libc = ctypes.CDLL(None, use_errno=True)
        removers = {
            "shm": lambda ipc_id: libc.shmctl(ipc_id, IPC_RMID, None),
            "sem": lambda ipc_id: libc.semctl(ipc_id, 0, IPC_RMID),
            "msg": lambda ipc_id: libc.msgctl(ipc_id, IPC_RMID, None),
        }
        for kind, remove in removers.items():
            for ipc_id in CHECKS["ipc_ids"](kind):
                remove(ipc_id)
            ok = ok and not CHECKS["ipc_ids"](kind)
    except BaseException:
        ok = False
    os._exit(0 if ok else EXIT_CLEANER_FAILED)


def zygote(sock: socket.socket, boot_src: str) -> None:
    """Fork workers and cleaners on request; reap everything; report each one's end (never returns)."""
    prctl(PR_SET_DUMPABLE, 0)
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    for module in PRELOAD:
        __import__(module)
    boot: dict[str, object] = {"__name__": "boot", "__builtins__": __builtins__}
    exec(compile(boot_src, "boot.py", "exec"), boot)
    env = dict(os.environ)
    env["HOME"] = "/"  # what an exec as a uid without a passwd entry gets
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    sock.send(struct.pack(">ci", b"R", 0))  # ready: the runner measures the baseline now
    mine: dict[int, bytes] = {}  # pid -> b"W" (worker) or b"C" (cleaner)
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in mine:
                code = 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                sock.send(struct.pack(">ci", mine.pop(pid), code))
        if sock in ready:
            # b"C" + [go]: a cleaner, forked before the worker while every process slot is free and
            # before any of the call's pipes are here; b"W<cpu s>" + [stdin, stdout, stderr]: a worker.
            msg, fds, _, _ = socket.recv_fds(sock, 64, 3)
            if not msg:
                os._exit(0)
            kind = msg[:1]
            try:
                pid = os.fork()
            except OSError:
                sock.send(struct.pack(">ci", kind, EXIT_FORK_FAILED))
                pid = -1
            if pid == 0:
                signal.set_wakeup_fd(-1)
                sock.close()
                os.close(wake_r)
                os.close(wake_w)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                if kind == b"W":
                    worker(int(msg[1:]), fds, boot, env)
                cleaner(fds[0])
            for fd in fds:
                os.close(fd)
            if pid > 0:
                mine[pid] = kind


# --------------------------------------------------------------------------- runner side


class Runner:
    """The host's end: reads requests from fd 0, writes frames to fd 1, drives the zygote."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.stdin = os.fdopen(0, "rb", buffering=0)
        self.go_w = -1  # the write end of the waiting cleaner's pipe, until it is let go
        self.cleaned: int | None = None  # the cleaner's exit status, once known
        self.verdict: dict[str, object] | None = None  # the call's clean-up verdict, once known
        if self.ended()[0] != b"R":
            raise EOFError("the zygote did not start")
        self.baseline = CHECKS["measure"]()

    def frame(self, kind: bytes, payload: bytes) -> None:
        data = kind + struct.pack(">I", len(payload)) + payload
        while data:
            data = data[os.write(1, data) :]

    def read(self, n: int) -> bytes:
        parts = []
        while n:
            chunk = self.stdin.read(n)
            if not chunk:
                raise EOFError
            parts.append(chunk)
            n -= len(chunk)
        return b"".join(parts)

    def line(self) -> bytes:
        out = b""
        while not out.endswith(b"\n"):
            c = self.stdin.read(1)
            if not c:
                raise EOFError
            out += c
        return out

    def ended(self) -> tuple[bytes, int]:
        """The next end the zygote reports: ``(b"W" or b"C", exit status)``."""
        msg = self.sock.recv(16)
        if not msg:
            raise EOFError
        kind, code = struct.unpack(">ci", msg)
        return kind, int(code)

    def call(self, cpu_s: int, payload: bytes) -> bool:
        """Run one call; report ``X`` as soon as its output is complete, then ``C``; whether it was clean."""
        oom_before = oom_kills()
        if self.go_w < 0:  # else the last call's cleaner, never let go, waits for this one
            go_r, self.go_w = os.pipe()
            socket.send_fds(self.sock, [b"C"], [go_r])
            os.close(go_r)
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        socket.send_fds(self.sock, [b"W%d" % cpu_s], [in_r, out_w, err_w])
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        for fd in (in_w, out_r, err_r):
            os.set_blocking(fd, False)
        readers: dict[int, bytes] = {out_r: b"1", err_r: b"2"}
        self.cleaned, self.verdict = None, None
        status: int | None = None
        writers = [in_w] if payload else []
        if not payload:
            os.close(in_w)
        while status is None:
            ready, writable, _ = select.select([*readers, self.sock], writers, [])
            if writable:
                try:
                    payload = payload[os.write(in_w, payload[: 1 << 16]) :]
                except BrokenPipeError:
                    payload = b""
                if not payload:
                    writers = []
                    os.close(in_w)
            for fd in ready:
                if fd is self.sock:
                    kind, code = self.ended()
                    if kind == b"W":
                        status = code
                    else:  # the cleaner died before its turn: the container will be retired
                        self.cleaned = code or EXIT_CLEANER_FAILED
                else:
                    self.forward(fd, readers)
        if writers:
            os.close(in_w)
        for fd in list(readers):  # what the worker left in its pipes, and their end if nobody holds them
            while fd in readers and self.forward(fd, readers):
                pass
        if readers and self.clean()["clean"]:
            # Something the call started held the pipes: it is gone now, so they end.
            while readers:
                for fd in select.select(list(readers), [], [])[0]:
                    self.forward(fd, readers)
        for fd in readers:  # held by nothing the clean-up could end: the verdict retires the container
            os.close(fd)
        report = {"status": status, "oom": oom_kills() > oom_before}
        self.frame(b"X", json.dumps(report).encode())
        verdict = self.clean()
        self.frame(b"C", json.dumps(verdict).encode())
        return bool(verdict["clean"])

    def forward(self, fd: int, readers: dict[int, bytes]) -> bool:
        """Pass on one chunk of ``fd``; at its end drop it. Whether anything was read."""
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        if chunk:
            self.frame(readers[fd], chunk)
            return True
        os.close(fd)
        del readers[fd]
        return False

    def clean(self) -> dict[str, object]:
        """Clean up if the call left anything, then measure; the verdict (once per call, within the bound)."""
        if self.verdict is not None:
            return self.verdict
        start = time.monotonic()
        deadline = start + CLEANUP_BOUND_S
        kind, why = "", ""
        left = self.cleaned is not None or bool(CHECKS["left_by_name"]())
        if left:
            with contextlib.suppress(OSError):
                os.write(self.go_w, b"g")
            os.close(self.go_w)
            self.go_w = -1
            while self.cleaned is None and time.monotonic() < deadline:
                if select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    ended, code = self.ended()
                    if ended == b"C":
                        self.cleaned = code
            if self.cleaned is None:
                kind, why = "slow clean-up", f"the clean-up took longer than {CLEANUP_BOUND_S:g} s"
            elif self.cleaned != 0:
                kind, why = "cleaner failed", f"the cleaner ended with status {self.cleaned}"
        checked = time.monotonic()
        if not kind:
            why = CHECKS["compare"](self.baseline, CHECKS["measure"](self.baseline, locks=left))
            kind = "held resources" if why else ""
            if not why and time.monotonic() > deadline:
                kind, why = "slow clean-up", f"the clean-up and checks took longer than {CLEANUP_BOUND_S:g} s"
        now = time.monotonic()
        ms, check_ms = round((now - start) * 1000, 3), round((now - checked) * 1000, 3)
        self.verdict = {"clean": not kind, "kind": kind, "why": why, "ms": ms, "check_ms": check_ms}
        return self.verdict

    def serve(self) -> None:
        self.frame(b"R", b"")
        while True:
            try:
                request = self.line().split()
                if request[0] == b"PING":
                    self.frame(b"P", b"")
                    continue
                cpu_s, n_code, n_stdin = (int(x) for x in request[1:4])
                code = self.read(n_code)
                stdin = self.read(n_stdin)
            except EOFError:
                return
            if not self.call(cpu_s, str(n_code).encode() + b"\n" + code + stdin):
                return  # the container is retired: nothing more runs in it


def main() -> None:
    global SANDBOX_UID, SANDBOX_GID, CLEANUP_BOUND_S, CHECKS
    prctl(PR_SET_DUMPABLE, 0)
    boot_src, checks_src = sys.argv[1], sys.argv[2]
    SANDBOX_UID = SANDBOX_GID = int(sys.argv[3])
    CLEANUP_BOUND_S = float(sys.argv[4])
    CHECKS = {"__name__": "baseline", "__builtins__": __builtins__}
    exec(compile(checks_src, "baseline.py", "exec"), CHECKS)
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        here.close()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        zygote(there, boot_src)
    there.close()
    try:
        Runner(here).serve()
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
