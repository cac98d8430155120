"""Small helpers for the child processes a run starts (learner processes, a vLLM server or engine).

``free_port`` picks a free localhost TCP port for a child to listen on; ``log_tail`` quotes the end
of a child's log in an error message, so a process that failed says why where the run stopped.

A run killed outright (SIGKILL, the kernel's out-of-memory killer) cannot stop its children: a vLLM
engine's processes go on holding gigabytes with no one to serve, and the rerun that resumes the run
starts a second engine beside them. So a run lists the processes its policy started
(:func:`record_processes`), and the next run in that directory stops the ones still running once
their owner is gone (:func:`stop_leftovers`). Linux only (``/proc``); elsewhere both do nothing.

NOTE (whose processes): the record can make toolgym send SIGKILL, so it is trusted only where it
proves to be the run's own. It is kept outside the run directory (which may be shared, copied or
downloaded), in a private per-user folder (:func:`process_record`: ``$XDG_RUNTIME_DIR/toolgym``, else
``<tmp>/toolgym-<uid>``; mode 0700, owned by the user, refused otherwise), under a name derived from
the run directory's resolved path, and it names that path. A listed process is stopped only if
everything recorded when the run started it still holds: pid, start time (clock ticks since this
boot, with the boot's id), real and effective user (this user's: never another user's process),
executable and command line. A process that differs in any of them is another process, left alone
(so is one that changed its own command line since: the safe side of the rule).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import stat
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from toolgym.errors import ConfigError
from toolgym.run_files import create_new

__all__ = [
    "describe",
    "descendants",
    "free_port",
    "log_tail",
    "process_record",
    "record_processes",
    "start_time",
    "stop_leftovers",
]

log = logging.getLogger(__name__)


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


def describe(pid: int) -> dict[str, Any] | None:
    """What identifies a running process: pid, start time, real and effective uid, executable and
    command line; ``None`` when it has ended, cannot be read (another user's executable) or has no
    command line (a kernel thread; a process in the middle of exec is waited for, up to a second)."""
    started = start_time(pid)
    if started is None:
        return None
    try:
        for _ in range(100):  # a process in the middle of exec shows no command line for a moment
            status = Path(f"/proc/{pid}/status").read_text()
            uids = next(line.split()[1:3] for line in status.splitlines() if line.startswith("Uid:"))
            exe = os.readlink(f"/proc/{pid}/exe")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            if cmdline != [""]:
                break
            time.sleep(0.01)
    except (OSError, StopIteration):
        return None
    if cmdline == [""] or start_time(pid) != started:  # no command line; or the pid reused while we read
        return None
    return {"pid": pid, "started": started, "uids": [int(u) for u in uids], "exe": exe, "cmdline": cmdline}


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _private_dir() -> Path:
    """This user's folder for process records, created 0700; refused unless it is a real folder owned
    by this user that no one else may write to or list."""
    uid = os.getuid()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(runtime) / "toolgym" if runtime else Path(tempfile.gettempdir()) / f"toolgym-{uid}"
    try:
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700, parents=bool(runtime))
        info = os.lstat(folder)
    except OSError as exc:
        raise ConfigError(
            f"cannot create {folder}, where toolgym keeps the processes each run started ({exc})"
        ) from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o077:
        raise ConfigError(
            f"{folder}, where toolgym keeps the processes each run started, is not private to user {uid} "
            f"(owner uid {info.st_uid}, mode {stat.filemode(info.st_mode)}); a record there could be "
            "someone else's. Fix: remove it (toolgym recreates it with mode 0700) or set XDG_RUNTIME_DIR "
            "to a private folder"
        )
    return folder


def process_record(run_dir: str | Path) -> Path:
    """Where the record of ``run_dir``'s processes lives (outside it: see the module's NOTE).

    Raises:
        ConfigError: the private folder is not private.
    """
    key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:32]
    return _private_dir() / f"{key}.json"


def record_processes(run_dir: str | Path, pids: Iterable[int]) -> None:
    """Record ``pids`` as ``run_dir``'s processes, with this process as their owner (atomically).

    A private folder that is not private is logged and nothing is recorded (a later run then cannot
    stop these processes, and trusts nothing found there).
    """
    try:
        path = process_record(run_dir)
    except ConfigError as exc:
        log.warning("the processes of %s are not recorded: %s", run_dir, exc)
        return
    listed = [d for pid in sorted(pids) if (d := describe(pid)) is not None]
    record = {
        "run_dir": str(Path(run_dir).resolve()),
        "boot_id": _boot_id(),
        "owner": describe(os.getpid()),
        "processes": listed,
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with create_new(tmp) as fh:
        fh.write(json.dumps(record, indent=1).encode())
    os.replace(tmp, path)


def _read_record(run_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """``run_dir``'s record, if there is one that is this user's and names ``run_dir`` on this boot."""
    try:
        path = process_record(run_dir)
    except ConfigError as exc:
        log.warning("leftover processes of %s are not looked for: %s", run_dir, exc)
        return None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        with os.fdopen(fd, "rb") as fh:
            fd = -1
            record = json.loads(fh.read())
    except (OSError, ValueError):
        return None
    finally:
        if fd >= 0:
            os.close(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or not isinstance(record, dict):
        return None
    if record.get("run_dir") != str(Path(run_dir).resolve()) or record.get("boot_id") != _boot_id():
        return None
    return path, record


def _is(entry: Any) -> bool:
    """Whether the recorded process ``entry`` still runs as exactly what was recorded, as this user."""
    if not isinstance(entry, dict) or not isinstance(entry.get("pid"), int) or entry["pid"] <= 1:
        return False
    now = describe(entry["pid"])
    me = os.getuid()
    return now is not None and now == entry and now["uids"] == [me, me]


def _kill(entry: Any) -> bool:
    """SIGKILL the recorded process if it is still exactly it (checked after taking a pidfd, so a pid
    reused between the check and the signal is never hit)."""
    pid = entry.get("pid") if isinstance(entry, dict) else None
    if not isinstance(pid, int) or pid <= 1:
        return False
    pidfd = None
    with contextlib.suppress(OSError, AttributeError):
        pidfd = os.pidfd_open(pid)
    try:
        if not _is(entry):
            return False
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        if pidfd is not None:
            os.close(pidfd)


def stop_leftovers(run_dir: str | Path) -> list[int]:
    """SIGKILL the recorded processes of ``run_dir`` that still run although their owner has ended.

    Nothing is stopped while the owner runs (another process is using the directory), when there is
    no trustworthy record, or for a listed process that is not exactly the one recorded (see the
    module's NOTE). Once the owner has ended the record is removed. Returns the pids stopped.
    """
    found = _read_record(run_dir)
    if found is None:
        return []
    path, record = found
    if _is(record.get("owner")):
        return []
    processes = record.get("processes")
    stopped = [e["pid"] for e in processes if _kill(e)] if isinstance(processes, list) else []
    with contextlib.suppress(OSError):
        path.unlink()
    return stopped
