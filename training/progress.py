"""Progress of a training run: a live bar on a terminal, one plain line per phase and per step otherwise.

``toolgym train ... > log`` must still say what it is doing: rich draws its bars only on a terminal, so
when the output is not one, :class:`RunProgress` prints a timestamped line when a phase starts, at
every tenth of a phase's items (a tenth reached within :data:`MIN_GAP_S` of the last line waits for
the next, so a phase that takes a second prints its start and its end, not ten lines of the same
second), and at every training step instead.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = ["RunProgress"]


#: Seconds between two lines of one phase when no tenth was reached (a long phase is never silent).
EVERY_S = 30.0
#: Seconds a tenth waits after the last line (the phase's last item is always shown).
MIN_GAP_S = 2.0


class _Task:
    def __init__(self, owner: RunProgress, name: str, total: float | None, completed: float) -> None:
        self.owner, self.name, self.total, self.completed = owner, name, total, completed
        self._bar: Any = None
        self._shown = 0  # tenths already printed (the opening line stands for the 0th)
        self._start = self._last = time.monotonic()
        self._first = completed  # done before this phase started (a resume): not in the rate

    def update(self, completed: float, *, total: float | None = None, note: str = "") -> None:
        """Move the bar (or print a line: always with ``note``, else at each tenth of ``total``)."""
        self.completed = completed
        if total is not None:
            self.total = total
        if self._bar is not None:
            self.owner._rich.update(
                self._bar, completed=completed, total=self.total, description=f"{self.name} {note}".strip()
            )
            return
        tenth = int(10 * completed / self.total) if self.total else -1
        now = time.monotonic()
        if completed == self._first:  # nothing done yet (loading, a resume's first call): the clock starts
            self._start = self._last = now
        last = bool(self.total) and completed >= self.total  # type: ignore[operator]
        due = tenth > self._shown and (last or now - self._last >= MIN_GAP_S)
        if note or due or (now - self._last >= EVERY_S and completed > self._first):
            self._shown, self._last = max(tenth, self._shown), now
            of = f"/{int(self.total)}" if self.total else ""
            rate = (completed - self._first) / max(now - self._start, 1e-9)
            shown = note or f"({rate:.2f} per s)"
            self.owner.line(f"{self.name}: {int(completed)}{of} {shown}")


class RunProgress:
    """Bars on a terminal (rich), plain lines elsewhere; ``stream`` defaults to stdout."""

    def __init__(self, stream: TextIO | None = None, *, terminal: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self._rich: Any = None

    def line(self, text: str) -> None:
        """One timestamped line (not on a terminal, where the bars say it)."""
        if not self.terminal:
            print(f"[{time.strftime('%H:%M:%S')}] {text}", file=self.stream, flush=True)

    def warn(self, text: str) -> None:
        """A timestamped ``WARNING:`` line, on a terminal too (above its bars)."""
        self.note(f"WARNING: {text}")

    def note(self, text: str) -> None:
        """A timestamped line on a terminal too (above its bars): something to read once, not progress."""
        message = f"[{time.strftime('%H:%M:%S')}] {text}"
        if self._rich is not None:
            self._rich.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=self.stream, flush=True)

    @contextmanager
    def task(self, name: str, total: float | None = None, completed: float = 0) -> Iterator[_Task]:
        """A phase with ``total`` items (``None``: unknown yet); its line opens it when not on a terminal."""
        task = _Task(self, name, total, completed)
        if not self.terminal:
            done = f"{int(completed)} of {int(total)} done, " if total and completed else ""
            self.line(f"{name}: started" + (f" ({done}{int(total - completed)} to do)" if total else ""))
            yield task
            return
        from rich.progress import Progress

        with Progress(transient=True) as progress:
            self._rich = progress
            task._bar = progress.add_task(name, total=total, completed=int(completed))
            try:
                yield task
            finally:
                self._rich = None
