"""The keys/values of the rows in flight under continuous batching: one slot per row, joined and left
between decode steps.

This module imports torch and transformers at the top (through :mod:`toolgym.agents.policies.hf_cache`).

Layout. Per layer, keys and values live in buffers ``[slots, kv_heads, capacity, head_dim]``
(:class:`~toolgym.agents.policies.hf_cache.BufferLayer`). Every live row ends at the same column,
:attr:`SlotCache.length`: a decode step writes column ``length`` for every slot at once, which is what a
transformers cache of one length per batch needs. The row in slot ``s`` starts at ``start[s]``;
:attr:`SlotCache.attention_mask` marks its columns ``[start[s], length)``. Positions are each row's own
(its token count), so left padding changes no row's function.

Membership changes without copying the other rows where it can:

* a row **leaves** by freeing its slot: the slot keeps being computed (its output is ignored) until a
  newcomer takes it or the cache is compacted;
* a row **joins** a free slot when its keys/values fit left of ``length`` and its tokens to come fit
  right of it (:meth:`SlotCache.join`); otherwise the caller builds a new cache from the live rows'
  columns (:meth:`SlotCache.row`) and the newcomers (:meth:`SlotCache.build`), with room on both sides
  for the rows that will join next.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicCache

from toolgym.agents.policies.hf_cache import BufferLayer, LayerKV

__all__ = ["SlotCache"]


class SlotCache:
    """Per-slot keys/values of the rows in flight (see the module docstring).

    Build one with :meth:`build`; :attr:`cache` is the ``DynamicCache`` to pass to the model, and
    :meth:`step_mask` the attention mask of the next decode step.
    """

    def __init__(self, layers: list[BufferLayer], starts: list[int], length: int) -> None:
        self.layers = layers
        self.starts = starts
        self.length = length
        self.free: set[int] = set()
        self.cache = DynamicCache()
        self.cache.layers = list(layers)
        first = layers[0].buffer_keys
        slots, capacity = first.shape[0], first.shape[-2]
        self.capacity = capacity
        mask = torch.zeros((slots, capacity), dtype=torch.long, device=first.device)
        for s, start in enumerate(starts):
            mask[s, start:length] = 1
        self.attention_mask = mask

    @classmethod
    def build(cls, rows: Sequence[Sequence[LayerKV]], room_left: int, room_right: int) -> SlotCache:
        """A cache holding ``rows`` (per row, per layer ``(keys, values)`` ``[kv_heads, n, head_dim]``)
        in slots ``0..len(rows)-1``, right-aligned at column ``max(n) + room_left``, with
        ``room_right`` columns after it."""
        lengths = [row[0][0].shape[-2] for row in rows]
        length = max(lengths) + room_left
        capacity = length + room_right
        starts = [length - n for n in lengths]
        layers = []
        for index, (k0, v0) in enumerate(rows[0]):
            keys = k0.new_zeros((len(rows), k0.shape[0], capacity, k0.shape[-1]))
            values = v0.new_zeros((len(rows), v0.shape[0], capacity, v0.shape[-1]))
            for s, row in enumerate(rows):
                k, v = row[index]
                keys[s, :, starts[s] : length] = k
                values[s, :, starts[s] : length] = v
            layers.append(BufferLayer(keys, values, length))
        return cls(layers, starts, length)

    @property
    def slots(self) -> int:
        return len(self.starts)

    def join(self, row: Sequence[LayerKV], tokens_to_come: int) -> int | None:
        """Put ``row`` into a free slot and return the slot, or ``None`` when it does not fit."""
        n = row[0][0].shape[-2]
        if not self.free or n > self.length or self.length + tokens_to_come > self.capacity:
            return None
        slot = min(self.free)
        self.free.discard(slot)
        start = self.length - n
        for layer, (k, v) in zip(self.layers, row, strict=True):
            layer.buffer_keys[slot, :, start : self.length] = k
            layer.buffer_values[slot, :, start : self.length] = v
        self.starts[slot] = start
        self.attention_mask[slot].zero_()
        self.attention_mask[slot, start : self.length] = 1
        return slot

    def leave(self, slot: int) -> None:
        """Free ``slot``; its columns are ignored from now on."""
        self.free.add(slot)

    def row(self, slot: int, tokens: int | None = None) -> list[LayerKV]:
        """Copies of slot ``slot``'s keys/values: its first ``tokens`` columns (default: all of them)."""
        start = self.starts[slot]
        end = self.length if tokens is None else start + tokens
        return [
            (layer.buffer_keys[slot, :, start:end].clone(), layer.buffer_values[slot, :, start:end].clone())
            for layer in self.layers
        ]

    def step_mask(self) -> torch.Tensor:
        """The attention mask of the next decode step (it writes column :attr:`length`); call
        :meth:`advance` after the step."""
        self.attention_mask[:, self.length] = 1
        return self.attention_mask[:, : self.length + 1]

    def advance(self) -> None:
        """Account for the column the decode step just wrote."""
        self.length += 1
        if any(layer.length != self.length for layer in self.layers):
            raise RuntimeError("the decode step did not write one column in every layer of the slot cache")
