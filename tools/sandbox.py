"""Run untrusted Python in hardened Docker containers.

Threat model. The code comes from a language model being trained with RL, so assume it is adversarial:
it may try to exhaust the host (fork bombs, memory, CPU, disk, output floods), to escape (the Docker
socket, setuid binaries, ptrace, namespaces), to reach the network, or to outlive its time limit. The
defences, all applied to every container:

* no network (``network_mode="none"``); read-only root file system; a size-capped ``tmpfs`` workdir
  (``/work``) and ``/tmp``; a non-root user (``nobody``); all capabilities dropped;
  ``no-new-privileges`` (setuid binaries do not elevate); a seccomp profile that denies ``ptrace``,
  namespace creation and other kernel surfaces (see :data:`SECCOMP_PROFILE`); limits on pids, memory
  (swap included, so no swapping) and CPU; a capped container log and a cap on captured output;
* wall-clock timeouts enforced from the host: the calling thread waits with a deadline and kills the
  container, while separate threads drain output and feed stdin. (Killing from the reader thread would
  block until the API call's own timeout, because the reader owns the stream the kill must close.)
* every container carries :data:`LABEL` plus a deadline label; a reaper thread kills labelled
  containers past their deadline, and leftovers of dead processes are removed at start-up and at exit.

Latency. ``containers.run`` per call costs a container start (hundreds of ms). A warm pool keeps a few
started containers idle (``sleep infinity``); a one-shot :meth:`DockerSandbox.run` takes one, runs the
code through ``exec``, and throws the container away; a background thread starts a replacement. A
container is never reused by a second run, so nothing leaks between runs.

Sessions. :meth:`DockerSandbox.session` keeps one container for an episode. Interpreter state survives
across :meth:`SandboxSession.run` calls: a small server process inside the container holds the globals,
and each call is a short ``exec`` client that hands the server its stdin/stdout/stderr file descriptors
(``SCM_RIGHTS``), so output streams back exactly like a one-shot run. A timeout or output flood kills
the container; the session then starts over in a fresh one (the result says the state was lost).

:class:`LocalSandbox` runs code in a subprocess with rlimits. It is NOT a security boundary: use it only
for trusted code (it warns at runtime).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import queue
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any

from toolgym.errors import MissingDependencyError, SandboxError

__all__ = [
    "LABEL",
    "SECCOMP_PROFILE",
    "DockerSandbox",
    "ExecResult",
    "LocalSandbox",
    "SandboxSession",
    "SandboxUnavailable",
    "docker_client",
    "leaked_containers",
    "reap_containers",
]

log = logging.getLogger(__name__)

#: Label carried by every sandbox container (the value is the owner's ``host:pid``).
LABEL = "toolgym.sandbox"
#: Label holding the container's deadline (Unix time); the reaper kills it past that.
DEADLINE_LABEL = "toolgym.deadline"
#: Label naming the :class:`DockerSandbox` instance that created the container.
INSTANCE_LABEL = "toolgym.sandbox.instance"
#: Image used when none is given; built by ``toolgym sandbox build``.
DEFAULT_IMAGE = "toolgym-sandbox:1"
#: The unprivileged user the code runs as (Debian's ``nobody``).
SANDBOX_USER = "65534:65534"
WORKDIR = "/work"

_FIX = (
    "Fix: install and start Docker (Debian: `apt-get install -y docker.io && dockerd &`; or start the "
    "Docker service), then build the image with `toolgym sandbox build`. "
    "Set TOOLGYM_SKIP_DOCKER=1 to skip Docker tests on a machine without it."
)


class SandboxUnavailable(SandboxError):
    """No usable Docker engine or sandbox image; the message says how to fix it."""


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
    """

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    oom_killed: bool
    output_truncated: bool
    duration_s: float

    @property
    def ok(self) -> bool:
        """Exited 0 without timeout, OOM or truncation."""
        return self.exit_code == 0 and not (self.timed_out or self.oom_killed or self.output_truncated)


# --------------------------------------------------------------------------- seccomp

