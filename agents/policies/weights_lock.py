"""The lock between a sampler and the learner that changes its weights, with the learner first.

A policy that samples from the module a trainer updates in place holds :class:`WeightsLock` while
completions are in flight, so no completion mixes two weight versions; the learner takes it (``with
policy.weights_lock:``) to change the weights and bump the version. A sampler that batches
continuously always has rows in flight under load, so a plain lock would never come free: here a
learner that waits is visible (:attr:`WeightsLock.wanted`), the sampler stops admitting requests,
finishes the rows in flight and lets go, and takes the lock again only once no learner waits
(:meth:`WeightsLock.acquire_for_sampler`). A learner therefore waits at most for the longest
completion in flight.
"""

from __future__ import annotations

import threading

__all__ = ["WeightsLock"]


class WeightsLock:
    """A re-entrant lock whose waiting holders go before the sampler (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._changed = threading.Condition()
        self._waiting = 0

    def acquire(self) -> None:
        """Take the lock (as the learner): the sampler lets go once its rows in flight end."""
        with self._changed:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._changed:
                self._waiting -= 1
                self._changed.notify_all()

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> WeightsLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @property
    def wanted(self) -> bool:
        """Whether someone waits for the lock (the sampler then admits no new request)."""
        return self._waiting > 0

    def acquire_for_sampler(self) -> None:
        """Take the lock once nobody waits for it."""
        with self._changed:
            self._changed.wait_for(lambda: self._waiting == 0)
        self._lock.acquire()
