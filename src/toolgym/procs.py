"""Small helpers for the child processes a run starts (learner processes, a vLLM server).

``free_port`` picks a free localhost TCP port for a child to listen on; ``log_tail`` quotes the end
of a child's log in an error message, so a process that failed says why where the run stopped.
"""

from __future__ import annotations

import socket
from pathlib import Path

__all__ = ["free_port", "log_tail"]


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
