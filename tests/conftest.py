"""Fixtures shared by tests in several folders."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def _running_children() -> set[int]:
    """Running child processes, minus multiprocessing's resource tracker (it lives as long as we do)."""
    import psutil

    alive = set()
    for p in psutil.Process().children(recursive=True):
        try:  # a zombie is an exited process the OS keeps until its parent reaps it: not running
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                alive.add(p.pid)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return alive


@pytest.fixture(scope="session")
def running_children() -> Callable[[], set[int]]:
    """Call it for the pids of this process's running children (engine processes, workers)."""
    return _running_children
