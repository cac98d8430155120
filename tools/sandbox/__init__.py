"""The code sandbox: untrusted Python in hardened Docker containers (``DockerSandbox``).

Threat model. The code comes from a language model being trained with RL, so assume it is adversarial:
it may try to exhaust the host (fork bombs, memory, CPU, disk, output floods, the engine's log), to
escape (the Docker socket, setuid binaries, ptrace, namespaces), to reach the network, to outlive its
time limit or its owner, or to tamper with the trusted harness that scores it. The defences:

* the container policy of :mod:`toolgym.tools.sandbox.policy` (one screen: users, capabilities,
  seccomp, limits, no engine log), applied to every container;
* wall-clock timeouts enforced from the host: the calling thread waits with a deadline and kills the
  container, while separate threads drain output and feed stdin. (Killing from the reader thread would
  block until the API call's own timeout, because the reader owns the stream the kill must close.)
  Output is capped; past the cap the run is stopped. CPU time per run (``RLIMIT_CPU``) and file size
  (``RLIMIT_FSIZE``) are limited inside the container, and the result says when either ended a run;
* a container ends itself at its deadline (PID 1 is a ``sleep`` of its lifetime), and the reaper of
  :mod:`toolgym.tools.sandbox.reaper` removes leftovers of dead processes;
* a container that stops while something runs in it was stopped from outside (the code cannot reach
  PID 1): that is a :class:`~toolgym.errors.SandboxError`, never a result;
* a container reused for one-shot runs keeps nothing of one run for the next (see Latency); the
  runner and its zygote run as root (different uid, not dumpable), so the code can neither signal,
  trace nor read them, and the zygote never holds a run's code, input or output;
* each container's code runs as a uid of its own (:func:`~toolgym.tools.sandbox.policy.new_sandbox_uid`),
  so what the kernel counts per user (descriptors in flight, inotify instances, pipe buffers) one
  container spends, no other container loses.

Accepted residual (decided, not an oversight). A container reused for one-shot runs shares two kinds
of *metadata* between consecutive runs, never content: counters that only grow (the next pid number,
inode numbers of new files) and the cgroup's peak-memory figure (``memory.peak``). A run can learn from
them roughly how many processes or files earlier runs made and how much memory the largest used: no
code, input, output, file or test of another run, and nothing that changes a score (the hidden tests
run in a fresh container per verification, see ``envs/code_exec``). Closing it would cost a fresh
container per run (the latency the resident runner exists to save); a deployment that needs runs
unable to see each other's footprint sets ``one_shot = "exec"`` (a never-used container per run).

Modules: ``docker_sandbox`` (:class:`DockerSandbox`: warm pool, one-shot runs, sessions) ·
``resident`` (one-shot runs through a resident runner, the container measured back at its baseline) ·
``session`` (one container per episode) · ``policy`` (container hardening, a uid per container) ·
``reaper`` (engine connection, labels, orphan reaping) · ``execution`` (one exec: stdin, capped
output, deadline) · ``image`` (offline image build) · ``programs/`` (what runs inside a container;
the host only reads their text).
"""

from __future__ import annotations

from toolgym.tools.sandbox.docker_sandbox import DEFAULT_IMAGE, DockerSandbox, new_nonce
from toolgym.tools.sandbox.execution import ExecResult, program_source
from toolgym.tools.sandbox.policy import HARNESS_USER, SANDBOX_UIDS, SECCOMP_PROFILE, WORKDIR, sandbox_user
from toolgym.tools.sandbox.reaper import (
    DEADLINE_LABEL,
    INSTANCE_LABEL,
    LABEL,
    UID_LABEL,
    SandboxUnavailable,
    docker_client,
    leaked_containers,
    reap_containers,
)
from toolgym.tools.sandbox.session import SandboxSession

__all__ = [
    "DEADLINE_LABEL",
    "DEFAULT_IMAGE",
    "HARNESS_USER",
    "INSTANCE_LABEL",
    "LABEL",
    "SANDBOX_UIDS",
    "SECCOMP_PROFILE",
    "UID_LABEL",
    "WORKDIR",
    "DockerSandbox",
    "ExecResult",
    "SandboxSession",
    "SandboxUnavailable",
    "docker_client",
    "leaked_containers",
    "new_nonce",
    "program_source",
    "reap_containers",
    "sandbox_user",
]