_DENY = [
    # Debugging and cross-process memory access: the classic way to tamper with a trusted process.
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # Namespaces and mounts: the stepping stones of container escapes.
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsmount", "fsconfig",
    "fspick", "move_mount", "open_tree", "mount_setattr",
    # Kernel surfaces untrusted code never needs.
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff",
    "acct", "syslog", "quotactl", "lookup_dcookie", "open_by_handle_at", "name_to_handle_at",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "personality", "settimeofday",
    "clock_settime", "clock_adjtime", "adjtimex", "iopl", "ioperm", "vhangup", "nfsservctl",
    "uselib", "ustat", "sysfs", "_sysctl", "get_kernel_syms", "query_module", "create_module",
    "mbind", "set_mempolicy", "move_pages", "migrate_pages",
]  # fmt: skip
#: clone flags that create namespaces; any clone() carrying one of them is refused.
_NS_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)

#: The seccomp profile (Docker's JSON format). Everything not listed is allowed: the capability drop
#: and ``no-new-privileges`` already neutralise most privileged calls, and this list removes the
#: rest, ptrace first. ``clone3`` answers ENOSYS so that libc falls back to ``clone``, whose flags
#: can be filtered (clone3 passes them in memory, out of seccomp's reach).
SECCOMP_PROFILE: dict[str, Any] = {
    "defaultAction": "SCMP_ACT_ALLOW",
    "architectures": [
        "SCMP_ARCH_X86_64",
        "SCMP_ARCH_X86",
        "SCMP_ARCH_X32",
        "SCMP_ARCH_AARCH64",
        "SCMP_ARCH_ARM",
    ],
    "syscalls": [
        {"names": _DENY, "action": "SCMP_ACT_ERRNO", "errnoRet": 1},
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38},
        *[
            {
                "names": ["clone"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": 1,
                "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
            }
            for flag in _NS_FLAGS
        ],
    ],
}


# --------------------------------------------------------------------------- docker plumbing


def docker_client() -> Any:
    """A docker SDK client for the local engine, or :class:`SandboxUnavailable` saying how to get one."""
    try:
        import docker
        import docker.errors
    except ImportError:
        raise MissingDependencyError("docker", "docker", "the Docker sandbox") from None
    try:
        client = docker.from_env(timeout=60)
        client.ping()
    except docker.errors.DockerException as exc:
        raise SandboxUnavailable(f"cannot reach a Docker engine ({exc}). {_FIX}") from None
    return client


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_orphan(labels: dict[str, str], now: float) -> bool:
    """Past its deadline, or owned by a process on this host that no longer exists."""
    try:
        if float(labels.get(DEADLINE_LABEL, "inf")) < now:
            return True
    except ValueError:
        return True
    host, _, pid = labels.get(LABEL, "").rpartition(":")
    return host == socket.gethostname() and pid.isdigit() and not _pid_alive(int(pid))


def _labelled(client: Any, label: str = LABEL) -> list[dict[str, Any]]:
    """Labelled containers as plain records (``Id``, ``Labels``).

    The low-level call on purpose: ``containers.list`` inspects each container afterwards and fails
    when another process removes one in between.
    """
    return list(client.api.containers(all=True, filters={"label": label}))


def reap_containers(client: Any | None = None, *, owner: str | None = None) -> int:
    """Remove labelled containers that are orphans (dead owner, past deadline), or all of ``owner``'s.

    Returns how many were removed. Containers of live processes within their deadline are left alone,
    so several processes (test workers, rollout workers) can share one engine.
    """
    import docker.errors

    client = client or docker_client()
    removed = 0
    now = time.time()
    for record in _labelled(client):
        labels = record.get("Labels") or {}
        if (owner is not None and labels.get(LABEL) == owner) or _is_orphan(labels, now):
            with contextlib.suppress(docker.errors.DockerException):
                client.api.remove_container(record["Id"], force=True)
                removed += 1
    if removed:
        log.info("removed %d sandbox container(s)", removed)
    return removed


def leaked_containers(
    client: Any | None = None, *, owner: str | None = None, instance: str | None = None
) -> list[str]:
    """Ids of labelled containers (only ``owner``'s / ``instance``'s when given), for leak counts."""
    client = client or docker_client()
    label = f"{INSTANCE_LABEL}={instance}" if instance else (f"{LABEL}={owner}" if owner else LABEL)
    return [record["Id"] for record in _labelled(client, label)]


