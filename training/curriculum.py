"""A curriculum that unlocks tools in stages, on measured signals (the trainer's lever on ``options["tools"]``).

Stages are growing tool sets, e.g. ``answer`` only, then ``+search``, then ``+open``. The trainer asks
:meth:`ToolCurriculum.tools_for` which tools an episode may use (passed to the environment as
``reset(options={"tools": [...]})``) and reports finished episodes to :meth:`ToolCurriculum.observe`,
once per learner step. The next stage unlocks when either signal holds:

* **plateau** — the rolling success rate stopped improving: the mean over the last ``window``
  observations minus the mean over the ``window`` before is below ``plateau_delta``;
* **unsolved** — the share of tasks seen in this stage (at least ``min_attempts`` times each) that were
  never solved with the current tools is at least ``unsolved_threshold``.

Hysteresis: the signal must hold on ``patience`` consecutive observations, and a stage lasts at least
``min_stay`` observations, so one noisy batch never unlocks a tool. ``preview_prob`` lets a share of
episodes see the next stage's tools early; it draws from a seeded generator whose state is saved, so
decisions are identical after a resume.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from toolgym.core import Task, Trajectory
from toolgym.errors import ConfigError

__all__ = ["CurriculumConfig", "ToolCurriculum"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CurriculumConfig:
    """Settings of :class:`ToolCurriculum`.

    Attributes:
        stages: tool sets, in unlock order; each stage lists *all* its tools (later stages usually
            extend earlier ones). An empty tuple disables the curriculum (the env's full tool set).
        success_threshold: a trajectory with reward >= this counts as solved.
        window: observations (learner steps) per plateau window.
        plateau_delta: improvement between two windows below which success has plateaued.
        unsolved_threshold: share of never-solved tasks that unlocks the next stage.
        min_attempts: attempts before a task counts towards the unsolved share.
        patience: consecutive observations a signal must hold (hysteresis).
        min_stay: observations spent in a stage before it may be left.
        preview_prob: probability that an episode already gets the next stage's tools.
        seed: seeds the preview draws.
    """

    stages: tuple[tuple[str, ...], ...] = ()
    success_threshold: float = 0.5
    window: int = 3
    plateau_delta: float = 0.02
    unsolved_threshold: float = 0.8
    min_attempts: int = 2
    patience: int = 2
    min_stay: int = 3
    preview_prob: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.window < 1 or self.patience < 1 or self.min_stay < 0 or self.min_attempts < 1:
            raise ConfigError("curriculum: window, patience and min_attempts must be >= 1 and min_stay >= 0")
        if not 0.0 <= self.preview_prob <= 1.0 or not 0.0 <= self.unsolved_threshold <= 1.0:
            raise ConfigError("curriculum: preview_prob and unsolved_threshold must lie in [0, 1]")
        if any(len(stage) == 0 for stage in self.stages):
            raise ConfigError(
                "curriculum: a stage must list at least one tool (the terminal tool, e.g. 'answer')"
            )


class ToolCurriculum:
    """Stage-wise tool unlocking with hysteresis; see the module docstring."""

    def __init__(self, config: CurriculumConfig) -> None:
        self.config = config
        self.stage = 0
        self._rng = np.random.default_rng(config.seed)
        self._history: list[float] = []  # success rate per observation, current stage
        self._attempts: dict[str, int] = {}
        self._solved: dict[str, int] = {}
        self._streak = 0
        self._observations = 0
        self._events: list[dict[str, Any]] = []
        self._last_signal = ""

    # ------------------------------------------------------------------ queries
    @property
    def enabled(self) -> bool:
        return bool(self.config.stages)

    @property
    def final(self) -> bool:
        return not self.enabled or self.stage >= len(self.config.stages) - 1

    def tools_for(self, task: Task | str | None = None) -> set[str] | None:
        """Tools the next episode may use; ``None`` means no restriction (curriculum disabled)."""
        if not self.enabled:
            return None
        stage = self.stage
        if not self.final and self.config.preview_prob > 0 and self._rng.random() < self.config.preview_prob:
            stage += 1
        return set(self.config.stages[stage])

    @property
    def events(self) -> list[dict[str, Any]]:
        """Stage changes so far: ``{"observation", "from", "to", "signal", "tools"}``."""
        return [dict(e) for e in self._events]

    # ------------------------------------------------------------------ updates
    def observe(self, trajectories: Iterable[Trajectory]) -> bool:
        """Record one learner step's finished episodes; returns True when a stage was unlocked."""
        trajectories = [t for t in trajectories if t.status != "infra_error"]
        self._observations += 1
        if not self.enabled or not trajectories:
            return False
        solved = [t.reward >= self.config.success_threshold for t in trajectories]
        self._history.append(sum(solved) / len(solved))
        for t, ok in zip(trajectories, solved, strict=True):
            self._attempts[t.task_id] = self._attempts.get(t.task_id, 0) + 1
            self._solved[t.task_id] = self._solved.get(t.task_id, 0) + int(ok)
        if self.final:
            return False
        signal = self._signal()
        self._streak = self._streak + 1 if signal else 0
        self._last_signal = signal
        if signal and self._streak >= self.config.patience and len(self._history) >= self.config.min_stay:
            self._unlock(signal)
            return True
        return False

    def _signal(self) -> str:
        w = self.config.window
        if len(self._history) >= 2 * w:
            recent = sum(self._history[-w:]) / w
            before = sum(self._history[-2 * w : -w]) / w
            if recent - before < self.config.plateau_delta:
                return "plateau"
        share = self.unsolved_share()
        if share is not None and share >= self.config.unsolved_threshold:
            return "unsolved"
        return ""

    def unsolved_share(self) -> float | None:
        """Share of tasks tried ``min_attempts`` times in this stage and never solved (None: none yet)."""
        seen = [k for k, n in self._attempts.items() if n >= self.config.min_attempts]
        if not seen:
            return None
        return sum(1 for k in seen if self._solved[k] == 0) / len(seen)

    def _unlock(self, signal: str) -> None:
        old = self.stage
        self.stage += 1
        event = {
            "observation": self._observations,
            "from": old,
            "to": self.stage,
            "signal": signal,
            "tools": sorted(self.config.stages[self.stage]),
        }
        self._events.append(event)
        log.info("curriculum: stage %d -> %d on %s; tools now %s", old, self.stage, signal, event["tools"])
        self._history, self._attempts, self._solved, self._streak = [], {}, {}, 0

    # ------------------------------------------------------------------ state
    def metrics(self) -> dict[str, float]:
        share = self.unsolved_share()
        recent = self._history[-self.config.window :]
        return {
            "curriculum/stage": float(self.stage),
            "curriculum/success_rate": sum(recent) / len(recent) if recent else 0.0,
            "curriculum/unsolved_share": share if share is not None else 0.0,
            "curriculum/signal_streak": float(self._streak),
            "curriculum/unlocks": float(len(self._events)),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "rng": self._rng.bit_generator.state,
            "history": list(self._history),
            "attempts": dict(self._attempts),
            "solved": dict(self._solved),
            "streak": self._streak,
            "observations": self._observations,
            "events": self.events,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        stage = int(state["stage"])
        if self.enabled and not 0 <= stage < len(self.config.stages):
            raise ConfigError(
                f"curriculum state has stage {stage}, but the config has {len(self.config.stages)} stages"
            )
        self.stage = stage
        self._rng.bit_generator.state = state["rng"]
        self._history = [float(x) for x in state["history"]]
        self._attempts = {str(k): int(v) for k, v in state["attempts"].items()}
        self._solved = {str(k): int(v) for k, v in state["solved"].items()}
        self._streak = int(state["streak"])
        self._observations = int(state["observations"])
        self._events = [dict(e) for e in state["events"]]


def parse_stages(stages: Sequence[Sequence[str]]) -> tuple[tuple[str, ...], ...]:
    """Normalise stages from a config file (lists of names) to tuples."""
    return tuple(tuple(str(name) for name in stage) for stage in stages)
