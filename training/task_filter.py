"""Train-split task selection: skip questions the policy currently solves always or never.

A group whose learner rewards are all equal carries no gradient; on a small model most such groups
are tasks it never solves (or, later, always solves). :class:`PassRateFilter` remembers, per training
task, whether its last group had reward variance. When the epoch order comes back to a task whose last
group had none, that task is passed over once (its rollouts are saved) and tried again the time after,
so a task the policy has learned to solve, or has become able to, is not shut out for good.

Only training groups feed it (never held-out tasks); its state is part of the checkpoint, and the
learner consults it only when it admits groups, so runs stay reproducible.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from toolgym.core import Trajectory
from toolgym.training.grpo import informative

__all__ = ["PassRateFilter"]


class PassRateFilter:
    """Per task: did its last group have reward variance? A task whose last group had none is skipped once."""

    def __init__(self, *, format_credit: float = 0.0, answer_tool: str = "answer") -> None:
        self.format_credit, self.answer_tool = format_credit, answer_tool
        self._settled: dict[str, bool] = {}
        self.skipped = 0

    def observe(self, groups: Sequence[tuple[str, Sequence[Trajectory]]]) -> None:
        """Record ``(task_id, trajectories)`` of groups the learner consumed (trained or dropped)."""
        for task_id, trajectories in groups:
            if any(t.status != "infra_error" for t in trajectories):
                self._settled[task_id] = not informative(trajectories, self.format_credit, self.answer_tool)

    def skip(self, task_id: str) -> bool:
        """Whether to pass over ``task_id`` now (each settled verdict is spent by one skip)."""
        if self._settled.get(task_id, False):
            self._settled[task_id] = False
            self.skipped += 1
            return True
        return False

    def metrics(self) -> dict[str, float]:
        seen = len(self._settled)
        settled = sum(self._settled.values())
        return {
            "task_filter/skipped": float(self.skipped),
            "task_filter/settled_share": settled / seen if seen else 0.0,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"settled": dict(self._settled), "skipped": self.skipped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._settled = {str(k): bool(v) for k, v in state["settled"].items()}
        self.skipped = int(state["skipped"])