# Boot program of a one-shot run: read "<n>\n" then n bytes of source from fd 0 (unbuffered, so the rest
# of stdin is left for the program), write it to main.py (tracebacks show lines) and run it as __main__.
_BOOT = r"""
import os, sys
h = b""
while not h.endswith(b"\n"):
    c = os.read(0, 1)
    if not c: sys.exit(125)
    h += c
n = int(h); parts = []
while n:
    b = os.read(0, min(n, 1 << 16))
    if not b: sys.exit(125)
    parts.append(b); n -= len(b)
src = b"".join(parts)
with open("main.py", "wb") as f: f.write(src)
del h, n, parts, b, c, f
sys.argv = ["main.py"]
g = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
exec(compile(src, "main.py", "exec"), g)
"""

# Session server: owns the episode's globals; serves one cell per connection on a Unix socket.
_REPL_SERVER = r"""
import ast, os, socket, sys, traceback
path = sys.argv[1]
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path + ".tmp"); os.rename(path + ".tmp", path); srv.listen(8)
ns = {"__name__": "__main__", "__builtins__": __builtins__}
def run_cell(src):
    tree = ast.parse(src, "<cell>")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<cell>", "exec"), ns)
    if last is not None:
        value = eval(compile(last, "<cell>", "eval"), ns)
        if value is not None:
            print(repr(value))
while True:
    conn, _ = srv.accept()
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    chunks = [data[1:]]
    while True:
        b = conn.recv(1 << 16)
        if not b: break
        chunks.append(b)
    for s in (sys.stdout, sys.stderr):
        try: s.flush()
        except Exception: pass
    saved = [os.dup(i) for i in range(3)]
    for i, fd in enumerate(fds):
        os.dup2(fd, i); os.close(fd)
    status = 0
    try:
        run_cell(b"".join(chunks).decode("utf-8", "replace"))
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        et, ev, tb = sys.exc_info()
        while tb is not None and tb.tb_frame.f_code.co_filename != "<cell>":
            tb = tb.tb_next
        traceback.print_exception(et, ev, tb); status = 1
    for s in (sys.stdout, sys.stderr):
        try: s.flush()
        except Exception: pass
    for i, fd in enumerate(saved):
        os.dup2(fd, i); os.close(fd)
    try:
        conn.sendall(bytes([status & 255])); conn.close()
    except OSError:
        pass
"""

# Session client: one per cell; passes its fds to the server, sends the source, exits with the status.
_REPL_CLIENT = r"""
import os, socket, sys, time
src = sys.stdin.buffer.read()
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
for _ in range(500):
    try:
        s.connect(sys.argv[1]); break
    except (FileNotFoundError, ConnectionRefusedError):
        time.sleep(0.01)
else:
    sys.stderr.write("sandbox: the session's interpreter is not running\n"); os._exit(124)
null = os.open("/dev/null", os.O_RDONLY)
socket.send_fds(s, [b"x"], [null, 1, 2])
s.sendall(src); s.shutdown(socket.SHUT_WR)
st = s.recv(1)
os._exit(st[0] if st else 124)
"""

_SOCKET_PATH = WORKDIR + "/.session.sock"


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


