"""Peak resident memory of a process *and its children*, for benchmarks whose work spans processes.

``resource.getrusage`` reports one process's peak (``RUSAGE_SELF``) or the largest finished child's
(``RUSAGE_CHILDREN``), never the sum of processes alive at the same time; the default search
backend's index build analyses in worker processes, so its memory is that sum. :class:`TreePeak`
samples it from ``/proc`` (Linux) every ``interval`` seconds.
"""

from __future__ import annotations

import os
import resource
import threading

__all__ = ["TreePeak", "self_peak_mb", "tree_rss_kb"]


def self_peak_mb() -> float:
    """This process's own peak resident memory, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tree_rss_kb(pid: int) -> int:
    """Resident memory of ``pid`` and all its descendants now, in KiB."""
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        try:
            with open(f"/proc/{current}/status") as fh:
                total += next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as fh:
                    todo.extend(int(c) for c in fh.read().split())
        except (OSError, StopIteration):
            continue  # the process ended meanwhile
    return total


class TreePeak:
    """Samples this process tree's resident memory; :meth:`stop` returns the highest sum, in MiB."""

    def __init__(self, interval: float = 0.05) -> None:
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.peak_kb = max(self.peak_kb, tree_rss_kb(os.getpid()))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak_kb / 1024, self_peak_mb())
