"""A bounded cache of attention keys/values keyed by token prefix, for multi-turn reuse in HFPolicy.

Why: an episode's requests share one growing token sequence (the previous prompt, the sampled ids,
then the new tool and harness tokens), and every episode of an environment starts with the same
system prompt, tool schemas and worked example. A causal LM's keys and values at position ``i``
depend only on tokens ``0..i``, so the cached keys/values of *any* stored sequence are valid for the
longest common prefix it shares with a new request; only the rest has to be prefilled.

Contract:

* An entry is one token sequence and, per layer, its keys and values shaped
  ``[kv_heads, len(ids), head_dim]`` (one row, no padding).
* :meth:`PrefixCache.lookup` returns the entry with the longest common prefix with the request (a
  linear scan: entries are few, tens, and the comparison is vectorised), capped by the caller so at
  least one token is left to prefill (its logits start the completion).
* :meth:`PrefixCache.insert` drops the entries the new sequence extends (a previous turn of the same
  episode is a prefix of its next turn, so it is redundant) and skips a sequence that is itself a
  prefix of a stored one. Then least recently used entries are evicted until both bounds hold:
  ``max_bytes`` (keys + values) and ``max_entries``. A sequence larger than ``max_bytes`` is not stored.
* The cache holds keys/values of one set of weights: :meth:`PrefixCache.check_version` clears it when
  the policy's weight version changes, so a stale entry is never reused after a training step.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["CacheStats", "PrefixCache"]

#: ``(keys, values)`` of one layer, each ``[kv_heads, tokens, head_dim]``.
LayerKV = tuple[Any, Any]


@dataclass(frozen=True)
class CacheStats:
    """Counters since the cache was made (``reused_tokens / (reused + prefilled)`` is the hit rate)."""

    lookups: int
    hits: int
    reused_tokens: int
    prefilled_tokens: int
    evictions: int
    entries: int
    tokens: int
    bytes: int


@dataclass
class _Entry:
    ids: np.ndarray
    layers: list[LayerKV]
    nbytes: int


class PrefixCache:
    """Least-recently-used store of per-sequence keys/values, bounded in bytes and entries.

    Args:
        max_bytes: most bytes of keys + values kept (all entries together).
        max_entries: most sequences kept.
        min_match: shortest common prefix worth reusing (shorter matches count as misses).

    Not thread-safe: HFPolicy uses it from its single worker thread only.
    """

    def __init__(self, max_bytes: int, max_entries: int, *, min_match: int = 1) -> None:
        if max_bytes < 0 or max_entries < 0 or min_match < 1:
            raise ValueError(
                f"need max_bytes >= 0, max_entries >= 0, min_match >= 1; got {max_bytes}, {max_entries}, {min_match}"
            )
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.min_match = min_match
        self.version: int | None = None
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._keys = itertools.count()
        self._bytes = 0
        self._lookups = self._hits = self._reused = self._prefilled = self._evictions = 0

    # ----------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def stats(self) -> CacheStats:
        return CacheStats(
            lookups=self._lookups,
            hits=self._hits,
            reused_tokens=self._reused,
            prefilled_tokens=self._prefilled,
            evictions=self._evictions,
            entries=len(self._entries),
            tokens=sum(len(e.ids) for e in self._entries.values()),
            bytes=self._bytes,
        )

    def lookup(self, ids: Sequence[int], *, limit: int | None = None) -> tuple[int, list[LayerKV]]:
        """The longest cached prefix of ``ids``: ``(length, per-layer (keys, values) views of it)``.

        ``limit`` caps the length (HFPolicy passes ``len(ids) - 1``). A miss is ``(0, [])``. A hit
        makes its entry the most recently used. The views share the entry's storage: do not modify.
        """
        query = np.asarray(ids, dtype=np.int64)
        cap = len(query) if limit is None else min(limit, len(query))
        best_key, best = None, 0
        for key, entry in self._entries.items():
            n = min(cap, len(entry.ids))
            if n <= best:
                continue
            diff = np.flatnonzero(entry.ids[:n] != query[:n])
            common = int(diff[0]) if diff.size else n
            if common > best:
                best_key, best = key, common
        self._lookups += 1
        if best_key is None or best < self.min_match:
            self._prefilled += len(query)
            return 0, []
        self._hits += 1
        self._reused += best
        self._prefilled += len(query) - best
        self._entries.move_to_end(best_key)
        layers = self._entries[best_key].layers
        return best, [(k[:, :best], v[:, :best]) for k, v in layers]

    # ----------------------------------------------------------------- updates
    def insert(self, ids: Sequence[int], layers: list[LayerKV]) -> bool:
        """Store ``ids`` with its per-layer keys/values (each ``[kv_heads, len(ids), head_dim]``).

        The tensors are kept as given (pass contiguous tensors that own their storage, or the bytes
        accounting undercounts). Returns whether the sequence was stored.
        """
        seq = np.asarray(ids, dtype=np.int64)
        for k, v in layers:
            if k.shape[-2] != len(seq) or v.shape[-2] != len(seq):
                raise ValueError(f"keys/values hold {k.shape[-2]} positions for {len(seq)} ids")
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        if nbytes > self.max_bytes or self.max_entries == 0 or len(seq) < self.min_match:
            return False
        for key, entry in list(self._entries.items()):
            n = len(entry.ids)
            if n <= len(seq) and np.array_equal(entry.ids, seq[:n]):
                self._drop(key)  # superseded: the new sequence extends it
            elif n > len(seq) and np.array_equal(entry.ids[: len(seq)], seq):
                self._entries.move_to_end(key)  # already covered by a longer entry
                return False
        self._entries[next(self._keys)] = _Entry(seq, list(layers), nbytes)
        self._bytes += nbytes
        while self._bytes > self.max_bytes or len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))
            self._evictions += 1
        return True

    def check_version(self, version: int) -> None:
        """Clear the cache if it holds keys/values of other weights than ``version``."""
        if self.version != version:
            self.clear()
            self.version = version

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def _drop(self, key: int) -> None:
        self._bytes -= self._entries.pop(key).nbytes
