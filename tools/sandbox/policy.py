"""The sandbox's security policy: who runs what, and everything a container is allowed to do.

Two users share a container, with different uids, so the code can neither signal, trace nor read
the trusted side:

* the container's sandbox user runs all untrusted code, with no capabilities: the engine gives
  exec'd non-root processes none (Docker >= 20.10.14; a test checks it), processes the harness
  starts lose them at ``setuid``, and ``no-new-privileges`` stops setuid binaries from handing any
  out. Its uid (and gid) is drawn per container from :data:`SANDBOX_UIDS`
  (:func:`new_sandbox_uid`), unused by any other sandbox container on the engine: the kernel counts
  some resources per user across the whole machine (descriptors in flight in unix sockets against
  ``RLIMIT_NOFILE``, inotify instances, pipe buffer pages, POSIX message queue bytes), so with one
  uid for every container, one episode could exhaust them for all the others. (An engine-level user
  namespace, dockerd's ``userns-remap``, maps every container into the same range, so the sandbox
  user would still be one kernel user in all of them; a uid per container needs no engine setup.
  On such an engine the uid is drawn from :data:`REMAPPED_SANDBOX_UIDS`, which its namespace maps:
  distinct inside, distinct outside.) The uid has no ``/etc/passwd`` entry.
* :data:`HARNESS_USER` (the container's root) runs PID 1 and the trusted harness programs (the
  hidden-test runner). Root here holds just :data:`HARNESS_CAPS`: CAP_SETUID/CAP_SETGID to start the
  code as the sandbox user, CAP_KILL to clear out the code's processes. PID 1 is ``sleep <ttl>``: the
  container ends itself at its deadline (the kernel kills every other process when PID 1 exits), even
  if its owner died and no reaper runs. The code cannot signal it or open its file descriptors
  (``/proc/1/fd/*``), so it can neither stop the container early nor write into the engine's log.

Container settings (:func:`container_config`): no network; read-only root; size-capped ``tmpfs``
workdir and ``/tmp``; the capabilities above and nothing else; ``no-new-privileges``; the seccomp
profile below (ptrace, namespaces, mounts, kernel surfaces); pids, memory (swap included) and CPU
limits; rlimits on file size (``fsize``) and core dumps; no engine log (``log_driver=none``): output
comes back only through exec streams, which the host caps. CPU time per run is limited by the
in-container programs (``RLIMIT_CPU``), because a per-process limit must be set per run.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Collection
from typing import Any

__all__ = [
    "HARNESS_CAPS",
    "HARNESS_USER",
    "REMAPPED_SANDBOX_UIDS",
    "SANDBOX_UIDS",
    "SECCOMP_PROFILE",
    "WORKDIR",
    "container_config",
    "new_sandbox_uid",
    "sandbox_user",
]

#: The uids a container's sandbox user is drawn from: far above the host's own users, the usual
#: subordinate-id ranges of rootless engines, and 2**31 (which some software reads as negative).
SANDBOX_UIDS = range(2_000_000_000, 2_140_000_000)
#: The same, on an engine that maps containers into a user namespace (``userns-remap``: uids 0-65535).
REMAPPED_SANDBOX_UIDS = range(10_000, 65_000)
#: PID 1 and trusted harness programs: the container's root, limited to :data:`HARNESS_CAPS`.
HARNESS_USER = "0:0"
HARNESS_CAPS = ("SETUID", "SETGID", "KILL")
WORKDIR = "/work"


def new_sandbox_uid(taken: Collection[int] = (), uids: range = SANDBOX_UIDS) -> int:
    """A random uid of ``uids`` not in ``taken`` (the uids of the engine's other containers).

    Two processes drawing at the same moment could still meet: one chance in ``len(uids)`` per pair.
    """
    if len(taken) >= len(uids):
        raise ValueError(f"every sandbox uid of {uids} is taken")
    while True:
        uid = uids.start + secrets.randbelow(len(uids))
        if uid not in taken:
            return uid


def sandbox_user(uid: int) -> str:
    """The ``user`` argument of an exec as the sandbox user ``uid`` (its gid is the same number)."""
    return f"{uid}:{uid}"


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


def container_config(
    *, memory_mb: int, cpus: float, pids: int, workdir_mb: int, file_mb: int, ttl_s: float
) -> dict[str, Any]:
    """Keyword arguments for ``containers.run`` (labels aside): the policy above, with these limits.

    The command is ``sleep <ttl_s>`` as PID 1, so the container stops itself at its deadline; it is
    removed automatically once stopped.
    """
    mem = f"{memory_mb}m"
    fsize = file_mb * 1024 * 1024
    return {
        "command": ["sleep", f"{max(1, int(ttl_s))}"],
        "user": HARNESS_USER,
        "network_mode": "none",
        "read_only": True,
        "working_dir": WORKDIR,
        "tmpfs": {
            WORKDIR: f"rw,nosuid,nodev,size={workdir_mb}m,mode=1777",
            "/tmp": f"rw,nosuid,nodev,noexec,size={max(1, workdir_mb // 4)}m,mode=1777",
        },
        "cap_drop": ["ALL"],
        "cap_add": list(HARNESS_CAPS),
        "security_opt": ["no-new-privileges", "seccomp=" + json.dumps(SECCOMP_PROFILE)],
        "pids_limit": pids,
        "mem_limit": mem,
        "memswap_limit": mem,
        "nano_cpus": int(cpus * 1e9),
        "ipc_mode": "private",
        "ulimits": [
            {"Name": "fsize", "Soft": fsize, "Hard": fsize},
            {"Name": "core", "Soft": 0, "Hard": 0},
        ],
        "log_config": {"type": "none", "config": {}},
        "auto_remove": True,
        "detach": True,
        "init": False,
        "stdin_open": False,
    }
