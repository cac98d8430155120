"""One GRPO learner step, top to bottom.

1. **reward** — each usable sample's learner reward: the verifier's reward plus the optional format
   credit (:func:`~toolgym.training.learn.rewards.shaped_reward`); ``infra_error`` samples are never scored.
2. **advantage** — group-relative: ``(r - mean) / (std + eps)`` (or only centred), exactly 0 for a
   group whose rewards are equal (:mod:`toolgym.training.learn.advantages`).
3. **plan** — the samples that carry signal: every group with reward variance, each segment of a
   compacted episode with its episode's advantage (:func:`plan_step`).
4. **loss** — micro-batch by micro-batch, the configured surrogate on mask-1 tokens
   (:func:`~toolgym.training.learn.loss.policy_loss`: token or sequence ratio, clip, dual clip, truncated
   importance sampling), each token weighted by the step's aggregation (token mean, sequence mean or
   a constant normaliser); gradients accumulate; the step's common prompt is computed once and each
   group's shared prefix once on top of it (:mod:`toolgym.training.learn.scoring`) (:func:`accumulate_gradients`).
5. **update** — clip the gradient norm and step the optimizer (fp32 master weights, the lr schedule:
   :mod:`toolgym.training.learn.optim`); the trainer publishes the new weights.

Every number a step produces is in its :class:`StepResult`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from toolgym.core import Trajectory, sampled_ids_hash
from toolgym.errors import ToolgymError
from toolgym.training.config.train import TrainConfig
from toolgym.training.learn.advantages import group_advantages, has_variance
from toolgym.training.learn.batching import Sample, micro_batches, pack_batch
from toolgym.training.learn.loss import (
    LossConfig,
    LossSums,
    mismatch_kl,
    policy_loss,
    token_weights,
)
from toolgym.training.learn.rewards import shaped_reward
from toolgym.training.learn.scoring import SequenceScorer

__all__ = [
    "Sample",
    "StepPlan",
    "StepResult",
    "TokenFidelityError",
    "StepSettings",
    "accumulate_gradients",
    "check_token_receipt",
    "informative",
    "plan_step",
]


class TokenFidelityError(ToolgymError):
    """A trajectory's sampled tokens no longer match the receipt taken when they were sampled."""


def check_token_receipt(trajectory: Trajectory) -> None:
    """Refuse a trajectory whose sampled token ids changed after sampling.

    Training on re-tokenised text would push up the probability of ids the policy never produced
    (about 1 in 5 completions re-encode differently), so a mismatch is an error, never silently fixed.
    """
    if len(trajectory.token_ids) != len(trajectory.loss_mask) or len(trajectory.token_ids) != len(
        trajectory.logprobs
    ):
        raise TokenFidelityError(
            f"trajectory {trajectory.task_id!r}: token_ids ({len(trajectory.token_ids)}), loss_mask "
            f"({len(trajectory.loss_mask)}) and logprobs ({len(trajectory.logprobs)}) must have equal lengths"
        )
    got = sampled_ids_hash(trajectory.token_ids, trajectory.loss_mask)
    if got != trajectory.token_hash:
        raise TokenFidelityError(
            f"trajectory {trajectory.task_id!r}: sampled-token receipt mismatch (expected {trajectory.token_hash}, "
            f"got {got}); the token ids were altered after sampling (re-tokenised?). Train only on the ids "
            "the policy sampled."
        )


@dataclass(frozen=True)
class StepPlan:
    """What one optimizer step trains on.

    Attributes:
        advantages: per input group, per trajectory (in the group's order) the advantage; 0.0 for
            ``infra_error`` samples, which never train. Written to ``trajectories.jsonl``.
        groups: the trained samples, one tuple per group that carries signal (input order kept), so a
            group's shared prompt prefix can be computed once.
        zero_variance: groups left out because their rewards were equal (with ``skip_zero_variance``).
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

    def trained(self) -> tuple[tuple[bool, ...], ...]:
        """Per input group, per trajectory: whether any of its sequences trained this step."""
        hit = {(s.group, s.index) for s in self.samples}
        return tuple(tuple((g, i) in hit for i in range(len(a))) for g, a in enumerate(self.advantages))


def learner_rewards(group: Sequence[Trajectory], format_credit: float, answer_tool: str) -> list[float]:
    """Step 1: the learner rewards of a group's usable (not ``infra_error``) samples, in order."""
    return [shaped_reward(t, format_credit, answer_tool) for t in group if t.status != "infra_error"]


