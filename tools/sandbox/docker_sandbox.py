"""``DockerSandbox``: untrusted Python in hardened Docker containers, one-shot or in sessions.

The threat model and its defences: :mod:`toolgym.tools.sandbox`.

Latency. A container start costs hundreds of ms and a ``docker exec`` tens. A warm pool keeps a few
started containers idle. A one-shot :meth:`DockerSandbox.run` (``one_shot="resident"``, the default)
goes to a resident runner (:mod:`toolgym.tools.sandbox.resident`): a trusted program started with one
exec in a container, which runs each call in a fresh interpreter forked from a pre-imported zygote,
as the sandbox user, over the exec's attached stream: no exec per call. A container then serves
further one-shot calls, but only after the runner has killed every process of the sandbox user,
emptied ``/work``, ``/tmp``, ``/dev/shm``, ``/dev/mqueue`` and the IPC namespace, and *measured* the
container back at its baseline (free space and inodes, memory, sockets, locks; the clean-up and the
checks within :data:`~toolgym.tools.sandbox.resident.CLEANUP_BOUND_S`, paid by the call that needs
them); a timeout, output flood, failed or slow clean-up, or anything still held retires it (as do
half its lifetime and ``MAX_RUNS`` calls), counted in :attr:`DockerSandbox.retirements`. Up to
``pool_size`` such containers are kept idle besides the warm pool; with ``pool_size=0`` each run
starts a container and a runner and throws both away. ``one_shot="exec"`` runs one
exec per call in a never-used container, thrown away after. Harness runs and sessions always get a
never-used container.

Sessions. :meth:`DockerSandbox.session` keeps one container for an episode. Interpreter state survives
across :meth:`SandboxSession.run` calls: a server process inside the container holds the globals, and
each call is a short ``exec`` client that hands the server its stdout/stderr (``SCM_RIGHTS``), so output
streams back exactly like a one-shot run. A timeout or output flood kills the container; the session
then starts over in a fresh one (the result says the state was lost).

The programs that run inside containers are ordinary files shipped with the package
(``programs/*.py``); the host only reads their text.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import queue
import threading
import time
import uuid
from typing import Any

from toolgym.errors import SandboxError
from toolgym.tools.sandbox.execution import Box, ExecResult, cpu_seconds, exec_in, program_source
from toolgym.tools.sandbox.policy import (
    HARNESS_USER,
    REMAPPED_SANDBOX_UIDS,
    SANDBOX_UIDS,
    container_config,
    new_sandbox_uid,
)
from toolgym.tools.sandbox.reaper import (
    DEADLINE_LABEL,
    INSTANCE_LABEL,
    LABEL,
    UID_LABEL,
    SandboxUnavailable,
    docker_client,
    engine_remaps_users,
    leaked_containers,
    owner_label,
    reap_containers,
    reap_forever,
    uids_in_use,
)
from toolgym.tools.sandbox.resident import ResidentRunner
from toolgym.tools.sandbox.session import Boxes, SandboxSession

__all__ = ["DEFAULT_IMAGE", "DockerSandbox", "new_nonce"]

log = logging.getLogger(__name__)

#: Image used when none is given; built by ``toolgym sandbox build``.
DEFAULT_IMAGE = "toolgym-sandbox:1"


class DockerSandbox:
    """Hardened Docker containers for untrusted Python, with a warm pool (see the module docstring).

    Args:
        image: the sandbox image (``toolgym sandbox build`` makes the default).
        memory_mb: memory limit, swap included.
        cpus: CPU limit (fractional cores).
        pids: maximum processes/threads in a container (stops fork bombs).
        workdir_mb: size of the ``/work`` tmpfs (``/tmp`` gets a quarter of it).
        file_mb: largest file any process may write (``RLIMIT_FSIZE``).
        max_output_bytes: cap on captured stdout + stderr; past it the run is stopped.
        pool_size: warm containers kept ready (0 disables the pool), and the most idle resident
            runners kept for further one-shot runs.
        container_ttl_s: lifetime of a container: it stops itself then, whoever owns it. Pool
            containers are replaced at half of it, so a run or session gets at least the other half.
        one_shot: how :meth:`run` runs code: ``"resident"`` (a resident runner, containers reused
            after clean-up) or ``"exec"`` (one exec in a never-used container per run).
    """

    def __init__(
        self,
        image: str = DEFAULT_IMAGE,
        *,
        memory_mb: int = 256,
        cpus: float = 1.0,
        pids: int = 64,
        workdir_mb: int = 64,
        file_mb: int = 16,
        max_output_bytes: int = 1 << 20,
        pool_size: int = 2,
        container_ttl_s: float = 3600.0,
        one_shot: str = "resident",
    ) -> None:
        if one_shot not in ("resident", "exec"):
            raise ValueError(f"one_shot must be 'resident' or 'exec', got {one_shot!r}")
        if (
            memory_mb < 32
            or pids < 8
            or cpus <= 0
            or workdir_mb < 1
            or file_mb < 1
            or max_output_bytes < 1
            or pool_size < 0
            or container_ttl_s < 2
        ):
            raise ValueError(
                "DockerSandbox limits out of range: need memory_mb >= 32, pids >= 8, cpus > 0, workdir_mb >= 1, "
                "file_mb >= 1, max_output_bytes >= 1, pool_size >= 0, container_ttl_s >= 2; got "
                f"memory_mb={memory_mb}, pids={pids}, cpus={cpus}, workdir_mb={workdir_mb}, file_mb={file_mb}, "
                f"max_output_bytes={max_output_bytes}, pool_size={pool_size}, container_ttl_s={container_ttl_s}"
            )
        self.client = docker_client()
        import docker.errors

        self._errors = docker.errors
        try:
            self._image_id: str = self.client.images.get(image).id
        except docker.errors.ImageNotFound:
            raise SandboxUnavailable(
                f"the sandbox image {image!r} is not built. Fix: run `toolgym sandbox build` "
                "(or `python -m toolgym.tools.sandbox.image`) as root"
            ) from None
        self.image = image
        try:
            remapped = engine_remaps_users(self.client.info())
        except (docker.errors.DockerException, OSError) as exc:
            raise SandboxUnavailable(f"the Docker engine does not answer `docker info`: {exc}") from None
        #: The uids a container's sandbox user is drawn from (one per container).
        self.sandbox_uids = REMAPPED_SANDBOX_UIDS if remapped else SANDBOX_UIDS
        self.memory_mb = memory_mb
        self.cpus = cpus
        self.pids = pids
        self.workdir_mb = workdir_mb
        self.file_mb = file_mb
        self.max_output_bytes = max_output_bytes
        self.pool_size = pool_size
        self.container_ttl_s = container_ttl_s
        self.one_shot = one_shot
        self._idle: list[ResidentRunner] = []  # resident runners ready for a call, newest last
        #: Resident containers retired so far, by reason (``"held resources"``, ``"slow clean-up"``,
        #: ``"timeout"``, ...: :attr:`ResidentRunner.retired_because`).
        self.retirements: collections.Counter[str] = collections.Counter()
        self._idle_lock = threading.Lock()
        self.owner = owner_label()
        self.instance = uuid.uuid4().hex[:12]
        self._removers: list[threading.Thread] = []
        self._pool: queue.Queue[Box] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._wake = threading.Event()
        reap_containers(self.client)
        self._starting = 0
        self._threads = [
            threading.Thread(target=self._refill_loop, name=f"sandbox-pool-{i}", daemon=True)
            for i in range(min(pool_size, 4))
        ]
        self._threads.append(
            threading.Thread(
                target=reap_forever, args=(self.client, self._closed), name="sandbox-reaper", daemon=True
            )
        )
        for thread in self._threads:
            thread.start()
        atexit.register(self.close)

    # ----------------------------------------------------------------- public API

    def image_id(self) -> str:
        """The content id (``sha256:...``) of the image the sandbox was started with."""
        return self._image_id

    def run(
        self, code: str, *, timeout: float, stdin: str = "", cpu_time_s: float | None = None
    ) -> ExecResult:
        """Run ``code`` as a fresh program as the sandbox user (see the module docstring's Latency).

        Args:
            code: Python source, run as ``__main__`` by the sandbox user.
            timeout: wall-clock seconds before the host kills the container.
            stdin: the program's standard input.
            cpu_time_s: CPU-time limit of the program (rounded up to whole seconds); the timeout
                when ``None``.

        Raises:
            SandboxError: the engine or container failed (not the code: its failures are flags).
        """
        cpu = cpu_seconds(timeout, cpu_time_s)
        src = code.encode("utf-8")
        if self.one_shot == "resident":
            runner = self._take_runner()
            try:
                return runner.call(
                    src, stdin.encode("utf-8"), cpu_s=cpu, timeout=timeout, cap=self.max_output_bytes,
                    file_limit_mb=self.file_mb,
                )  # fmt: skip
            finally:
                self._give_back(runner)
        payload = str(len(src)).encode() + b"\n" + src + stdin.encode("utf-8")
        box = self._take()
        try:
            boot = program_source("toolgym.tools.sandbox", "programs/boot")
            return self._exec(box, ["python3", "-c", boot, str(cpu)], payload, timeout, cpu_limit_s=cpu)
        finally:
            self._discard(box)

    def run_harness(self, program: str, *, stdin: str, timeout: float) -> ExecResult:
        """Run a trusted harness ``program`` in a fresh container, as :data:`HARNESS_USER`.

        The program runs as the container's root, which holds only CAP_SETUID, CAP_SETGID and
        CAP_KILL: it must start any untrusted code it runs as the container's sandbox user itself
        (``uid:gid``, the program's one argument), which then cannot signal, trace or read it. No
        CPU-time limit is set (the harness sets its own on the code); the wall-clock ``timeout`` and
        the output cap apply.

        Raises:
            SandboxError: the engine or container failed, or the container was stopped from outside.
        """
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        box = self._take()
        try:
            cmd = ["python3", "-I", "-B", "-c", program, box.user]
            return self._exec(box, cmd, stdin.encode("utf-8"), timeout, user=HARNESS_USER)
        finally:
            self._discard(box)

    def session(self) -> SandboxSession:
        """A container kept for one episode; interpreter state persists across its ``run`` calls."""
        return SandboxSession(
            Boxes(
                self._take,
                self._discard,
                self._exec,
                self.client.api,
                (self._errors.DockerException, OSError),
            )
        )

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
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for runner in idle:
            runner.close()
            self._remove(runner.box.container)
        self.wait_removals()
        # Final sweep through the engine, not memory: whatever carries this instance's label goes.
        with contextlib.suppress(self._errors.DockerException, OSError):
            for cid in leaked_containers(self.client, instance=self.instance):
                self._remove(self.client.containers.prepare_model({"Id": cid}))
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    def __enter__(self) -> DockerSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- containers
    def _host_config(self, uid: int | None = None) -> dict[str, Any]:
        """``containers.run`` keyword arguments: the policy's settings plus this sandbox's labels.

        ``uid``: the container's sandbox uid (a fresh one, unused by the engine's other containers,
        when ``None``).
        """
        if uid is None:
            uid = new_sandbox_uid(uids_in_use(self.client), self.sandbox_uids)
        config = container_config(
            memory_mb=self.memory_mb,
            cpus=self.cpus,
            pids=self.pids,
            workdir_mb=self.workdir_mb,
            file_mb=self.file_mb,
            ttl_s=self.container_ttl_s,
        )
        config["labels"] = {
            LABEL: self.owner,
            INSTANCE_LABEL: self.instance,
            DEADLINE_LABEL: f"{time.time() + self.container_ttl_s:.0f}",
            UID_LABEL: str(uid),
        }
        return config

    def _start(self) -> Box:
        if self._closed.is_set():
            raise SandboxError("this DockerSandbox is closed; make a new one")
        try:
            config = self._host_config()
            container = self.client.containers.run(self.image, **config)
        except (self._errors.DockerException, OSError) as exc:
            raise SandboxError(f"could not start a sandbox container from {self.image!r}: {exc}") from exc
        return Box(container, time.time(), int(config["labels"][UID_LABEL]))

    def _take(self) -> Box:
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

    def _take_runner(self) -> ResidentRunner:
        """An idle resident runner young enough, or a new one in a container from :meth:`_take`."""
        while True:
            with self._idle_lock:
                runner = self._idle.pop() if self._idle else None
            if runner is None:
                break
            if runner.reusable and time.time() - runner.box.created < self.container_ttl_s / 2:
                return runner
            runner.close("age")
            self._retire(runner)
        box = self._take()
        try:
            return ResidentRunner.start(
                self.client,
                box,
                program_source("toolgym.tools.sandbox", "programs/resident"),
                program_source("toolgym.tools.sandbox", "programs/boot"),
                program_source("toolgym.tools.sandbox", "programs/baseline"),
            )
        except SandboxError:
            self._discard(box)
            raise

    def _give_back(self, runner: ResidentRunner) -> None:
        with self._idle_lock:
            keep = runner.reusable and not self._closed.is_set() and len(self._idle) < self.pool_size
            if keep:
                self._idle.append(runner)
        if not keep:
            self._retire(runner)

    def _retire(self, runner: ResidentRunner) -> None:
        runner.close("pool full" if runner.reusable else "closed")
        with self._lock:
            self.retirements[runner.retired_because or "closed"] += 1
        self._discard(runner.box)

    def _discard(self, box: Box) -> None:
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
            except (self._errors.DockerException, OSError) as exc:
                # e.g. 409 "removal already in progress" (auto-remove after a kill): try again shortly.
                log.debug("removing %s (attempt %d): %s", container.short_id, attempt + 1, exc)
                time.sleep(0.2 * (attempt + 1))

    def _kill(self, container: Any) -> None:
        with contextlib.suppress(self._errors.DockerException, OSError):
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

    def _exec(
        self,
        box: Box,
        cmd: list[str],
        stdin: bytes,
        timeout: float,
        *,
        user: str | None = None,
        cpu_limit_s: int = 0,
    ) -> ExecResult:
        return exec_in(
            self.client,
            box,
            cmd,
            stdin,
            timeout,
            cap=self.max_output_bytes,
            user=user,
            cpu_limit_s=cpu_limit_s,
            file_limit_mb=self.file_mb,
        )


def new_nonce() -> str:
    """A random tag for results that must not be forgeable by printing."""
    return uuid.uuid4().hex
