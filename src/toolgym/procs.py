"""Small helpers for the child processes a run starts (learner processes, a vLLM server or engine).

``free_port`` picks a free localhost TCP port for a child to listen on; ``log_tail`` quotes the end
of a child's log in an error message, so a process that failed says why where the run stopped.

A run killed outright (SIGKILL, the kernel's out-of-memory killer) cannot stop its children: a vLLM
engine's processes go on holding gigabytes with no one to serve, and the rerun that resumes the run
starts a second engine beside them. So a run lists the processes its policy started
(:func:`record_processes`, with their start times, so a reused pid is never mistaken for one), and
the next run in that directory stops the ones still running once their owner is gone
(:func:`stop_leftovers`). Linux only (``/proc``); elsewhere both do nothing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "PROCESSES_FILE",
    "descendants",
    "free_port",
    "log_tail",
    "record_processes",
    "start_time",
    "stop_leftovers",
]

#: In a run directory: the processes the run's policy started (a vLLM engine's), for the next run
#: there (or the arms driver, when the run was killed) to stop if the run could not.
PROCESSES_FILE = "processes.json"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path | None, lines: int) -> str:
    """``"; the end of PATH:"`` and the log's last ``lines`` lines, indented; ``""`` when there is none."""
    if path is None or not path.exists():
        return ""
    tail = path.read_text(errors="replace").strip().splitlines()[-lines:]
    return f"; the end of {path}:\n  " + "\n  ".join(tail) if tail else ""


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` from the third (state) on, or ``None`` when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ", comm may hold spaces


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), or ``None`` when it has ended (a zombie too)."""
    fields = _stat(pid)
    return int(fields[19]) if fields is not None and fields[0] != "Z" else None  # field 22: starttime


def descendants(pid: int | None = None) -> set[int]:
    """The pids of every process below ``pid`` (default: this one), its children's children too."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
        if entry.name.isdigit() and (fields := _stat(entry.name)) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))  # field 4: ppid
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def record_processes(path: Path, pids: Iterable[int]) -> None:
    """Write ``pids`` (with their start times) and this process, their owner, to ``path``."""
    me = os.getpid()
    listed = [
        {"pid": pid, "started": started} for pid in sorted(pids) if (started := start_time(pid)) is not None
    ]
    record = {"owner": {"pid": me, "started": start_time(me)}, "processes": listed}
    path.write_text(json.dumps(record, indent=1))


def stop_leftovers(path: Path) -> list[int]:
    """SIGKILL the processes ``path`` lists that still run although their owner has ended; their pids.

    Nothing is stopped while the owner runs (another process is using the directory) or when the
    record cannot be read; a pid now held by another process (another start time) is left alone.
    """
    try:
        record = json.loads(path.read_text())
        owner = record["owner"]
        listed = [(int(p["pid"]), int(p["started"])) for p in record["processes"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if owner.get("started") is not None and start_time(int(owner["pid"])) == owner["started"]:
        return []
    stopped = []
    for pid, started in listed:
        if start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
            stopped.append(pid)
    return stopped
