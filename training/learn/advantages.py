"""Group-relative advantages (GRPO family): a pure function of rewards, no torch.

Each task is sampled ``G`` times under the same policy; a sample's advantage is its reward minus the
group's mean, optionally divided by the group's standard deviation. A group whose rewards are all equal
carries no learning signal: every advantage is exactly 0.

NOTE (zero variance): equality is decided on the rewards themselves (``max - min <= tol``), never on
the centred values. The float mean of six rewards of 0.2 is not exactly 0.2, so centring leaves
``±2.8e-11``; AdamW is scale-invariant and would turn such a group into a full-size step towards
"more of what was sampled". :func:`has_variance` is the one test every caller uses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["VARIANCE_TOL", "group_advantages", "has_variance"]

#: Rewards closer than this (absolute) count as equal: far below any verifier's resolution (an F1
#: over 10,000 tokens moves by 1e-4) and far above the float error of a mean (~1e-16 per unit).
VARIANCE_TOL = 1e-9


def has_variance(rewards: Sequence[float], tol: float = VARIANCE_TOL) -> bool:
    """Whether a group's rewards differ (by more than ``tol``): the group carries a gradient."""
    return len(rewards) >= 2 and max(rewards) - min(rewards) > tol


def group_advantages(
    rewards: Sequence[float], *, normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """Advantages of one group of samples of the same task.

    Args:
        rewards: the group's rewards (at least one).
        normalize_std: divide by the group's population standard deviation (GRPO). ``False`` keeps
            plain mean-centring (Dr. GRPO), which does not up-weight nearly-solved or nearly-failed tasks.
        eps: added to the standard deviation so that a tiny spread does not explode.

    Returns:
        ``(r_i - mean) / (std + eps)`` for each sample, or ``r_i - mean`` without normalisation;
        exactly ``0.0`` for every sample when the rewards are equal (:func:`has_variance`).
    """
    if len(rewards) == 0:
        raise ValueError("group_advantages needs at least one reward, got an empty group")
    if any(not math.isfinite(r) for r in rewards):
        raise ValueError(f"rewards must be finite, got {list(rewards)}")
    if not has_variance(rewards):
        return [0.0] * len(rewards)
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not normalize_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(rewards))
    return [c / (std + eps) for c in centred]
