"""Token-level clipped policy-gradient loss over sampled tokens (pure torch functions).

NOTE (masks): only tokens with ``loss_mask == 1`` (sampled by the policy) enter the loss; prompt, tool
output and harness text never do. The importance ratio is ``exp(logp_new - logp_behaviour)``, the
behaviour logprobs being those recorded at sampling time, so stale (off-policy) samples are corrected
and clipped rather than trusted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from toolgym.core import Trajectory, sampled_ids_hash
from toolgym.errors import ToolgymError

__all__ = [
    "LossTerms",
    "TokenFidelityError",
    "check_token_receipt",
    "clipped_pg_loss",
    "k3_kl",
    "mismatch_kl",
    "token_logprobs",
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
    """The loss and its parts (detached floats except ``loss``)."""

    loss: torch.Tensor
    pg: float
    kl: float
    clip_frac: float
    ratio_mean: float
    tokens: int


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
    """Clipped surrogate, token-level mean over mask-1 tokens.

    Args:
        logp: learner logprobs of the taken tokens, ``[B, T]`` (with grad).
        logp_behaviour: logprobs recorded at sampling time, ``[B, T]``.
        advantages: per-sequence ``[B]`` or per-token ``[B, T]`` advantages.
        mask: ``[B, T]``, 1 on sampled tokens.
        clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]`` (asymmetric
            clipping lets rare good tokens grow faster than they shrink).
        kl_coef: weight of the k3 KL to ``logp_ref`` (required when ``kl_coef > 0``).
        num_tokens: the denominator of the token mean; pass the whole step's mask-1 count when the
            batch is split into micro-batches so that their gradients add up to the full-batch mean.

    Returns:
        :class:`LossTerms` whose ``loss`` is ``sum(per_token * mask) / num_tokens``.
    """
    if logp.shape != logp_behaviour.shape or logp.shape != mask.shape:
        raise ValueError(
            f"shape mismatch: logp {tuple(logp.shape)}, behaviour {tuple(logp_behaviour.shape)}, mask {tuple(mask.shape)}"
        )
    if kl_coef > 0 and logp_ref is None:
        raise ValueError("kl_coef > 0 needs logp_ref (the reference model's logprobs)")
    mask = mask.to(logp.dtype)
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logp)
    n = int(mask.sum().item()) if num_tokens is None else num_tokens
    denom = max(n, 1)
    ratio = torch.exp(logp - logp_behaviour)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    pg = (per_token * mask).sum() / denom
    loss = pg
    kl_value = 0.0
    if logp_ref is not None:
        kl = (k3_kl(logp, logp_ref) * mask).sum() / denom
        kl_value = float(kl.detach())
        if kl_coef > 0:
            loss = loss + kl_coef * kl
    with torch.no_grad():
        was_clipped = ((clipped < unclipped) & (mask > 0)).to(logp.dtype)
        clip_frac = float(was_clipped.sum() / denom)
        ratio_mean = float((ratio * mask).sum() / denom)
    return LossTerms(
        loss=loss, pg=float(pg.detach()), kl=kl_value, clip_frac=clip_frac, ratio_mean=ratio_mean, tokens=n
    )


def token_logprobs(
    model: torch.nn.Module, sequences: Sequence[Sequence[int]], *, temperature: float = 1.0, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each token given its prefix, for right-padded sequences.

    Returns ``(logp, valid)`` of shape ``[B, T]``: ``logp[:, t]`` is ``log p(x_t | x_<t)`` (position 0
    has no prefix and is 0), ``valid`` marks real (non-pad) positions. Logits are divided by the
    sampling temperature so the learner scores the same distribution the policy sampled from.
    """
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    valid = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        valid[i, : len(seq)] = 1
    device = next(model.parameters()).device  # the learner may live on a GPU; results stay there
    ids, valid = ids.to(device), valid.to(device)
    logits = model(input_ids=ids, attention_mask=valid).logits[:, :-1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    taken = torch.gather(torch.log_softmax(logits, dim=-1), -1, ids[:, 1:, None]).squeeze(-1)
    logp = torch.cat([torch.zeros((len(sequences), 1), dtype=taken.dtype, device=device), taken], dim=1)
    return logp, valid
