"""The learner's bookkeeping as pure functions: which samples train, with which advantage, in which tensors.

One optimizer step (:meth:`toolgym.training.trainer.Trainer._learn`) reads as: :func:`plan_step` (shaped
rewards -> group-relative advantages -> the samples that carry signal), :func:`micro_batches` and
:func:`pack_batch` (the padded tensors the loss takes), :class:`LossSums` (the step's loss metrics).
Nothing here runs a model, so each piece has exact-value tests.

NOTE (masks): :func:`pack_batch` right-pads with mask 0 and behaviour logprob 0.0, so padding never
enters the loss; the model-side scorers pad their token ids the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from toolgym.core import Trajectory
from toolgym.training.advantages import group_advantages
from toolgym.training.loss import LossTerms
from toolgym.training.rewards import shaped_reward

__all__ = [
    "LossSums",
    "PackedBatch",
    "Sample",
    "StepPlan",
    "common_prefix_length",
    "micro_batches",
    "pack_batch",
    "plan_step",
]


@dataclass(frozen=True)
class Sample:
    """One token sequence the learner trains on, with its group-relative advantage.

    Attributes:
        trajectory: the sequence: an episode, or one segment of a compacted episode
            (:meth:`~toolgym.core.Trajectory.segment_views`).
        advantage: the episode's advantage (every segment of an episode trains with it).
        episode: the whole episode when ``trajectory`` is one of its segments, else ``None``.
    """

    trajectory: Trajectory
    advantage: float
    episode: Trajectory | None = None


@dataclass(frozen=True)
class StepPlan:
    """What one optimizer step trains on.

    Attributes:
        advantages: per input group, per trajectory (in the group's order) the advantage; 0.0 for
            ``infra_error`` samples, which never train. Written to ``trajectories.jsonl``.
        groups: the trained samples, one tuple per group that carries signal (input order kept), so a
            group's shared prompt prefix can be computed once.
        zero_variance: groups left out because every advantage was 0 (with ``skip_zero_variance``).
    """

    advantages: tuple[tuple[float, ...], ...]
    groups: tuple[tuple[Sample, ...], ...]
    zero_variance: int

    @property
    def samples(self) -> tuple[Sample, ...]:
        """Every trained sample, group after group (the order the unshared learner batches them in)."""
        return tuple(s for group in self.groups for s in group)

    @property
    def tokens(self) -> int:
        """The step's mask-1 token count: the denominator of the token-level mean loss."""
        return sum(sum(s.trajectory.loss_mask) for s in self.samples)


def plan_step(
    groups: Sequence[Sequence[Trajectory]],
    *,
    scales: Sequence[float] | None = None,
    format_credit: float = 0.0,
    answer_tool: str = "answer",
    normalize_std: bool = True,
    skip_zero_variance: bool = True,
) -> StepPlan:
    """Advantages of each group from its learner rewards, and the samples that train.

    ``infra_error`` samples are left out of their group's statistics and of training (they were never
    scored). A group whose advantages are all 0 (equal rewards, or a single usable sample) carries no
    policy-gradient signal; ``skip_zero_variance`` leaves it out of the loss altogether. ``scales``
    multiplies each group's advantages (a mixture's per-environment normalisation; 1.0 by default).
    A compacted episode trains each of its segments, all with the episode's advantage.
    """
    advantages: list[tuple[float, ...]] = []
    trained: list[tuple[Sample, ...]] = []
    zero_variance = 0
    for i, group in enumerate(groups):
        usable = [t for t in group if t.status != "infra_error"]
        rewards = [shaped_reward(t, format_credit, answer_tool) for t in usable]
        adv = group_advantages(rewards, normalize_std=normalize_std) if usable else []
        if scales is not None and scales[i] != 1.0:
            adv = [a * scales[i] for a in adv]
        by_id = {id(t): a for t, a in zip(usable, adv, strict=True)}
        advantages.append(tuple(by_id.get(id(t), 0.0) for t in group))
        if skip_zero_variance and all(a == 0.0 for a in adv):
            zero_variance += 1
            continue
        if usable:
            trained.append(
                tuple(
                    Sample(view, by_id[id(t)], t if t.segments else None)
                    for t in usable
                    for view in t.segment_views()
                )
            )
    return StepPlan(advantages=tuple(advantages), groups=tuple(trained), zero_variance=zero_variance)


def micro_batches(samples: Sequence[Sample], size: int) -> list[tuple[Sample, ...]]:
    """Consecutive chunks of at most ``size`` samples (the learner's memory bound per forward pass)."""
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    return [tuple(samples[i : i + size]) for i in range(0, len(samples), size)]


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
    """The tensors :func:`~toolgym.training.loss.clipped_pg_loss` takes, with ``T`` = the longest sample."""
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


@dataclass(frozen=True)
class LossSums:
    """The step's loss metrics, summed over micro-batches.

    Every term is already divided by the step's token count, so the sums are the full-batch values.
    """

    pg: float = 0.0
    kl: float = 0.0
    clip_frac: float = 0.0
    ratio_mean: float = 0.0
    mismatch_kl: float = 0.0

    def add(self, terms: LossTerms, mismatch_kl: float) -> LossSums:
        """These sums plus one micro-batch's terms and its behaviour/learner mismatch KL."""
        return LossSums(
            pg=self.pg + terms.pg,
            kl=self.kl + terms.kl,
            clip_frac=self.clip_frac + terms.clip_frac,
            ratio_mean=self.ratio_mean + terms.ratio_mean,
            mismatch_kl=self.mismatch_kl + mismatch_kl,
        )

    def as_dict(self) -> dict[str, float]:
        return {
            "pg": self.pg,
            "kl": self.kl,
            "clip_frac": self.clip_frac,
            "ratio_mean": self.ratio_mean,
            "mismatch_kl": self.mismatch_kl,
        }
