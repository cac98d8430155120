"""Peak resident memory for benchmarks: of a block of this process, or of a process *and its children*.

Usage, for a whole command (a training run and the engine processes it starts)::

    python bench/memory.py [--interval 0.2] [--timeline FILE.tsv] -- toolgym train --config demo --out runs/demo

runs the command, samples the summed resident memory of its process tree every ``--interval`` seconds
and prints the peak with each process's share at that moment; the exit status is the command's.
``--timeline`` also writes a line a second: seconds since the start, the summed GB, each process's GB
(to set beside the run's log and see which phase the peak belongs to).

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
from pathlib import Path

__all__ = ["PeakRSS", "TreePeak", "rss_bytes", "self_peak_mb", "tree_rss", "tree_rss_kb"]


def self_peak_mb() -> float:
    """This process's own peak resident memory, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tree_rss_kb(pid: int) -> int:
    """Resident memory of ``pid`` and all its descendants now, in KiB."""
    return sum(kb for _, kb in tree_rss(pid).values())


def tree_rss(pid: int) -> dict[int, tuple[str, int]]:
    """``pid -> (name, resident KiB)`` for ``pid`` and all its descendants now."""
    found, todo = {}, [pid]
    while todo:
        current = todo.pop()
        try:
            with open(f"/proc/{current}/status") as fh:
                fields = dict(line.split(":", 1) for line in fh if ":" in line)
            found[current] = (fields["Name"].strip(), int(fields.get("VmRSS", "0 kB").split()[0]))
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as fh:
                    todo.extend(int(c) for c in fh.read().split())
        except (OSError, KeyError, ValueError):
            continue  # the process ended meanwhile
    return found


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


def main() -> int:
    import argparse
    import subprocess
    import time

    parser = argparse.ArgumentParser(description="peak summed RSS of a command's process tree")
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--timeline", type=Path, help="write seconds, summed GB and each process's GB here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    start = time.monotonic()
    child = subprocess.Popen(command)
    peak: dict[int, tuple[str, int]] = {}
    peak_at, written = 0.0, -1
    timeline = open(args.timeline, "w") if args.timeline else None  # noqa: SIM115 - closed below
    try:
        while child.poll() is None:
            now, at = tree_rss(child.pid), time.monotonic() - start
            if sum(kb for _, kb in now.values()) > sum(kb for _, kb in peak.values()):
                peak, peak_at = now, at
            if timeline is not None and int(at) > written:
                written = int(at)
                shares = " ".join(f"{name}:{kb * 1024 / 1e9:.2f}" for name, kb in now.values())
                timeline.write(f"{at:.0f}\t{sum(kb for _, kb in now.values()) * 1024 / 1e9:.2f}\t{shares}\n")
                timeline.flush()
            time.sleep(args.interval)
    finally:
        if timeline is not None:
            timeline.close()
    wall = time.monotonic() - start
    total = sum(kb for _, kb in peak.values())
    shares = ", ".join(
        f"{name} {kb * 1024 / 1e9:.2f}" for name, kb in sorted(peak.values(), key=lambda item: -item[1])
    )
    print(
        f"memory: peak {total * 1024 / 1e9:.2f} GB summed over {len(peak)} process(es) at {peak_at:.0f} s "
        f"of {wall:.0f} s ({shares} GB); exit status {child.returncode}",
        flush=True,
    )
    return child.returncode


if __name__ == "__main__":
    raise SystemExit(main())
