"""Did a run learn? First fifth versus last fifth of its steps, with a bootstrap interval.

A training curve from a few dozen episodes per step is noisy; a rising ``reward/mean`` line may be
chance. :func:`learning_summary` compares the verifier's reward over the first and the last fifth of a
run's steps and attaches a percentile bootstrap 95% interval to the difference. The resampling unit is
the trajectory: each fifth's trajectory rewards are resampled with replacement, separately, many
times. The interval lies above zero when the last fifth is better by more than the episode-to-episode
noise explains.

Decisions (part of the contract):

* The reward is each trajectory's own ``reward``: the verifier's, never the learner's shaped reward
  (``train.format_credit``), so a run cannot "learn" by earning credit the task does not give.
* ``infra_error`` trajectories are left out, as in ``reward/mean``.
* Steps come from ``metrics.jsonl`` (after a resume it holds each step once); a fifth is
  ``max(1, n_steps // 5)`` steps, so the two fifths never overlap when there are two steps or more.
* The bootstrap is seeded, so the same run directory always gives the same interval.
* The interval says nothing about *why* reward rose: a curriculum that unlocks a tool raises reward
  without any weight change. :func:`stage_changes` lists the unlocks so a reader can tell them apart;
  a run with ``train.optim.lr = 0`` is the control that isolates them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from toolgym.training.experiments.html import read_jsonl

__all__ = [
    "LearningSummary",
    "bootstrap_difference",
    "learning_summary",
    "read_run",
    "stage_changes",
]


@dataclass(frozen=True)
class LearningSummary:
    """First fifth versus last fifth of a run's steps.

    Attributes:
        steps: every step of the run, in order.
        step_means: ``reward/mean`` of each step (the verifier's reward), as the trainer logged it.
        first_steps, last_steps: the steps in each fifth.
        first_rewards, last_rewards: the trajectory rewards of each fifth.
        first_mean, last_mean: their means.
        difference: ``last_mean - first_mean``.
        ci_low, ci_high: percentile bootstrap interval of the difference at ``confidence``.
        confidence: the interval's level (0.95 by default).
        resamples: bootstrap resamples drawn.
    """

    steps: tuple[int, ...]
    step_means: tuple[float, ...]
    first_steps: tuple[int, ...]
    last_steps: tuple[int, ...]
    first_rewards: tuple[float, ...]
    last_rewards: tuple[float, ...]
    first_mean: float
    last_mean: float
    difference: float
    ci_low: float
    ci_high: float
    confidence: float
    resamples: int

    @property
    def learned(self) -> bool:
        """True when the whole interval lies above zero."""
        return self.ci_low > 0.0


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass the directory a `toolgym train --out DIR` run wrote")
    return read_jsonl(path)


def read_run(run_dir: str | Path) -> tuple[list[dict[str, Any]], dict[int, list[float]]]:
    """A run's per-step metrics and, per step, the verifier rewards of its usable trajectories."""
    run_dir = Path(run_dir)
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    rewards: dict[int, list[float]] = {}
    for record in _read_jsonl(run_dir / "trajectories.jsonl"):
        trajectory = record["trajectory"]
        if trajectory.get("status") == "infra_error":
            continue
        rewards.setdefault(int(record["step"]), []).append(float(trajectory["reward"]))
    return metrics, rewards


def stage_changes(run_dir: str | Path) -> list[dict[str, Any]]:
    """The curriculum's unlocks (``{"step", "from", "to", "signal", "tools", ...}``); [] if none."""
    path = Path(run_dir) / "curriculum.jsonl"
    return _read_jsonl(path) if path.is_file() else []


def bootstrap_difference(
    first: Sequence[float],
    last: Sequence[float],
    *,
    resamples: int = 10_000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``mean(last) - mean(first)``, each sample resampled on its own."""
    if not first or not last:
        raise ValueError("both samples need at least one reward")
    if resamples < 1 or not 0.0 < confidence < 1.0:
        raise ValueError(f"need resamples >= 1 and 0 < confidence < 1, got {resamples} and {confidence}")
    rng = np.random.default_rng(seed)
    a, b = np.asarray(first, dtype=float), np.asarray(last, dtype=float)
    means_a = a[rng.integers(0, len(a), size=(resamples, len(a)))].mean(axis=1)
    means_b = b[rng.integers(0, len(b), size=(resamples, len(b)))].mean(axis=1)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means_b - means_a, [tail, 1.0 - tail])
    return float(low), float(high)


def learning_summary(
    run_dir: str | Path, *, resamples: int = 10_000, confidence: float = 0.95, seed: int = 0
) -> LearningSummary:
    """Compare the first and last fifth of the run in ``run_dir`` (see the module docstring)."""
    metrics, rewards = read_run(run_dir)
    steps = [int(m["step"]) for m in metrics]
    if len(steps) < 2:
        raise ValueError(f"{run_dir}: {len(steps)} step(s) logged; a first and a last fifth need at least 2")
    if len(set(steps)) != len(steps):
        raise ValueError(f"{run_dir}/metrics.jsonl logs a step twice: {steps}")
    missing = [s for s in steps if not rewards.get(s)]
    if missing:
        raise ValueError(
            f"{run_dir}/trajectories.jsonl has no usable trajectory for step(s) {missing}; "
            "the run directory is incomplete"
        )
    k = max(1, len(steps) // 5)
    first_steps, last_steps = steps[:k], steps[-k:]
    first = [r for s in first_steps for r in rewards[s]]
    last = [r for s in last_steps for r in rewards[s]]
    low, high = bootstrap_difference(first, last, resamples=resamples, confidence=confidence, seed=seed)
    first_mean, last_mean = float(np.mean(first)), float(np.mean(last))
    return LearningSummary(
        steps=tuple(steps),
        step_means=tuple(float(m["reward/mean"]) for m in metrics),
        first_steps=tuple(first_steps),
        last_steps=tuple(last_steps),
        first_rewards=tuple(first),
        last_rewards=tuple(last),
        first_mean=first_mean,
        last_mean=last_mean,
        difference=last_mean - first_mean,
        ci_low=low,
        ci_high=high,
        confidence=confidence,
        resamples=resamples,
    )
