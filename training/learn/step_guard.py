"""The guard on every learner step: a non-finite number never reaches the weights.

One NaN in a step is enough to make every weight NaN: the gradient carries it into AdamW's moments and
from there into every parameter, and the export and the engine's copy follow. What a step can hold
that is not finite, and what the guard does about each (checked in this order):

* ``logprobs``: a trained sample's behaviour logprob is NaN or infinite (a policy or engine fault; a
  served policy's replies are checked where they arrive, an in-process one is checked here). Nothing
  is accumulated and no learner process sees the step.
* ``loss``: the step's loss terms, summed over every learner (the same numbers on every rank), are
  not finite.
* ``gradient``: the gradient norm before clipping, over the summed gradient, is not finite.

A skipped step takes no optimizer update (weights, AdamW state and the schedule are untouched, see
:class:`~toolgym.training.learn.optim.LearnerOptimizer`), publishes no new weight version, and is written
down: ``train/skipped`` (1 for this step) and ``train/skipped_steps`` (so far) in ``metrics.jsonl``,
a warning in the log, and the step's groups in ``RUN/nonfinite/step-N.jsonl`` for inspection. After
``train.max_nonfinite_steps`` skipped steps in a row the run stops with :class:`NonFiniteSteps`
(a :class:`~toolgym.errors.RunStopped`): the last checkpoint's weights are intact.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from toolgym.core import Trajectory
from toolgym.errors import RunStopped
from toolgym.run_files import open_write, run_folder
from toolgym.training.learn.grpo import StepPlan

__all__ = ["NONFINITE_DIR", "NonFiniteSteps", "StepGuard", "nonfinite_logprobs"]

log = logging.getLogger(__name__)

#: Where the groups of skipped steps are kept, inside the run directory.
NONFINITE_DIR = "nonfinite"


class NonFiniteSteps(RunStopped):
    """Several steps in a row were not finite: training on would only skip more steps."""


def nonfinite_logprobs(plan: StepPlan) -> bool:
    """Whether a sampled token the plan trains on has a NaN or infinite behaviour logprob."""
    return any(
        not math.isfinite(lp)
        for s in plan.samples
        for lp, m in zip(s.trajectory.logprobs, s.trajectory.loss_mask, strict=True)
        if m
    )


class StepGuard:
    """Counts skipped steps, keeps their groups, and stops the run after too many in a row."""

    def __init__(self, run_dir: Path, max_in_a_row: int) -> None:
        self.run_dir, self.max_in_a_row = run_dir, max_in_a_row
        self.skipped_steps = 0
        self.in_a_row = 0

    def observe(self, step: int, reason: str, groups: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
        """Record step ``step``'s outcome (``reason`` empty: it was not skipped); its metrics.

        Raises:
            NonFiniteSteps: this is the ``max_in_a_row``-th skipped step in a row.
        """
        if not reason:
            self.in_a_row = 0
            return {"train/skipped": 0.0, "train/skipped_steps": float(self.skipped_steps)}
        self.skipped_steps += 1
        self.in_a_row += 1
        path = self._keep(step, reason, groups)
        log.warning(
            "step %d: the %s is not finite; the optimizer update was skipped (weights untouched); its "
            "groups are in %s (%d skipped step(s) in a row, the run stops at %d)",
            step,
            _WHAT[reason],
            path,
            self.in_a_row,
            self.max_in_a_row,
        )
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteSteps(
                f"{self.in_a_row} steps in a row (the last, step {step}) had a non-finite {_WHAT[reason]}; "
                f"each was skipped, so the weights are those before them, and their groups are in "
                f"{self.run_dir / NONFINITE_DIR}. Fix: look at those groups (a policy returning NaN "
                "logprobs, a learning rate that diverges: lower train.optim.lr or train.optim.max_grad_norm), then "
                "rerun the same command to resume from the last checkpoint (train.max_nonfinite_steps "
                "sets how many skipped steps in a row stop the run)"
            )
        return {"train/skipped": 1.0, "train/skipped_steps": float(self.skipped_steps)}

    def _keep(self, step: int, reason: str, groups: Sequence[Sequence[Trajectory]]) -> Path:
        folder = run_folder(self.run_dir, NONFINITE_DIR)
        path = folder / f"step-{step}.jsonl"
        with open_write(path) as fh:
            for g, group in enumerate(groups):
                for i, t in enumerate(group):
                    record = {"step": step, "reason": reason, "group": g, "sample": i}
                    fh.write(json.dumps({**record, "trajectory": json.loads(t.to_json())}) + "\n")
        return path

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The count so far; the run of skipped steps starts again (a rerun after a stop is a new try)."""
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.in_a_row = 0


_WHAT = {"logprobs": "behaviour logprob of a trained token", "loss": "loss", "gradient": "gradient norm"}
