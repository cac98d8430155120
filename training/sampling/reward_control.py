"""Shuffled rewards: a control arm whose rewards say nothing about the task (``train.reward_control``).

Each training episode of task ``i`` is scored against the reference of task ``pi(i)``, where ``pi`` is a
seeded permutation of the training tasks with no fixed point (a single cycle, drawn with Sattolo's
algorithm), passed to the environment as the ``score_as`` reset option: the episode, its prompt and its
tools are task ``i``'s, only the verifier's reference is another's. A policy that still gains under it
gains from something else than solving the task (format, length, a prior over answers); the gain of
RL over this arm is what the task's own reward carries.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from toolgym.errors import ConfigError

__all__ = ["shuffled_references"]


def shuffled_references(task_ids: Sequence[str], seed: int) -> dict[str, str]:
    """``task id -> the task whose reference scores it``: a permutation with no fixed point, seeded.

    Raises:
        ConfigError: fewer than two distinct tasks (nothing to shuffle with).
    """
    ids = sorted(set(task_ids))
    if len(ids) < 2:
        raise ConfigError(
            f"train.reward_control = 'shuffled' needs two or more training tasks to score against each "
            f"other's references, got {len(ids)}"
        )
    order = list(ids)
    rng = random.Random(seed)
    for i in range(len(order) - 1, 0, -1):  # Sattolo: one cycle through every task, so none maps to itself
        j = rng.randrange(i)
        order[i], order[j] = order[j], order[i]
    return dict(zip(ids, order, strict=True))
