"""HFPolicy's continuous batching: requests join between decode steps, finished rows leave at once.

This module imports torch and transformers at the top; :mod:`toolgym.agents.policies.hf` imports it
when a model is loaded.

:class:`ContinuousDecoder` keeps up to ``max_batch`` rows in flight, and with a token budget
(``max_batch_tokens``) no more than fit in it (:meth:`~ContinuousDecoder.fits`). :meth:`~ContinuousDecoder.admit`
prefills each new request alone on its longest cached prefix (when the prefix cache is on), draws its
first token and places it in a slot of the :class:`~toolgym.agents.policies.hf_slots.SlotCache`;
:meth:`~ContinuousDecoder.step` runs one decode step for every row in flight, draws every row's next
token on the device (:func:`~toolgym.agents.policies.hf_sample.sample`: only the ids and their logprobs
leave it) and returns the rows that ended, whose callers get their completion without waiting for the
rest. A finished row's keys/values go to the prefix cache, as in the static path.

Reproducibility: a token's sampling noise depends only on its request's seed and its index in the
completion (:func:`~toolgym.agents.policies.hf_sample.noise_keys`), so the rows a request shares its steps
with change its tokens only through the rounding of the logits (tested on CPU: none).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from toolgym.agents.policies.hf_cache import LayerKV, prefill_row
from toolgym.agents.policies.hf_rows import Request, Row
from toolgym.agents.policies.hf_sample import noise_keys, sample
from toolgym.agents.policies.hf_slots import SlotCache
from toolgym.agents.policies.prefix_cache import PrefixCache

__all__ = ["ContinuousDecoder", "DecodeStats", "prefill"]


def prefill(
    model: Any, device: Any, prompt: Sequence[int], cache: PrefixCache | None
) -> tuple[torch.Tensor, list[LayerKV]]:
    """Prefill ``prompt`` alone on its longest cached prefix (none when ``cache`` is ``None``) and
    store the result in the cache; returns its last logits ``[vocab]`` and its keys/values."""
    if cache is None:
        return prefill_row(model, prompt, 0, [], device)
    cached, prefix = cache.lookup(prompt, limit=len(prompt) - 1)
    if len(prompt) > 1 and cached < len(prompt) - 1:
        # NOTE (determinism): the last prompt token always runs alone on the keys/values of the
        # rest, so a repeated request (all but its last token cached) repeats exactly the
        # computation of the first one and gets bit-identical logprobs.
        _, prefix = prefill_row(model, prompt[:-1], cached, prefix, device)
        cached = len(prompt) - 1
    logits, layers = prefill_row(model, prompt, cached, prefix, device)
    # Stored at once, so a later row with the same prompt (a GRPO group) reuses it.
    cache.insert(prompt, layers)
    return logits, layers


@dataclass
class DecodeStats:
    """Counters since the decoder was made: decode steps, the rows they computed (live and idle slots),
    rows admitted, joins into a free slot, re-layouts (copies of every live row's keys/values) and the
    most rows in flight at once."""

    steps: int = 0
    live_rows: int = 0
    idle_rows: int = 0
    admitted: int = 0
    joined: int = 0
    relayouts: int = 0
    peak_rows: int = 0


class ContinuousDecoder:
    """The rows in flight of one weight version (see the module docstring).

    Args:
        model: the causal LM (eval mode, plain full-attention cache layers).
        device: its torch device.
        max_batch: most rows in flight.
        max_batch_tokens: a token budget for the rows in flight (0 = none): rows join only while their
            count times the longest row's prompt and completion (the key/value slots they may fill when
            laid out side by side) stays within it; one row alone always runs.
        stop_ids: the format's end-of-turn ids.
        decode: token ids to text (for stop strings and the completion's text).
        pad_id: the id fed to a free slot.
        max_context: the model's context (a row's tokens are capped by it).
        prefix_cache: the policy's prefix cache, or ``None``.
    """

    def __init__(
        self,
        model: Any,
        device: Any,
        *,
        max_batch: int,
        stop_ids: Collection[int],
        decode: Callable[[Sequence[int]], str],
        pad_id: int,
        max_context: int,
        prefix_cache: PrefixCache | None,
        max_batch_tokens: int = 0,
    ) -> None:
        self.model = model
        self.device = device
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self.stop_ids = stop_ids
        self.decode = decode
        self.pad_id = pad_id
        self.max_context = max_context
        self.prefix_cache = prefix_cache
        self.rows: dict[int, Row] = {}  # slot -> row in flight
        self.slots: SlotCache | None = None
        self.stats = DecodeStats()

    @property
    def free(self) -> int:
        """How many more rows may join."""
        return self.max_batch - len(self.rows)

    def fits(self, requests: Sequence[Request]) -> bool:
        """Whether ``requests`` may join the rows in flight within the token budget (always without
        one, and always for a single row alone)."""
        if not self.max_batch_tokens:
            return True
        extents = [len(row.request.prompt) + row.max_tokens for row in self.rows.values()]
        extents += [len(request.prompt) + self._max_tokens(request) for request in requests]
        return len(extents) <= 1 or len(extents) * max(extents) <= self.max_batch_tokens

    def _max_tokens(self, request: Request) -> int:
        """The most tokens ``request`` may sample: its ``max_tokens``, capped by the model's context."""
        return min(request.sampling.max_tokens, self.max_context - len(request.prompt))

    def admit(self, requests: Sequence[Request]) -> list[Row]:
        """Prefill ``requests`` (at most :attr:`free`), draw their first tokens and place the rows that
        go on; returns the rows that ended on their first token."""
        if len(requests) > self.free:
            raise ValueError(f"{len(requests)} requests for {self.free} free rows")
        if not requests:
            return []
        rows, logits, layers = [], [], []
        for request in requests:
            rows.append(Row(request, self._max_tokens(request)))
            last, kv = prefill(self.model, self.device, request.prompt, self.prefix_cache)
            logits.append(last)
            layers.append(kv)
        self.stats.admitted += len(rows)
        done = self.draw(rows, torch.stack(logits))
        self._place([(row, kv) for row, kv in zip(rows, layers, strict=True) if row.finish is None])
        return done

    def step(self) -> list[Row]:
        """One decode step for every row in flight; returns the rows that ended."""
        slots = self.slots
        if slots is None or not self.rows:
            return []
        ids, positions = [self.pad_id] * slots.slots, [0] * slots.slots
        for slot, row in self.rows.items():
            ids[slot] = row.ids[-1]
            positions[slot] = len(row.request.prompt) + len(row.ids) - 1
        out = self.model(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device)[:, None],
            attention_mask=slots.step_mask(),
            position_ids=torch.tensor(positions, dtype=torch.long, device=self.device)[:, None],
            past_key_values=slots.cache,
            use_cache=True,
        )
        slots.advance()
        self.stats.steps += 1
        self.stats.live_rows += len(self.rows)
        self.stats.idle_rows += slots.slots - len(self.rows)
        order = sorted(self.rows)
        done = self.draw([self.rows[s] for s in order], out.logits[order, -1, :])
        for slot in order:
            row = self.rows[slot]
            if row.finish is None:
                continue
            if self.prefix_cache is not None:
                # NOTE: the last sampled id was never fed to the model, so it has no keys/values.
                fed = len(row.request.prompt) + len(row.ids) - 1
                self.prefix_cache.insert(row.request.prompt + row.ids[:-1], slots.row(slot, fed))
            del self.rows[slot]
            slots.leave(slot)
        if self.rows:
            self._place([])  # compacts when as many slots idle as work
        else:
            self.slots = None
        return done

    def clear(self) -> list[Row]:
        """Drop every row in flight (after a failed step); returns them."""
        rows = list(self.rows.values())
        self.rows.clear()
        self.slots = None
        return rows

    def draw(self, rows: list[Row], logits: torch.Tensor) -> list[Row]:
        """Draw one token for each of ``rows`` from its logits (``[rows, vocab]``) and record it;
        returns the rows that ended. The one place tokens are chosen (a subclass may force them)."""
        params = [row.request.sampling for row in rows]
        values = torch.tensor(
            [[p.temperature for p in params], [p.top_p for p in params]], dtype=torch.float32
        )
        keys = torch.tensor(noise_keys([row.request.seed for row in rows], [len(row.ids) for row in rows]))
        values, keys = values.to(self.device), keys.to(self.device)
        truncate = any(p.temperature > 0 and p.top_p < 1.0 for p in params)
        ids, logprobs = sample(logits, values[0], values[1], keys, truncate=truncate)
        done = []
        for row, token, logprob in zip(rows, ids.tolist(), logprobs.tolist(), strict=True):
            row.record(token, logprob, self.stop_ids, self.decode)
            if row.finish is not None:
                done.append(row)
        return done

    # ----------------------------------------------------------------- internals
    def _place(self, newcomers: list[tuple[Row, list[LayerKV]]]) -> None:
        """Join each newcomer into a free slot; when one does not fit, lay every row out afresh."""
        waiting = []
        for row, kv in newcomers:
            slot = None if self.slots is None else self.slots.join(kv, _to_come(row))
            if slot is None:
                waiting.append((row, kv))
            else:
                self.rows[slot] = row
                self.stats.joined += 1
        self.stats.peak_rows = max(self.stats.peak_rows, len(self.rows) + len(waiting))
        slots = self.slots
        if not waiting and (slots is None or len(slots.free) < max(len(self.rows), 1)):
            return
        live = [] if slots is None else [(row, slots.row(slot)) for slot, row in sorted(self.rows.items())]
        everyone = live + waiting
        if not everyone:
            self.rows, self.slots = {}, None
            return
        longest = max(kv[0][0].shape[-2] for _, kv in everyone)
        to_come = max(_to_come(row) for row, _ in everyone)
        # Room for the rows that join next: a quarter of the longest row on the left (a later turn
        # of an episode is longer than its first), twice the longest completion to come on the right.
        self.slots = SlotCache.build(
            [kv for _, kv in everyone], room_left=longest // 4, room_right=2 * to_come
        )
        self.rows = {slot: row for slot, (row, _) in enumerate(everyone)}
        self.stats.relayouts += 1


def _to_come(row: Row) -> int:
    """Decode steps ``row`` may still take (each feeds its last token and draws the next)."""
    return row.max_tokens - len(row.ids)
