"""Key/value plumbing for HFPolicy: one-row prefill on a cached prefix, and decode buffers.

This module imports torch and transformers at the top; :mod:`toolgym.agents.policies.hf` imports it
lazily, only when a model is loaded.

* :func:`prefill_row` runs one prompt (batch of one, no padding) on top of the keys/values of a
  cached prefix and returns its last logits and the keys/values of the whole prompt.
* :class:`BufferLayer` is a cache layer over buffers allocated once, for the prompt and every token
  the batch may still generate, so a decode step writes its keys/values in place instead of
  concatenating the whole cache (which ``DynamicCache`` does at every step, per layer); the batch's
  layout in them is :class:`~toolgym.agents.policies.hf_slots.SlotCache`'s, for both schedulers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

__all__ = ["BufferLayer", "LayerKV", "plain_layers", "prefill_row"]

LayerKV = tuple[torch.Tensor, torch.Tensor]


def plain_layers(model: Any) -> bool:
    """Whether every layer of ``model``'s default cache is a plain full-attention ``DynamicLayer``.

    Only then is a prefix of keys/values reusable as is (a sliding-window or recurrent layer keeps a
    state that is not a per-position slice).
    """
    try:
        cache = DynamicCache(config=model.config)
    except (AttributeError, KeyError, TypeError, ValueError):
        return False
    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


def prefill_row(
    model: Any, prompt: Sequence[int], cached: int, prefix: Sequence[LayerKV], device: Any
) -> tuple[torch.Tensor, list[LayerKV]]:
    """Prefill ``prompt[cached:]`` on the keys/values of ``prompt[:cached]`` (``prefix``, per layer).

    Returns the logits of the last position (``[vocab]``) and per layer the keys/values of the whole
    prompt, each ``[kv_heads, len(prompt), head_dim]`` (fresh tensors: safe to store).
    """
    past = DynamicCache(ddp_cache_data=[(k[None].to(device), v[None].to(device)) for k, v in prefix])
    ids = torch.tensor([list(prompt[cached:])], dtype=torch.long, device=device)
    positions = torch.arange(cached, len(prompt), device=device)[None]
    # NOTE: batch of one with no padding, so no attention mask is needed; positions continue the
    # prefix, exactly as if the whole prompt had been run at once.
    out = model(input_ids=ids, position_ids=positions, past_key_values=past, use_cache=True, logits_to_keep=1)
    layers = [(layer.keys[0], layer.values[0]) for layer in out.past_key_values.layers]
    return out.logits[0, -1], layers


class BufferLayer(DynamicLayer):
    """A ``DynamicLayer`` over preallocated ``[batch, kv_heads, capacity, head_dim]`` buffers."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self.buffer_keys, self.buffer_values, self.length = keys, values, length
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._expose()

    def _expose(self) -> None:
        self.keys = self.buffer_keys[:, :, : self.length]
        self.values = self.buffer_values[:, :, : self.length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + key_states.shape[-2]
        if end > self.buffer_keys.shape[-2]:
            raise RuntimeError(f"decode cache full: {end} positions for {self.buffer_keys.shape[-2]}")
        self.buffer_keys[:, :, self.length : end].copy_(key_states)
        self.buffer_values[:, :, self.length : end].copy_(value_states)
        self.length = end
        self._expose()
        return self.buffer_keys[:, :, :end], self.buffer_values[:, :, :end]  # = self.keys, self.values