def informative(group: Sequence[Trajectory], format_credit: float = 0.0, answer_tool: str = "answer") -> bool:
    """Whether a group carries a policy gradient: two or more usable samples whose learner rewards differ."""
    return has_variance(learner_rewards(group, format_credit, answer_tool))


def plan_step(
    groups: Sequence[Sequence[Trajectory]],
    *,
    scales: Sequence[float] | None = None,
    format_credit: float = 0.0,
    answer_tool: str = "answer",
    normalize_std: bool = True,
    skip_zero_variance: bool = True,
) -> StepPlan:
    """Steps 1-3: learner rewards, group advantages and the samples that train.

    ``infra_error`` samples are left out of their group's statistics and of training (they were never
    scored). A group without reward variance (equal rewards, or a single usable sample) carries no
    policy-gradient signal; ``skip_zero_variance`` leaves it out of the loss altogether. ``scales``
    multiplies each group's advantages (a mixture's per-environment normalisation; 1.0 by default).
    A compacted episode trains each of its segments, all with the episode's advantage.
    """
    advantages: list[tuple[float, ...]] = []
    trained: list[tuple[Sample, ...]] = []
    zero_variance = 0
    for g, group in enumerate(groups):
        usable = [i for i, t in enumerate(group) if t.status != "infra_error"]
        rewards = learner_rewards(group, format_credit, answer_tool)
        adv = group_advantages(rewards, normalize_std=normalize_std) if usable else []
        if scales is not None and scales[g] != 1.0:
            adv = [a * scales[g] for a in adv]
        by_index = dict(zip(usable, adv, strict=True))
        advantages.append(tuple(by_index.get(i, 0.0) for i in range(len(group))))
        if skip_zero_variance and not has_variance(rewards):
            zero_variance += 1
            continue
        if usable:
            trained.append(
                tuple(
                    Sample(view, by_index[i], group[i] if group[i].segments else None, g, i)
                    for i in usable
                    for view in group[i].segment_views()
                )
            )
    return StepPlan(advantages=tuple(advantages), groups=tuple(trained), zero_variance=zero_variance)


@dataclass(frozen=True)
class StepSettings:
    """How a learner step scores and weighs its samples (``[train]``'s loss and batching, the sampling
    temperature), the same on every learner process: rank 0 sends it to the others as it is.

    Attributes:
        loss: the surrogate and its variants (``[train.loss]``).
        micro_batch: sequences a forward pass takes at most; ``micro_batch_tokens``: the token budget of
            one (0: none, ``micro_batch`` alone bounds it).
        temperature: the sampling temperature the behaviour logprobs were taken at.
        share_prefix: each group's shared prompt prefix computed once; ``share_across_groups``: the
            step's common context too, once for the step.
        checkpoint_layers: decoder layers recomputed in the backward pass rather than kept.
        reference: the KL's reference model (``None`` without a KL term).
    """

    loss: LossConfig
    micro_batch: int
    temperature: float
    micro_batch_tokens: int = 0
    share_prefix: bool = True
    share_across_groups: bool = True
    checkpoint_layers: bool = False
    reference: torch.nn.Module | None = None

    @classmethod
    def of(
        cls, train: TrainConfig, *, temperature: float, reference: torch.nn.Module | None = None
    ) -> StepSettings:
        """A run's settings: ``[train.loss]`` and ``[train.batching]``, at the sampling ``temperature``."""
        batching = train.batching
        return cls(
            loss=train.loss,
            micro_batch=batching.micro_batch,
            temperature=temperature,
            micro_batch_tokens=batching.micro_batch_tokens,
            share_prefix=batching.share_prefix,
            checkpoint_layers=batching.checkpoint_layers,
            reference=reference,
        )


