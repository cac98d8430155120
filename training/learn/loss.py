"""The policy-gradient surrogate over sampled tokens and its variants (pure torch functions).

NOTE (masks): only tokens with ``loss_mask == 1`` (sampled by the policy) enter the loss; prompt, tool
output and harness text never do. The importance ratio is ``exp(logp_new - logp_behaviour)``, the
behaviour logprobs being those recorded at sampling time, so stale (off-policy) samples are corrected
and clipped rather than trusted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from toolgym.training.config.train import AGGREGATIONS, RATIOS, LossConfig

__all__ = [
    "AGGREGATIONS",
    "RATIOS",
    "LossConfig",
    "LossSums",
    "LossTerms",
    "clipped_pg_loss",
    "k3_kl",
    "mismatch_kl",
    "policy_loss",
    "token_weights",
]


def k3_kl(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): ``exp(r) - r - 1`` with ``r = ref - logp``.

    Non-negative and unbiased for samples drawn from the policy.
    """
    r = logp_ref - logp
    return torch.exp(r) - r - 1.0


def mismatch_kl(
    logp_behaviour: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor, num_tokens: int
) -> float:
    """How far the learner's distribution is from the one that sampled: k3 KL over mask-1 tokens.

    A diagnostic (no gradient), divided by the step's token count like the loss, so that micro-batch
    values add up to the step's value.
    """
    with torch.no_grad():
        return float((k3_kl(logp_behaviour, logp.detach()) * mask).sum()) / max(num_tokens, 1)


@dataclass(frozen=True)
class LossTerms:
    """The loss and its parts (detached floats except ``loss``).

    Diagnostics (``clip_frac``, ``ratio_mean``, ``tis_frac``, ``dual_frac``) are sums over mask-1 tokens
    divided by the step's token count, so that micro-batch values add up to the step's value.
    """

    loss: torch.Tensor
    pg: float
    kl: float
    clip_frac: float
    ratio_mean: float
    tokens: int
    tis_frac: float = 0.0
    dual_frac: float = 0.0


def token_weights(
    mask: torch.Tensor, agg: str, *, step_tokens: int, step_sequences: int, constant_norm: int = 1
) -> torch.Tensor:
    """Each token's weight in the step's loss, ``[B, T]`` (0 off the mask): the aggregation as numbers.

    ``step_tokens`` and ``step_sequences`` are the whole step's mask-1 tokens and sequences, so
    micro-batches weighted this way add up to the full-batch loss.
    """
    mask = mask.to(torch.float32)
    if agg == "token_mean":
        return mask / max(step_tokens, 1)
    if agg == "seq_mean":
        lengths = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        return mask / lengths / max(step_sequences, 1)
    if agg == "constant":
        return mask / (constant_norm * max(step_sequences, 1))
    raise ValueError(f"unknown aggregation {agg!r}; choose one of {', '.join(AGGREGATIONS)}")


