"""Peak resident memory for benchmarks: of a block of this process, or of a process *and its children*.

:class:`PeakRSS` samples this process's resident memory while a block runs (how far a learner step
raises it).

``resource.getrusage`` reports one process's peak (``RUSAGE_SELF``) or the largest finished child's
(``RUSAGE_CHILDREN``), never the sum of processes alive at the same time; the default search
backend's index build analyses in worker processes, so its memory is that sum. :class:`TreePeak`
samples it from ``/proc`` (Linux) every ``interval`` seconds.
"""

from __future__ import annotations

import os
import resource
import threading

__all__ = ["PeakRSS", "TreePeak", "rss_bytes", "self_peak_mb", "tree_rss_kb"]


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


def rss_bytes() -> int:
    """Current resident set size of this process (Linux ``/proc``)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


class PeakRSS:
    """Samples RSS in a thread while a block runs; ``rise`` is the peak above the level at entry."""

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.rise = self.peak - self.start
