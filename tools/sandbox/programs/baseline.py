"""What "clean" means for a resident container: its state, measured, against the state before any call.

Trusted; run by the resident runner (``resident.py``, the container's root), which executes this
file's text and calls :func:`measure` once before the first call (the baseline) and after each
call's clean-up, then :func:`compare`. Nothing here trusts names: a call may leave resources that no
process owns and no directory lists, such as descriptors "in flight" in a unix socket that holds
itself (freed only whenever the kernel's garbage collector next runs) or a port in ``TIME_WAIT``. So
the runner measures what the next call could lose. The container is clean when every one of these
holds:

* **space**: every writable mount (``rw`` in ``/proc/self/mountinfo``, except ``proc``, ``sysfs``,
  ``cgroup`` and ``devpts``: the tmpfs ``/work``, ``/tmp``, ``/dev/shm``, ``/dev`` and the
  ``mqueue``) has at least its baseline free blocks and free inodes (``statvfs``);
* **memory**: the memory cgroup's usage that reclaim cannot free (cgroup v2: ``memory.current`` less
  file pages and reclaimable slab; v1: ``memory.usage_in_bytes`` less file pages) is at most
  :data:`MEMORY_SLACK` above the baseline;
* **sockets**: every unix socket of the container's network namespace (``/proc/net/unix``, by
  inode) was there at the baseline (the runner's own pair), and the namespace's counts in
  ``/proc/net/sockstat`` and ``sockstat6`` (TCP, UDP, UDP-Lite and raw sockets in use, TCP
  connections in ``TIME_WAIT``) are no higher than at the baseline: no port is held. (The socket
  tables, ``/proc/net/tcp`` and the like, are the machine's: reading them costs milliseconds.)
* **locks**: ``/proc/locks`` lists no lock on the container's own file systems (anonymous devices:
  the overlay root and the tmpfs mounts) that was not there at the baseline.

Any descriptor in flight is carried by a unix socket, so the socket rule alone catches every
resource held that way (files, memory, names, ports, locks); the other rules measure the resources
themselves. A file lock outlives its processes only through such a descriptor (locks belong to
processes or to open files), and reading ``/proc/locks`` takes a machine-wide lock that costs
milliseconds (often tens of them on a busy machine), so locks are measured when the call left
anything by name, not after every call.

Before those rules, :func:`left_by_name` tells whether the call left anything the clean-up removes
by name (a process, an entry in a writable directory but the call's own ``/work/main.py``, a
System V IPC object). When it left nothing, the runner skips the clean-up (the cleaner waits for the
next call) and only measures. Imported as a module it does nothing.
"""

from __future__ import annotations

import contextlib
import os

#: Unreclaimable memory a clean container may hold above its baseline (the runner's own allocations,
#: kernel objects of files the image's interpreter read).
MEMORY_SLACK = 16 << 20
_NOT_MEASURED = ("proc", "sysfs", "cgroup", "cgroup2", "devpts")
#: The directories the untrusted code may write (the clean-up empties them).
SCRATCH = ("/work", "/tmp", "/dev/shm", "/dev/mqueue")
MAIN = "/work/main.py"


def alive() -> list[int]:
    """Processes of the calls still alive: every process but root's and this one's (zombies aside).

    By real uid, read from ``status``: a process can make its ``/proc`` entry root's (non-dumpable).
    """
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            state, uid = fields["State"].split()[0], int(fields["Uid"].split()[0])
        except (OSError, KeyError, IndexError, ValueError):
            continue
        if uid != 0 and state not in ("Z", "X"):
            found.append(int(name))
    return found


def ipc_ids(kind: str) -> list[int]:
    """Ids of the container's System V IPC objects of ``kind`` (``shm``, ``sem``, ``msg``)."""
    try:
        with open(f"/proc/sysvipc/{kind}") as f:
            rows = [line.split() for line in f.readlines()[1:]]
    except OSError:
        return []
    return [int(row[1]) for row in rows if len(row) > 1 and row[1].isdigit()]


def left_by_name() -> str:
    """What the last call left that the clean-up removes by name, in words; ``""`` for nothing.

    Run by root once the call's worker has ended. No process of the calls alive means none can
    appear (only the zygote forks, on request), so what is found stays found. ``/work/main.py``, the
    call's own program, is removed here (root owns ``/work``; a link is removed, never followed).
    """
    if alive():
        return "processes"
    for top in SCRATCH:
        with contextlib.suppress(FileNotFoundError):
            names = os.listdir(top)
            if top + "/main.py" == MAIN and "main.py" in names and os.path.isfile(MAIN):
                os.unlink(MAIN)
                names.remove("main.py")
            if names:
                return f"files in {top}"
    for kind in ("shm", "sem", "msg"):
        if ipc_ids(kind):
            return f"System V {kind} objects"
    return ""


_SOCKSTAT = ("sockstat", "sockstat6")


