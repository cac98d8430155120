"""Activation checkpointing of the decoder layers in the learner's scoring passes (``train.batching.checkpoint_layers``).

A decoder layer's forward pass keeps about twenty hidden-size vectors a token for its backward pass
(SmolLM2-135M in fp32: 1.34 MB a token over its 30 layers). Checkpointed, a layer keeps only its input;
the backward pass runs the layer's forward again to rebuild the rest, one layer at a time: the
activations a pass holds shrink to its layers' inputs plus one layer's, for one more forward pass of
compute.

transformers' own switch (``gradient_checkpointing_enable``) drops the key/value cache, which the
learner's prefix sharing feeds every suffix pass with (:mod:`~toolgym.training.learn.scoring`). Here each
decoder layer's ``forward`` is wrapped in :func:`torch.utils.checkpoint.checkpoint` (non-reentrant, so
keyword arguments, the cache included, reach the recomputation unchanged) for the passes that ask for
it. That is exact only if running a layer twice computes the same thing twice: the model runs in eval
mode (no dropout), and the cache a checkpointed pass reads must not grow when a layer runs, which is why
such passes attend to the prefix through :func:`read_only_cache` (never written) or run without a cache.
The context passes that *build* the shared prefix's cache are never checkpointed.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpointed_layers", "decoder_layers", "read_only_cache"]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers (transformers' ``GradientCheckpointingLayer`` modules)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


@contextlib.contextmanager
def checkpointed_layers(model: torch.nn.Module, on: bool = True) -> Iterator[None]:
    """Within the block, every decoder layer of ``model`` runs checkpointed (nothing changes when not ``on``)."""
    if not on:
        yield
        return
    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = functools.partial(_checkpointed, type(layer).forward.__get__(layer))
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # the class's forward again


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def read_only_cache(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A transformers cache over per-layer ``(keys, values)`` that a pass reads and never writes.

    Each layer's attention gets the prefix's keys/values followed by the pass's own, as from a
    ``DynamicCache``, but the cache keeps only the prefix: running a layer twice (a checkpointed
    layer's recomputation) sees the same keys/values both times.
    """
    from transformers import DynamicCache

    cache = DynamicCache(ddp_cache_data=list(pairs))
    for layer in cache.layers:
        layer.__class__ = _read_only_layer()
    return cache


@functools.cache
def _read_only_layer() -> type:
    from transformers.cache_utils import DynamicLayer

    class ReadOnlyLayer(DynamicLayer):
        """A ``DynamicLayer`` whose ``update`` returns the concatenation without storing it."""

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = self.keys, self.values
            if keys is None or values is None:  # a layer built from (keys, values) always holds both
                raise RuntimeError("a read-only cache layer without the prefix's keys/values")
            return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)

    return ReadOnlyLayer
