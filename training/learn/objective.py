"""The policy-gradient objective's variants as data (torch-free, so configs load without torch).

:class:`LossConfig` names one surrogate; :func:`toolgym.training.learn.loss.policy_loss` computes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolgym.errors import ConfigError, did_you_mean

__all__ = ["AGGREGATIONS", "RATIOS", "LossConfig"]

#: How the per-token terms of a step are summed into one loss (see :class:`LossConfig`).
AGGREGATIONS = ("token_mean", "seq_mean", "constant")
#: Where the importance ratio lives: per token (PPO/GRPO) or per sequence (GSPO).
RATIOS = ("token", "sequence")


@dataclass(frozen=True)
class LossConfig:
    """The policy-gradient surrogate of one step (from ``[train]``; each variant has exact-value tests).

    Attributes:
        agg: how the per-token terms become one number. ``token_mean``: summed over every mask-1 token
            of the step and divided by their count (DAPO; long answers weigh more). ``seq_mean``: each
            sequence's mean, averaged over the step's sequences (the original GRPO). ``constant``:
            summed per sequence and divided by ``constant_norm`` and the number of sequences (Dr. GRPO:
            no length bias either way).
        constant_norm: the constant normaliser of ``agg = "constant"`` (tokens; e.g. the most a
            sequence can sample).
        ratio: ``token``: each token's own importance ratio; ``sequence``: one ratio per sequence, the
            exp of the mean log-ratio of its tokens, clipped as a whole (GSPO; pair it with small
            clip ranges, e.g. 3e-4 / 4e-4, and ``agg = "seq_mean"`` for the paper's objective).
        clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
        dual_clip: for negative advantages, cap the per-token loss at ``dual_clip * |A|`` (> 1; 0 =
            off), so that a token whose ratio exploded cannot dominate the step.
        tis_cap: truncated importance sampling (> 1; 0 = off). The surrogate's ratio is taken against
            the learner's own (detached) logprobs, and each token is weighted by
            ``min(exp(logp_learner - logp_sampler), tis_cap)``: the sampler (vLLM, another dtype,
            another kernel) and the learner disagree a little on every token, and this corrects the
            gradient for it without letting a rare token's weight explode. With one update per batch
            the learner's logprobs are those of the weights that sampled (at look-ahead 0), so the
            clip never binds and the cap is the trust region.
        kl_coef: weight of the k3 KL to a reference model.
    """

    agg: str = "token_mean"
    constant_norm: int = 256
    ratio: str = "token"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float = 0.0
    tis_cap: float = 0.0
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.agg not in AGGREGATIONS:
            raise ConfigError(
                f"train.loss_agg must be one of {', '.join(AGGREGATIONS)}, got {self.agg!r}."
                f"{did_you_mean(self.agg, AGGREGATIONS)}"
            )
        if self.ratio not in RATIOS:
            raise ConfigError(
                f"train.ratio must be one of {', '.join(RATIOS)}, got {self.ratio!r}.{did_you_mean(self.ratio, RATIOS)}"
            )
        if self.constant_norm < 1:
            raise ConfigError(f"train.loss_constant must be >= 1 token, got {self.constant_norm}")
        if not (0.0 <= self.clip_low < 1.0 and self.clip_high >= 0.0):
            raise ConfigError(
                f"train.clip_low must lie in [0, 1) and clip_high be >= 0, got {self.clip_low}, {self.clip_high}"
            )
        if self.dual_clip != 0.0 and not self.dual_clip > 1.0:
            raise ConfigError(
                f"train.dual_clip must be > 1 (a cap of c * |A| on negative-advantage tokens) or 0 to turn "
                f"it off, got {self.dual_clip}"
            )
        if self.tis_cap != 0.0 and not self.tis_cap > 1.0:
            raise ConfigError(
                f"train.tis_cap must be > 1 (importance weights are truncated at it) or 0 to turn it off, "
                f"got {self.tis_cap}: a cap <= 1 would down-weight every token the learner likes better "
                "than the sampler did"
            )