def _mounts() -> tuple[list[str], set[tuple[int, int]]]:
    """Writable mount points to measure, and the devices of the container's own file systems."""
    writable, own = [], set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            point, options, fstype = fields[4], fields[5].split(","), fields[sep + 1]
            major, minor = (int(x) for x in fields[2].split(":"))
            if fstype in _NOT_MEASURED:
                continue
            if "rw" in options and os.path.isdir(point):
                writable.append(point.replace("\\040", " "))
            if major == 0:
                own.add((major, minor))
    return writable, own


def _memory() -> int:
    """Bytes of the memory cgroup's usage that reclaim cannot free (0 when no cgroup is readable)."""
    for stat, usage, v2 in (
        ("/sys/fs/cgroup/memory.stat", "/sys/fs/cgroup/memory.current", True),
        ("/sys/fs/cgroup/memory/memory.stat", "/sys/fs/cgroup/memory/memory.usage_in_bytes", False),
    ):
        with contextlib.suppress(OSError, ValueError):
            with open(usage) as f:
                total = int(f.read())
            values = {}
            with open(stat) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    values[name] = int(value)
            if v2:
                freeable = ("inactive_file", "active_file", "slab_reclaimable")
            else:
                freeable = ("total_inactive_file", "total_active_file")
            return total - sum(values.get(name, 0) for name in freeable)
    return 0


def _unix() -> set[int]:
    with open("/proc/net/unix") as f:
        return {int(row[6]) for row in (line.split() for line in f.readlines()[1:]) if len(row) > 6}


def _inet() -> dict[str, int]:
    """The network namespace's socket counts: ``{"TCP inuse": n, "TCP tw": n, "UDP inuse": n, ...}``."""
    counts = {}
    for name in _SOCKSTAT:
        with contextlib.suppress(OSError), open(f"/proc/net/{name}") as f:
            for line in f:
                proto, _, rest = line.partition(":")
                fields = rest.split()
                for key, value in zip(fields[::2], fields[1::2], strict=False):
                    if key in ("inuse", "tw") and proto != "sockets" and value.isdigit():
                        counts[f"{proto} {key}"] = int(value)
    return counts


def _locks(own: set[tuple[int, int]]) -> set[str]:
    held = set()
    with contextlib.suppress(OSError), open("/proc/locks") as f:
        for line in f:
            cols = line.split()
            if "->" in cols or len(cols) < 8:
                continue  # a waiter, not a lock
            major, minor, inode = cols[5].split(":")
            if (int(major, 16), int(minor, 16)) in own:
                held.add(" ".join([cols[1], cols[3], cols[5], *cols[6:8]]))
    return held


def measure(state: dict[str, object] | None = None, *, locks: bool = True) -> dict[str, object]:
    """The container's state; pass the baseline to measure the same mounts and devices again.

    ``locks=False`` leaves file locks out (see the module docstring).
    """
    if state is None:
        writable, own = _mounts()
    else:
        writable, own = state["writable"], state["own"]  # type: ignore[assignment]
    space = {}
    for point in writable:
        with contextlib.suppress(OSError):
            st = os.statvfs(point)
            space[point] = (st.f_bfree, st.f_ffree)
    return {
        "writable": writable,
        "own": own,
        "space": space,
        "memory": _memory(),
        "unix": _unix(),
        "inet": _inet(),
        "locks": _locks(own) if locks else None,
    }


def compare(base: dict[str, object], now: dict[str, object]) -> str:
    """What keeps the container from its baseline, in words; ``""`` when it is clean."""
    for point, (blocks, inodes) in base["space"].items():  # type: ignore[attr-defined]
        free = now["space"].get(point, (-1, -1))  # type: ignore[attr-defined]
        if free[0] < blocks or free[1] < inodes:
            return (
                f"{point}: {free[0]} blocks and {free[1]} inodes free, {blocks} and {inodes} before any call"
            )
    grown = now["memory"] - base["memory"]  # type: ignore[operator]
    if grown > MEMORY_SLACK:
        return f"memory: {grown / 2**20:.1f} MiB above the baseline that no process of the call holds"
    extra = sorted(now["unix"] - base["unix"])  # type: ignore[operator]
    if extra:
        return f"unix sockets: {len(extra)} that no process holds (in flight), inodes {extra[:4]}"
    before: dict[str, int] = base["inet"]  # type: ignore[assignment]
    grown = {k: v for k, v in now["inet"].items() if v > before.get(k, 0)}  # type: ignore[attr-defined]
    if grown:
        counts = ", ".join(f"{k} {v} (before any call {before.get(k, 0)})" for k, v in sorted(grown.items()))
        return f"inet sockets: {counts}: a port held or in TIME_WAIT"
    locks = sorted(now["locks"] - base["locks"]) if now.get("locks") is not None else []  # type: ignore[operator]
    if locks:
        return f"file locks: {len(locks)} held by no process: {locks[:2]}"
    return ""
