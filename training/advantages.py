"""Group-relative advantages (GRPO family): a pure function of rewards, no torch.

Each task is sampled ``G`` times under the same policy; a sample's advantage is its reward minus the
group's mean, optionally divided by the group's standard deviation. A group whose rewards are all equal
carries no learning signal (every advantage is 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["group_advantages"]


def group_advantages(
    rewards: Sequence[float], *, normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """Advantages of one group of samples of the same task.

    Args:
        rewards: the group's rewards (at least one).
        normalize_std: divide by the group's population standard deviation (GRPO). ``False`` keeps
            plain mean-centring (Dr. GRPO), which does not up-weight nearly-solved or nearly-failed tasks.
        eps: added to the standard deviation so a zero-variance group gives 0, not a division by zero.

    Returns:
        ``(r_i - mean) / (std + eps)`` for each sample, or ``r_i - mean`` without normalisation.
    """
    if len(rewards) == 0:
        raise ValueError("group_advantages needs at least one reward, got an empty group")
    if any(not math.isfinite(r) for r in rewards):
        raise ValueError(f"rewards must be finite, got {list(rewards)}")
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not normalize_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(rewards))
    return [c / (std + eps) for c in centred]
