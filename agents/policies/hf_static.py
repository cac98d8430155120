"""HFPolicy's static batches: left-pad up to ``max_batch`` prompts and decode them to the end of the
last one, sampling row by row on the host, each row from its own ``torch.Generator``.

This module imports torch and transformers at the top; :mod:`toolgym.agents.policies.hf` imports it
when a model is loaded. It is the scheduler for models whose cache is not plain full attention
(:func:`~toolgym.agents.policies.hf_cache.plain_layers` is false: no prefix cache, no slots), and the
reference the continuous scheduler (:mod:`toolgym.agents.policies.hf_decode`) is measured against
(``HFPolicy(batching="static")``, ``bench/gpu.py``). The caller holds the weights lock and makes the
completions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from toolgym.agents.policies.hf_decode import prefill
from toolgym.agents.policies.hf_rows import Request, Row
from toolgym.agents.policies.hf_sample import nucleus
from toolgym.agents.policies.hf_slots import SlotCache
from toolgym.agents.policies.prefix_cache import PrefixCache

__all__ = ["sample_row", "static_batch"]


def static_batch(
    model: Any,
    device: Any,
    requests: Sequence[Request],
    *,
    prefix_cache: PrefixCache | None,
    pad_id: int,
    stop_ids: Collection[int],
    decode: Callable[[Sequence[int]], str],
    max_context: int,
    draw: Callable[[Row, Any], int] | None = None,
) -> list[Row]:
    """Decode ``requests`` together until every row has ended; returns their rows, in order.

    ``draw(row, logits)`` chooses and records each token (default :func:`sample_row`)."""
    rows = []
    for r in requests:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(r.seed)
        rows.append(Row(r, min(r.sampling.max_tokens, max_context - len(r.prompt)), generator))
    if prefix_cache is not None:
        logits, past, attention, cache = _prefill_cached(model, device, rows, prefix_cache)
    else:
        logits, past, attention = _prefill_padded(model, device, requests, pad_id)
        cache = None
    if draw is None:
        draw = functools.partial(sample_row, stop_ids=stop_ids, decode=decode)
    positions = torch.tensor([[len(r.prompt) - 1] for r in requests], device=device)
    while True:
        next_ids = [draw(row, logits[i]) if row.finish is None else pad_id for i, row in enumerate(rows)]
        if all(row.finish is not None for row in rows):
            break
        attention = torch.cat([attention, attention.new_ones((len(rows), 1))], dim=-1)
        positions = positions + 1
        out = model(
            input_ids=torch.tensor(next_ids, dtype=torch.long, device=device)[:, None],
            attention_mask=attention,
            position_ids=positions,
            past_key_values=past,
            use_cache=True,
        )
        past = out.past_key_values
        logits = out.logits[:, -1, :].float().cpu()
    if cache is not None and prefix_cache is not None:
        for i, row in enumerate(rows):
            # NOTE: the last sampled id was never fed to the model, so it has no keys/values.
            fed = len(row.ids) - 1
            prefix_cache.insert(
                row.request.prompt + row.ids[:fed], cache.row(i, len(row.request.prompt) + fed)
            )
    return rows


def _prefill_padded(
    model: Any, device: Any, requests: Sequence[Request], pad_id: int
) -> tuple[Any, Any, Any]:
    """Prefill the whole batch at once, left-padded: last logits, the cache, the attention mask."""
    width = max(len(r.prompt) for r in requests)
    input_ids = torch.full((len(requests), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(requests), width), dtype=torch.long)
    for i, r in enumerate(requests):
        # NOTE: left padding, masked out, with positions counted from each row's first real token,
        # so a row's logits do not depend on the other prompts in its batch.
        input_ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt, dtype=torch.long)
        attention[i, width - len(r.prompt) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    input_ids, attention, positions = (t.to(device) for t in (input_ids, attention, positions))
    out = model(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1, :].float().cpu(), out.past_key_values, attention


def _prefill_cached(
    model: Any, device: Any, rows: list[Row], prefix_cache: PrefixCache
) -> tuple[Any, Any, Any, SlotCache]:
    """Prefill each prompt on its longest cached prefix; the batch's decode cache from the rows (left-padded
    to the longest prompt, room for the longest completion; a static batch never joins or leaves)."""
    last, kvs = [], []
    for row in rows:
        logits, layers = prefill(model, device, row.request.prompt, prefix_cache)
        last.append(logits.float().cpu())
        kvs.append(layers)
    cache = SlotCache.build(kvs, room_left=0, room_right=max(row.max_tokens for row in rows))
    return torch.stack(last), cache.cache, cache.attention_mask[:, : cache.length], cache


def sample_row(
    row: Row, logits: Any, *, stop_ids: Collection[int], decode: Callable[[Sequence[int]], str]
) -> int:
    """Draw one token for ``row`` from its logits on the host with its own generator; record it."""
    sampling = row.request.sampling
    if sampling.temperature == 0:
        token = int(torch.argmax(logits))
        logprob = float(torch.log_softmax(logits, dim=-1)[token])
    else:
        logp = torch.log_softmax(logits / sampling.temperature, dim=-1)
        if sampling.top_p < 1.0:
            logp = nucleus(logp[None], torch.tensor([sampling.top_p]))[0]
        token = int(torch.multinomial(logp.exp(), 1, generator=row.generator))
        logprob = float(logp[token])
    row.record(token, logprob, stop_ids, decode)
    return token
