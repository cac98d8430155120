"""What one learner step trains on: waves of groups from the rollout workers, filtered.

:class:`StepCollector` is step 1 of the trainer's loop. A step takes its first wave of groups (admitted
after the previous update, or ahead of it with look-ahead), in index order:

* a group sampled more than ``max_off_policy_steps`` versions ago is dropped (``stale``);
* with ``dynamic_sampling`` a group without reward variance (no gradient) is dropped
  (``zero_variance``), every informative group is kept, and while fewer than ``tasks_per_step``
  are and the step has drawn fewer than ``max_groups_per_step``, another wave is admitted at the
  current weights. A wave is sized by the run's informative share so far, so that the workers sample
  it all at once (an engine batches many episodes far better than a few) and no admitted group is
  left over for a later step.

Without dynamic sampling a step draws exactly ``tasks_per_step`` groups and the learner leaves the
zero-variance ones out of its loss. Everything here is decided in the learner's order, so a run
draws the same groups whatever the workers' timing; the counters are part of the checkpoint.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

from toolgym.training.config import TrainConfig
from toolgym.training.learn.grpo import informative
from toolgym.training.sampling.workers import Group, InfraGuard, RolloutWorkers

__all__ = ["StepCollector"]

log = logging.getLogger(__name__)


class StepCollector:
    """Takes each step's groups from the workers and admits the waves (see the module docstring)."""

    def __init__(self, train: TrainConfig, progress: Any) -> None:
        self.train = train
        self.progress = progress
        self.infra_guard = InfraGuard(train.max_infra_groups)
        self.next_group = 0  # the index after the last group taken: where a resume starts admitting
        self.dropped_groups = 0  # stale groups, over the run
        self.drawn_seen = self.informative_seen = 0  # groups so far, for the waves' size
        self._waves: deque[int] = deque()  # sizes of the first waves admitted for the coming steps

    def wave_size(self, need: int, room: int) -> int:
        """Groups to draw for ``need`` more informative ones: ``need`` over the run's informative share
        so far (Laplace-smoothed: 1/2 before any group), at most ``room``."""
        if not self.train.dynamic_sampling:
            return need
        share = (self.informative_seen + 1) / (self.drawn_seen + 2)
        return max(1, min(math.ceil(need / share), room))

    def start(self, workers: RolloutWorkers, version: int) -> None:
        """Admit the first waves of this step and of the look-ahead's steps."""
        self._waves.clear()
        for _ in range(1 + self.train.rollouts.max_off_policy_steps):
            self.admit_next(workers, version)

    def admit_next(self, workers: RolloutWorkers, version: int) -> None:
        """Admit the first wave of the next step not yet admitted, at ``version``."""
        tc = self.train
        size = self.wave_size(tc.tasks_per_step, tc.group_budget)
        workers.admit(size, version)
        self._waves.append(size)

    async def collect(
        self, workers: RolloutWorkers, version: int, step: int
    ) -> tuple[list[Group], list[int], list[tuple[Group, str]]]:
        """Step ``step``'s groups in index order: ``(kept, their staleness, dropped with the reason)``."""
        tc = self.train
        kept: list[Group] = []
        staleness: list[int] = []
        dropped: list[tuple[Group, str]] = []
        drawn, budget = 0, tc.group_budget
        to_take = self._waves.popleft()
        while to_take:
            for _ in range(to_take):
                group = await workers.next()
                self.infra_guard.observe(group)  # raises InfraDown when the infrastructure stays down
                self.next_group = group.index + 1
                age = version - group.policy_version
                if age > tc.rollouts.max_off_policy_steps:
                    self.dropped_groups += 1
                    dropped.append((group, "stale"))
                    continue
                drawn += 1
                if tc.dynamic_sampling and not informative(
                    group.trajectories, tc.format_credit, tc.answer_tool
                ):
                    dropped.append((group, "zero_variance"))
                    continue
                staleness.append(age)
                kept.append(group)
            need = tc.tasks_per_step - len(kept)
            to_take = self.wave_size(need, budget - drawn) if need > 0 and drawn < budget else 0
            if to_take:
                workers.admit(to_take, version)
        self.drawn_seen += drawn
        self.informative_seen += sum(
            informative(g.trajectories, tc.format_credit, tc.answer_tool) for g in kept
        )
        if not kept:
            self.progress.line(f"step {step}: no informative group among {drawn} drawn")
            log.warning(
                "step %d: none of the %d groups drawn had reward variance (train.max_groups_per_step = %d): "
                "no optimizer step this step",
                step,
                drawn,
                budget,
            )
        return kept, staleness, dropped

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_group": self.next_group,
            "dropped_groups": self.dropped_groups,
            "groups_seen": [self.drawn_seen, self.informative_seen],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_group = int(state["next_group"])
        self.dropped_groups = int(state["dropped_groups"])
        self.drawn_seen, self.informative_seen = (int(n) for n in state.get("groups_seen", (0, 0)))
