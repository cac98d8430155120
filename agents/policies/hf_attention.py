"""Grouped-query attention through PyTorch's SDPA without copying the keys and values per head.

This module imports torch and transformers at the top; importing it registers the attention under
:data:`GROUPED_SDPA` with transformers (``AttentionInterface`` and ``AttentionMaskInterface``), so a
model loaded or switched with ``attn_implementation=GROUPED_SDPA`` uses it.

Why: in a grouped-query model (SmolLM2-135M: 9 query heads, 3 key/value heads) transformers' ``sdpa``
attention copies every key and value ``heads / kv_heads`` times (``repeat_kv``) whenever an attention
mask is passed, which a batch with padding always does; PyTorch's own grouped path is taken only
without a mask. At every decode step that is a copy of the whole key/value cache, three times over:
on 2 CPU cores, about half of a decode step of 8 rows at 650 tokens.

How: the query heads that share a key/value head are laid along the query axis instead (``[batch,
kv_heads, groups * queries, head_dim]``), so one SDPA call per key/value head attends all of them to
the same keys and values, and the mask is repeated per group (a decode step's mask, one query row,
broadcasts as it is). The function is the same as ``sdpa``'s up to floating-point rounding (tested,
outputs and gradients); whatever it does not handle (no groups, no mask on a causal prefill, a
position bias, a paged cache, a per-head mask, attention weights asked for) goes to transformers'
``sdpa`` unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["GROUPED_SDPA", "grouped_sdpa_forward", "uses_grouped_queries"]

GROUPED_SDPA = "toolgym_grouped_sdpa"


def uses_grouped_queries(config: Any) -> bool:
    """Whether a model of ``config`` has fewer key/value heads than query heads."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return bool(heads and kv_heads and kv_heads < heads)


def grouped_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``[batch, heads, q, head_dim]``, ``key``
    and ``value`` ``[batch, kv_heads, k, head_dim]``; returns ``[batch, q, heads, head_dim]``."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, queries, dim = query.shape
    if (
        groups == 1
        or attention_mask is None
        or attention_mask.dim() != 4
        or attention_mask.shape[1] != 1
        or kwargs.get("position_bias") is not None
        or kwargs.get("output_attentions", False)
        or kwargs.get("cache") is not None
    ):
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    kv_heads = key.shape[1]
    folded = query.reshape(batch, kv_heads, groups * queries, dim)
    mask = attention_mask
    if queries > 1 and mask.shape[2] > 1:
        rows, columns = mask.shape[0], mask.shape[-1]
        mask = (
            mask[:, :, None]
            .expand(rows, 1, groups, queries, columns)
            .reshape(rows, 1, groups * queries, columns)
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(batch, heads, queries, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_forward)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
