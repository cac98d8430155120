"""The learner's bookkeeping as pure functions: samples, micro-batches, padded tensors.

:mod:`toolgym.training.learn.grpo` plans a step into :class:`Sample` values; :func:`micro_batches` and
:func:`pack_batch` make the padded tensors the loss takes. Nothing here runs a model, so each piece has exact-value tests.

NOTE (masks): :func:`pack_batch` right-pads with mask 0 and behaviour logprob 0.0, so padding never
enters the loss; the model-side scorers pad their token ids the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from toolgym.core import Trajectory

__all__ = [
    "PackedBatch",
    "Sample",
    "common_prefix_length",
    "micro_batches",
    "pack_batch",
]


@dataclass(frozen=True)
class Sample:
    """One token sequence the learner trains on, with its group-relative advantage.

    Attributes:
        trajectory: the sequence: an episode, or one segment of a compacted episode
            (:meth:`~toolgym.core.Trajectory.segment_views`).
        advantage: the episode's advantage (every segment of an episode trains with it).
        episode: the whole episode when ``trajectory`` is one of its segments, else ``None``.
        group: the position of its group in the step's input; ``index``: its position in that group.
    """

    trajectory: Trajectory
    advantage: float
    episode: Trajectory | None = None
    group: int = 0
    index: int = 0


def micro_batches(
    samples: Sequence[Sample], size: int, *, max_tokens: int = 0, shared: int = 0
) -> list[tuple[Sample, ...]]:
    """The learner's memory bound per forward pass: chunks of at most ``size`` samples.

    Without ``max_tokens``, consecutive chunks in order. With it, the samples go longest first (ties
    in order) and a chunk also closes before its padded cost, rows times its longest row's tokens
    after the first ``shared - 1`` (what a shared-prefix scorer runs: its suffixes start at the last
    shared token), would pass ``max_tokens``; a sample that alone costs more goes alone. The loss
    weighs every token for the whole step, so the chunking changes sums only by float rounding.
    """
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    if max_tokens <= 0:
        return [tuple(samples[i : i + size]) for i in range(0, len(samples), size)]
    skip = max(shared - 1, 0)
    order = sorted(samples, key=lambda s: -len(s.trajectory.token_ids))
    chunks: list[tuple[Sample, ...]] = []
    chunk: list[Sample] = []
    for sample in order:
        width = max(len(sample.trajectory.token_ids) - skip, 1)
        if chunk:
            longest = max(len(chunk[0].trajectory.token_ids) - skip, 1)  # longest first: the first
            if len(chunk) == size or (len(chunk) + 1) * max(longest, width) > max_tokens:
                chunks.append(tuple(chunk))
                chunk = []
        chunk.append(sample)
    if chunk:
        chunks.append(tuple(chunk))
    return chunks


def common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """Length of the longest token prefix that every sequence starts with (0 for no sequences)."""
    if not sequences:
        return 0
    shortest = min(len(s) for s in sequences)
    first = sequences[0]
    for i in range(shortest):
        token = first[i]
        if any(s[i] != token for s in sequences):
            return i
    return shortest


@dataclass(frozen=True)
class PackedBatch:
    """A micro-batch as right-padded tensors, row ``i`` being ``samples[i]``.

    Attributes:
        sequences: the token ids, unpadded (the scorers pad them themselves).
        behaviour: ``[B, T]`` float32 behaviour logprobs (0.0 on prompt, tool output and padding).
        mask: ``[B, T]`` float32, 1.0 on sampled tokens only.
        advantages: ``[B]`` float32.
    """

    sequences: tuple[tuple[int, ...], ...]
    behaviour: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor


def pack_batch(samples: Sequence[Sample], device: torch.device | str = "cpu") -> PackedBatch:
    """The tensors :func:`~toolgym.training.learn.loss.clipped_pg_loss` takes, with ``T`` = the longest sample."""
    if not samples:
        raise ValueError("pack_batch needs at least one sample")
    length = max(len(s.trajectory.token_ids) for s in samples)
    behaviour = torch.zeros((len(samples), length), device=device)
    mask = torch.zeros((len(samples), length), device=device)
    for i, sample in enumerate(samples):
        t = sample.trajectory
        behaviour[i, : len(t.logprobs)] = torch.tensor(t.logprobs, device=device)
        mask[i, : len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=torch.float32, device=device)
    return PackedBatch(
        sequences=tuple(tuple(s.trajectory.token_ids) for s in samples),
        behaviour=behaviour,
        mask=mask,
        advantages=torch.tensor([s.advantage for s in samples], device=device),
    )