def policy_loss(
    logp: torch.Tensor,
    logp_behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    config: LossConfig,
    *,
    logp_ref: torch.Tensor | None = None,
    num_tokens: int | None = None,
) -> LossTerms:
    """The configured clipped surrogate of one micro-batch.

    Args:
        logp: learner logprobs of the taken tokens, ``[B, T]`` (with grad).
        logp_behaviour: logprobs recorded at sampling time, ``[B, T]``.
        advantages: per-sequence ``[B]`` or per-token ``[B, T]`` advantages.
        mask: ``[B, T]``, 1 on sampled tokens.
        weights: ``[B, T]`` each token's weight in the loss (:func:`token_weights`).
        config: the variant (:class:`LossConfig`).
        logp_ref: the reference model's logprobs (required when ``config.kl_coef > 0``).
        num_tokens: the step's mask-1 count, the denominator of the diagnostics and of the KL term
            (default: this micro-batch's).

    Returns:
        :class:`LossTerms` whose ``loss`` is ``sum(per_token * weights)`` (+ the weighted KL).
    """
    if logp.shape != logp_behaviour.shape or logp.shape != mask.shape or weights.shape != mask.shape:
        raise ValueError(
            f"shape mismatch: logp {tuple(logp.shape)}, behaviour {tuple(logp_behaviour.shape)}, "
            f"mask {tuple(mask.shape)}, weights {tuple(weights.shape)}"
        )
    if config.kl_coef > 0 and logp_ref is None:
        raise ValueError("kl_coef > 0 needs logp_ref (the reference model's logprobs)")
    mask = mask.to(logp.dtype)
    weights = weights.to(logp.dtype)
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logp)
    n = int(mask.sum().item()) if num_tokens is None else num_tokens
    denom = max(n, 1)
    # the proximal logprobs the ratio is taken against: the sampler's, or (TIS) the learner's own
    anchor = logp.detach() if config.tis_cap else logp_behaviour
    log_ratio = (logp - anchor) * mask
    if config.ratio == "sequence":
        lengths = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        log_ratio = (log_ratio.sum(dim=1, keepdim=True) / lengths).expand_as(logp)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    dual = torch.zeros_like(per_token, dtype=torch.bool)
    if config.dual_clip:
        cap = -config.dual_clip * adv  # positive where adv < 0
        dual = (adv < 0) & (per_token > cap)
        per_token = torch.where(dual, cap, per_token)
    truncated = torch.zeros_like(per_token, dtype=torch.bool)
    if config.tis_cap:
        raw = torch.exp(logp.detach() - logp_behaviour)
        truncated = raw > config.tis_cap
        per_token = per_token * torch.clamp(raw, max=config.tis_cap)
    pg = (per_token * weights).sum()
    loss = pg
    kl_value = 0.0
    if logp_ref is not None:
        kl = (k3_kl(logp, logp_ref) * mask).sum() / denom
        kl_value = float(kl.detach())
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * kl
    with torch.no_grad():
        on = mask > 0
        frac = lambda flags: float((flags & on).to(logp.dtype).sum() / denom)  # noqa: E731
        return LossTerms(
            loss=loss,
            pg=float(pg.detach()),
            kl=kl_value,
            clip_frac=frac(clipped < unclipped),
            ratio_mean=float((ratio * mask).sum() / denom),
            tokens=n,
            tis_frac=frac(truncated),
            dual_frac=frac(dual),
        )


def clipped_pg_loss(
    logp: torch.Tensor,
    logp_behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_coef: float = 0.0,
    logp_ref: torch.Tensor | None = None,
    num_tokens: int | None = None,
) -> LossTerms:
    """The token-level clipped surrogate, token mean over mask-1 tokens (:func:`policy_loss`'s default).

    ``num_tokens``: the denominator of the token mean; pass the whole step's mask-1 count when the
    batch is split into micro-batches so that their gradients add up to the full-batch mean.
    """
    n = int(mask.sum().item()) if num_tokens is None else num_tokens
    weights = token_weights(mask, "token_mean", step_tokens=n, step_sequences=1).to(logp.dtype)
    config = LossConfig(clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef)
    return policy_loss(
        logp, logp_behaviour, advantages, mask, weights, config, logp_ref=logp_ref, num_tokens=n
    )


@dataclass(frozen=True)
class LossSums:
    """The step's loss metrics, summed over micro-batches.

    Every term is already weighted for the whole step (the diagnostics divided by the step's token
    count), so the sums are the full-batch values.
    """

    pg: float = 0.0
    kl: float = 0.0
    clip_frac: float = 0.0
    ratio_mean: float = 0.0
    mismatch_kl: float = 0.0
    tis_frac: float = 0.0
    dual_frac: float = 0.0
    entropy: float = 0.0

    def add(self, terms: LossTerms, mismatch_kl: float, entropy: float = 0.0) -> LossSums:
        """These sums plus one micro-batch's terms, its behaviour/learner mismatch KL and entropy."""
        return LossSums(
            pg=self.pg + terms.pg,
            kl=self.kl + terms.kl,
            clip_frac=self.clip_frac + terms.clip_frac,
            ratio_mean=self.ratio_mean + terms.ratio_mean,
            mismatch_kl=self.mismatch_kl + mismatch_kl,
            tis_frac=self.tis_frac + terms.tis_frac,
            dual_frac=self.dual_frac + terms.dual_frac,
            entropy=self.entropy + entropy,
        )

    def finite(self) -> bool:
        """Whether every term is a finite number: a NaN or infinite loss term (from a non-finite
        logprob, say) means the step's gradient cannot be trusted, whatever its norm."""
        return all(math.isfinite(v) for v in self.as_dict().values())

    def as_dict(self) -> dict[str, float]:
        return {
            "pg": self.pg,
            "kl": self.kl,
            "clip_frac": self.clip_frac,
            "ratio_mean": self.ratio_mean,
            "mismatch_kl": self.mismatch_kl,
            "tis_frac": self.tis_frac,
            "dual_frac": self.dual_frac,
            "entropy": self.entropy,
        }
