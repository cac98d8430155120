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
  inode) was there at the baseline (the runner's own pair), and ``/proc/net/tcp``, ``tcp6``, ``udp``
  and ``udp6`` list no socket that was not (a listening port, a connection in ``TIME_WAIT``);
* **locks**: ``/proc/locks`` lists no lock on the container's own file systems (anonymous devices:
  the overlay root and the tmpfs mounts) that was not there at the baseline.

Any descriptor in flight is carried by a unix socket, so the socket rule alone catches every
resource held that way (files, memory, names, ports, locks); the other rules measure the resources
themselves. Imported as a module it does nothing.
"""

from __future__ import annotations

import contextlib
import os

#: Unreclaimable memory a clean container may hold above its baseline (the runner's own allocations,
#: kernel objects of files the image's interpreter read).
MEMORY_SLACK = 16 << 20
_NOT_MEASURED = ("proc", "sysfs", "cgroup", "cgroup2", "devpts")
_INET = ("tcp", "tcp6", "udp", "udp6")


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


def _inet() -> set[str]:
    rows = set()
    for name in _INET:
        with contextlib.suppress(OSError), open(f"/proc/net/{name}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if len(cols) > 9:  # local, remote, state, inode
                    rows.add(f"{name} {cols[1]} {cols[2]} {cols[3]} {cols[9]}")
    return rows


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


def measure(state: dict[str, object] | None = None) -> dict[str, object]:
    """The container's state; pass the baseline to measure the same mounts and devices again."""
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
        "locks": _locks(own),
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
    sockets = sorted(now["inet"] - base["inet"])  # type: ignore[operator]
    if sockets:
        return f"inet sockets: {len(sockets)} left (a port held or in TIME_WAIT): {sockets[:2]}"
    locks = sorted(now["locks"] - base["locks"])  # type: ignore[operator]
    if locks:
        return f"file locks: {len(locks)} held by no process: {locks[:2]}"
    return ""