class _Output:
    """Accumulates the demultiplexed exec stream (reader thread) up to a byte cap.

    Past the cap the reader keeps draining (and discarding) until the stream ends: the engine only
    completes a kill once nobody is blocked writing the stream. ``wake`` tells the waiting thread to act.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.parts: dict[int, list[bytes]] = {1: [], 2: []}
        self.size = 0
        self.truncated = False
        self.done = threading.Event()
        self.wake = threading.Event()

    def drain(self, sock: socket.socket) -> None:
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
        return b"".join(self.parts.get(stream, [])).decode("utf-8", "replace")


@dataclass
class _Box:
    """A started container and whether it may still be used."""

    container: Any
    created: float


class DockerSandbox:
    """Hardened Docker containers for untrusted Python, with a warm pool (see the module docstring).

    Args:
        image: the sandbox image (``toolgym sandbox build`` makes the default).
        memory_mb: memory limit, swap included.
        cpus: CPU limit (fractional cores).
        pids: maximum processes/threads in a container (stops fork bombs).
        workdir_mb: size of the ``/work`` tmpfs (``/tmp`` gets a quarter of it).
        max_output_bytes: cap on captured stdout + stderr; past it the run is stopped.
        pool_size: warm containers kept ready for one-shot runs (0 disables the pool).
        container_ttl_s: lifetime written in each container's deadline label; the reaper removes
            containers past it (pool containers are replaced before then).
    """

    def __init__(
        self,
        image: str = DEFAULT_IMAGE,
        *,
        memory_mb: int = 256,
        cpus: float = 1.0,
        pids: int = 64,
        workdir_mb: int = 64,
        max_output_bytes: int = 1 << 20,
        pool_size: int = 2,
        container_ttl_s: float = 3600.0,
    ) -> None:
        if memory_mb < 32 or pids < 8 or cpus <= 0 or workdir_mb < 1 or max_output_bytes < 1 or pool_size < 0:
            raise ValueError(
                "DockerSandbox limits out of range: need memory_mb >= 32, pids >= 8, cpus > 0, workdir_mb >= 1, "
                f"max_output_bytes >= 1, pool_size >= 0; got memory_mb={memory_mb}, pids={pids}, cpus={cpus}, "
                f"workdir_mb={workdir_mb}, max_output_bytes={max_output_bytes}, pool_size={pool_size}"
            )
        self.client = docker_client()
        import docker.errors

        self._errors = docker.errors
        try:
            self.client.images.get(image)
        except docker.errors.ImageNotFound:
            raise SandboxUnavailable(
                f"the sandbox image {image!r} is not built. Fix: run `toolgym sandbox build` "
                "(or `python -m toolgym.tools.sandbox_image`) as root"
            ) from None
        self.image = image
        self.memory_mb = memory_mb
        self.cpus = cpus
        self.pids = pids
        self.workdir_mb = workdir_mb
        self.max_output_bytes = max_output_bytes
        self.pool_size = pool_size
        self.container_ttl_s = container_ttl_s
        self.owner = _owner()
        self.instance = uuid.uuid4().hex[:12]
        self._removers: list[threading.Thread] = []
        self._pool: queue.Queue[_Box] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._wake = threading.Event()
        reap_containers(self.client)
        self._starting = 0
        self._threads = [
            threading.Thread(target=self._refill_loop, name=f"sandbox-pool-{i}", daemon=True)
            for i in range(min(pool_size, 4))
        ]
        self._threads.append(threading.Thread(target=self._reap_loop, name="sandbox-reaper", daemon=True))
        for thread in self._threads:
            thread.start()
        atexit.register(self.close)

    # ----------------------------------------------------------------- public API
    def run(self, code: str, *, timeout: float, stdin: str = "") -> ExecResult:
        """Run ``code`` as a fresh program in a fresh container; the container is discarded after.

        Raises:
            SandboxError: the engine or container failed (not the code: its failures are flags).
        """
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        box = self._take()
        try:
            src = code.encode("utf-8")
            payload = str(len(src)).encode() + b"\n" + src + stdin.encode("utf-8")
            return self._exec(box, ["python3", "-c", _BOOT], payload, timeout)
        finally:
            self._discard(box)

    def session(self) -> SandboxSession:
        """A container kept for one episode; interpreter state persists across its ``run`` calls."""
        return SandboxSession(self)

    def wait_removals(self, timeout: float = 30.0) -> None:
        """Block until containers already handed back have been removed (for leak counts in tests)."""
        with self._lock:
            removers = list(self._removers)
        for thread in removers:
            thread.join(timeout=timeout)

    def close(self) -> None:
        """Stop the pool and remove every container this sandbox created. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout=10)
        while True:
            try:
                box = self._pool.get_nowait()
            except queue.Empty:
                break
            self._remove(box.container)
        with self._lock:
            removers = list(self._removers)
        for thread in removers:
            thread.join(timeout=30)
        # Final sweep through the engine, not memory: whatever carries this instance's label goes.
        with contextlib.suppress(self._errors.DockerException):
            for cid in leaked_containers(self.client, instance=self.instance):
                self._remove(self.client.containers.prepare_model({"Id": cid}))
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    def __enter__(self) -> DockerSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- containers
    def _host_config(self) -> dict[str, Any]:
        mem = f"{self.memory_mb}m"
        return {
            "network_mode": "none",
            "read_only": True,
            "user": SANDBOX_USER,
            "working_dir": WORKDIR,
            "tmpfs": {
                WORKDIR: f"rw,nosuid,nodev,size={self.workdir_mb}m,mode=1777",
                "/tmp": f"rw,nosuid,nodev,noexec,size={max(1, self.workdir_mb // 4)}m,mode=1777",
            },
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges", "seccomp=" + json.dumps(SECCOMP_PROFILE)],
            "pids_limit": self.pids,
            "mem_limit": mem,
            "memswap_limit": mem,
            "nano_cpus": int(self.cpus * 1e9),
            "ipc_mode": "private",
            "log_config": {"type": "json-file", "config": {"max-size": "64k", "max-file": "1"}},
            "labels": {
                LABEL: self.owner,
                INSTANCE_LABEL: self.instance,
                DEADLINE_LABEL: f"{time.time() + self.container_ttl_s:.0f}",
            },
            "detach": True,
            "init": False,
            "stdin_open": False,
        }

    def _start(self) -> _Box:
        if self._closed.is_set():
            raise SandboxError("this DockerSandbox is closed; make a new one")
        try:
            container = self.client.containers.run(self.image, ["sleep", "infinity"], **self._host_config())
        except self._errors.DockerException as exc:
            raise SandboxError(f"could not start a sandbox container from {self.image!r}: {exc}") from exc
        return _Box(container, time.time())

    def _take(self) -> _Box:
        """A never-used warm container, or a cold one when the pool is empty."""
        while True:
            try:
                box = self._pool.get_nowait()
            except queue.Empty:
                self._wake.set()
                return self._start()
            self._wake.set()
            if time.time() - box.created < self.container_ttl_s / 2:
                return box
            self._discard(box)

    def _discard(self, box: _Box) -> None:
        thread = threading.Thread(target=self._remove, args=(box.container,), daemon=True)
        with self._lock:
            self._removers = [t for t in self._removers if t.is_alive()] + [thread]
        thread.start()

    def _remove(self, container: Any) -> None:
        for attempt in range(5):
            try:
                container.remove(force=True)
                break
            except self._errors.NotFound:
                break
            except self._errors.DockerException as exc:
                # e.g. 409 "removal already in progress" right after a kill: try again shortly.
                log.debug("removing %s (attempt %d): %s", container.short_id, attempt + 1, exc)
                time.sleep(0.2 * (attempt + 1))

    def _kill(self, container: Any) -> None:
        with contextlib.suppress(Exception):
            container.kill()

    def _refill_loop(self) -> None:
        # Several of these run at once: container starts are slow (a few hundred ms) but parallel.
        while not self._closed.is_set():
            with self._lock:
                needed = self._pool.qsize() + self._starting < self.pool_size
                self._starting += needed
            if not needed:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self._pool.put(self._start())
            except SandboxError as exc:
                if self._closed.is_set():
                    return
                log.warning("warm pool: %s", exc)
                self._closed.wait(2.0)
            finally:
                with self._lock:
                    self._starting -= 1

    def _reap_loop(self) -> None:
        while not self._closed.wait(5.0):
            with contextlib.suppress(Exception):
                reap_containers(self.client)

    # ----------------------------------------------------------------- exec
    def _exec(
        self,
        box: _Box,
        cmd: list[str],
        stdin: bytes,
        timeout: float,
    ) -> ExecResult:
        """Run ``cmd`` in ``box`` feeding ``stdin``; enforce ``timeout`` and the output cap from here."""
        api = self.client.api
        start = time.monotonic()
        try:
            exec_id = api.exec_create(box.container.id, cmd, stdin=True, user=SANDBOX_USER, workdir=WORKDIR)[
                "Id"
            ]
            stream = api.exec_start(exec_id, socket=True)
        except self._errors.DockerException as exc:
            raise SandboxError(f"exec in sandbox container {box.container.short_id} failed: {exc}") from exc
        sock: socket.socket = getattr(stream, "_sock", stream)
        sock.settimeout(None)
        out = _Output(self.max_output_bytes)

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
            self._kill(box.container)
            if not out.done.wait(30):
                raise SandboxError(f"sandbox container {box.container.short_id} did not stop after a kill")
        duration = time.monotonic() - start
        with contextlib.suppress(OSError):
            sock.close()
        exit_code: int | None = None
        oom = False
        if not killed:
            exit_code = self._exit_code(exec_id)
            if exit_code == 137:
                oom = self._oom_seen(box)
        return ExecResult(
            exit_code=exit_code,
            stdout=out.text(1),
            stderr=out.text(2),
            timed_out=timed_out,
            oom_killed=oom,
            output_truncated=out.truncated,
            duration_s=duration,
        )

    def _exit_code(self, exec_id: str) -> int | None:
        for _ in range(50):
            info = self.client.api.exec_inspect(exec_id)
            if not info.get("Running"):
                return info.get("ExitCode")
            time.sleep(0.01)
        return None

    def _oom_seen(self, box: _Box) -> bool:
        """Whether the container's memory cgroup recorded an OOM kill (cgroup v1 or v2)."""
        probe = (
            "for f in /sys/fs/cgroup/memory.events /sys/fs/cgroup/memory/memory.oom_control; do "
            '[ -r "$f" ] && grep -E "^oom_kill " "$f"; done'
        )
        try:
            exit_code, output = box.container.exec_run(["sh", "-c", probe], user=SANDBOX_USER)
        except self._errors.DockerException:
            return False
        counts = [int(line.split()[1]) for line in output.decode().splitlines() if line.split()[1:2]]
        return any(count > 0 for count in counts)