def accumulate_gradients(
    model: torch.nn.Module,
    plan: StepPlan,
    settings: StepSettings,
    *,
    step_tokens: int | None = None,
    step_sequences: int | None = None,
) -> LossSums:
    """Step 4: the loss's gradient over the plan's samples, accumulated into ``model``'s ``.grad``.

    How it scores and weighs is ``settings`` (:class:`StepSettings`). With ``share_prefix`` each group is
    scored on its own, its shared prompt prefix computed once
    (same logprobs and gradient, a fraction of the compute); without it the step's samples stream
    through micro-batches in order, each a full forward pass. With ``share_across_groups`` (and several
    groups) the prompt every group starts with is computed once for the step, each group's own
    prefix on top of it. Every micro-batch's terms are already weighted for the whole step, so the
    sums are the full-batch values. A data-parallel learner passes ``plan``, one rank's share of the
    step, with the whole step's ``step_tokens`` and ``step_sequences``, so that the ranks' gradients
    sum to the step's (:mod:`toolgym.training.distributed.learners`). ``checkpoint_layers`` runs each
    micro-batch's decoder layers checkpointed (:mod:`~toolgym.training.learn.layer_checkpoint`: the same
    values and gradient, less memory, one more forward pass).
    """
    for sample in plan.samples:
        check_token_receipt(sample.trajectory)
    loss, temperature, share_prefix, reference = (
        settings.loss,
        settings.temperature,
        settings.share_prefix,
        settings.reference,
    )
    tokens = plan.tokens if step_tokens is None else step_tokens
    sequences = len(plan.samples) if step_sequences is None else step_sequences
    sums = LossSums()
    root = None  # the step's common context (system text, tools, worked example), run once
    if share_prefix and settings.share_across_groups and len(plan.groups) > 1:
        root = SequenceScorer(
            model,
            [s.trajectory.token_ids for s in plan.samples],
            temperature=temperature,
            masks=[s.trajectory.loss_mask for s in plan.samples],
            entropy=True,
        )
    for unit in plan.groups if share_prefix else (plan.samples,):
        seqs = [s.trajectory.token_ids for s in unit]
        masks = [s.trajectory.loss_mask for s in unit]  # where the loss reads logprobs
        scorer = SequenceScorer(
            model,
            seqs,
            temperature=temperature,
            share_prefix=share_prefix,
            masks=masks,
            entropy=True,
            parent=root,
            checkpoint=settings.checkpoint_layers,
        )
        ref = None
        if reference is not None:  # the KL's reference model: scored the same way, no graph
            ref = SequenceScorer(
                reference, seqs, grad=False, temperature=temperature, share_prefix=share_prefix, masks=masks
            )
        for chunk in micro_batches(
            unit, settings.micro_batch, max_tokens=settings.micro_batch_tokens, shared=scorer.shared
        ):
            batch = pack_batch(chunk, device=scorer.device)
            read = [s.trajectory.loss_mask for s in chunk]
            logp, entropy = scorer.scores(batch.sequences, read)
            weights = token_weights(
                batch.mask,
                loss.agg,
                step_tokens=tokens,
                step_sequences=sequences,
                constant_norm=loss.constant_norm,
            )
            terms = policy_loss(
                logp,
                batch.behaviour,
                batch.advantages,
                batch.mask,
                weights,
                loss,
                logp_ref=None if ref is None else ref.logprobs(batch.sequences, read),
                num_tokens=tokens,
            )
            terms.loss.backward()
            ent = 0.0 if entropy is None else float((entropy * batch.mask).sum()) / max(tokens, 1)
            sums = sums.add(terms, mismatch_kl(batch.behaviour, logp, batch.mask, tokens), entropy=ent)
        scorer.backward()  # the shared prefix's share of the gradient, once per group
    if root is not None:
        root.backward()  # and the step's common context's, once per step
    return sums


@dataclass(frozen=True)
class StepResult:
    """What one learner step did (the trainer writes it to ``metrics.jsonl`` and ``trajectories.jsonl``).

    Attributes:
        advantages: per group, per sample, the advantage it trained with (0.0 when it did not).
        trained: per group, per sample, whether it entered the loss.
        informative: groups with reward variance (the ones that train).
        zero_variance: groups without it, left out of the loss.
        losses: the loss's terms and diagnostics, summed over micro-batches.
        tokens: mask-1 tokens trained; ``sequences``: sequences trained.
        grad_norm: before clipping (0 when nothing trained); ``lr``: the learning rate used.
        updated: whether an optimizer step was taken (not when no group carried signal, nor when the
            step was skipped).
        sync: weight-publication timings (``time/weight_sync`` ... for a vLLM engine).
        skipped: why a step with signal took no optimizer update, or "" when it took one or had no
            signal: ``logprobs`` (a trained sample's behaviour logprob is NaN or infinite: nothing
            was accumulated), ``loss`` or ``gradient`` (the step's loss or gradient norm is not
            finite: the update was dropped, every weight untouched).
    """

    advantages: tuple[tuple[float, ...], ...]
    trained: tuple[tuple[bool, ...], ...]
    informative: int
    zero_variance: int
    losses: LossSums
    tokens: int
    sequences: int
    grad_norm: float
    lr: float
    updated: bool
    sync: Mapping[str, float] = field(default_factory=dict)
    skipped: str = ""