class SandboxSession:
    """One container for one episode; ``run`` keeps interpreter state (see the module docstring)."""

    def __init__(self, sandbox: DockerSandbox) -> None:
        self.sandbox = sandbox
        self._box: _Box | None = None
        self._closed = False
        self.restarts = 0

    def _ensure(self) -> _Box:
        if self._closed:
            raise SandboxError("this sandbox session is closed")
        if self._box is None:
            box = self.sandbox._take()
            api = self.sandbox.client.api
            try:
                exec_id = api.exec_create(
                    box.container.id,
                    ["python3", "-c", _REPL_SERVER, _SOCKET_PATH],
                    user=SANDBOX_USER,
                    workdir=WORKDIR,
                )["Id"]
                api.exec_start(exec_id, detach=True)
            except self.sandbox._errors.DockerException as exc:
                self.sandbox._discard(box)
                raise SandboxError(f"could not start the session interpreter: {exc}") from exc
            self._box = box
        return self._box

    def run(self, code: str, *, timeout: float) -> ExecResult:
        """Run one cell; the value of a final bare expression is printed, as in a REPL.

        A timeout or output flood kills the container: the next call starts from a fresh interpreter.
        """
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        box = self._ensure()
        result = self.sandbox._exec(
            box, ["python3", "-c", _REPL_CLIENT, _SOCKET_PATH], code.encode("utf-8"), timeout
        )
        if result.timed_out or result.output_truncated or result.oom_killed or result.exit_code == 124:
            # The interpreter (and its state) is gone or untrustworthy: start over next time.
            self.restarts += 1
            self.sandbox._discard(box)
            self._box = None
        return result

    def close(self) -> None:
        """Remove the container. Idempotent."""
        self._closed = True
        if self._box is not None:
            self.sandbox._discard(self._box)
            self._box = None

    def __enter__(self) -> SandboxSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalSandbox:
    """Runs Python in a local subprocess with rlimits. NOT a security boundary.

    The code runs as the current user with full access to the network, the file system and every
    process the user can reach. Use it only for trusted code (your own snippets, tests of the harness
    itself), never for model output. It warns at construction for that reason.
    """

    def __init__(self, *, memory_mb: int = 512, max_output_bytes: int = 1 << 20) -> None:
        warnings.warn(
            "LocalSandbox is not a security boundary: use it only for trusted code (DockerSandbox isolates)",
            RuntimeWarning,
            stacklevel=2,
        )
        self.memory_mb = memory_mb
        self.max_output_bytes = max_output_bytes

    def run(self, code: str, *, timeout: float, stdin: str = "") -> ExecResult:
        limit = self.memory_mb * 1024 * 1024

        def limits() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=limits,
            start_new_session=True,
        )
        timed_out = False
        try:
            out, err = proc.communicate(stdin.encode(), timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            out, err = proc.communicate()
        cap = self.max_output_bytes
        return ExecResult(
            exit_code=None if timed_out else proc.returncode,
            stdout=out[:cap].decode("utf-8", "replace"),
            stderr=err[: max(0, cap - len(out))].decode("utf-8", "replace"),
            timed_out=timed_out,
            oom_killed=False,
            output_truncated=len(out) + len(err) > cap,
            duration_s=time.monotonic() - start,
        )


def new_nonce() -> str:
    """A random tag for results that must not be forgeable by printing."""
    return uuid.uuid4().hex
