"""A curriculum that unlocks tools in stages, on measured signals (the trainer's lever on reset options).

Stages are growing tool sets, e.g. ``answer`` only, then ``+search``, then ``+open``. The trainer asks
:meth:`ToolCurriculum.reset_options` which tools an episode may use (passed to the environment as
``reset(options={"tools": [...]})``, with any mid-episode ``unlocks``; :meth:`~ToolCurriculum.tools_for`
gives the tool set alone) and reports finished episodes to :meth:`ToolCurriculum.observe`,
once per learner step. The next stage unlocks when either signal holds:

* **plateau** — the rolling success rate stopped improving: the mean over the last ``window``
  observations minus the mean over the ``window`` before is below ``plateau_delta``;
* **unsolved** — the share of tasks seen in this stage (at least ``min_attempts`` times each) that were
  never solved with the current tools is at least ``unsolved_threshold``.

Hysteresis: the signal must hold on ``patience`` consecutive observations, and a stage lasts at least
``min_stay`` observations, so one noisy batch never unlocks a tool. ``preview_prob`` lets a share of
episodes see the next stage's tools early; it draws from a seeded generator whose state is saved, so
decisions are identical after a resume.

Mid-episode unlocks: ``unlocks`` lists rules in the environment's format (:mod:`toolgym.unlocks`,
e.g. ``{tool = "open", after = { failed_calls = { tool = "search", n = 3 } } }``), each optionally
bound to one stage (``stage = 1``). :meth:`ToolCurriculum.reset_options` returns what the trainer
passes to ``reset``: the stage's ``tools`` and the rules that apply to that stage as ``unlocks``. A
rule without ``stage`` applies in every stage whose tool set lacks the tool (so a tool can unlock
mid-episode in one stage and be there from the start in the next); a rule with ``stage`` applies in
that stage only. :meth:`ToolCurriculum.observe` counts the unlocks that fired (the episodes'
``tool/<name>/unlocked_turn`` metrics), shown as ``curriculum/unlocked/<name>``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from toolgym.core import Task, Trajectory
from toolgym.errors import ConfigError
from toolgym.training.config.sections import CurriculumConfig

__all__ = ["ToolCurriculum"]

log = logging.getLogger(__name__)


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
        self._unlocked: dict[str, int] = {}  # mid-episode unlocks that fired, per tool
        bound = [spec["stage"] for spec in config.unlocks if "stage" in spec]
        if bound and not config.stages:
            raise ConfigError(
                f"curriculum.unlocks: a rule is bound to stage {bound[0]}, but the curriculum has no "
                "stages; drop 'stage' (the rule then applies to every episode) or give stages"
            )

    # ------------------------------------------------------------------ queries
    @property
    def enabled(self) -> bool:
        return bool(self.config.stages)

    @property
    def final(self) -> bool:
        return not self.enabled or self.stage >= len(self.config.stages) - 1

    def tools_for(self, task: Task | str | None = None) -> set[str] | None:
        """Tools the next episode may use; ``None`` means no restriction (curriculum disabled)."""
        stage = self._draw_stage()
        return None if stage is None else set(self.config.stages[stage])

    def reset_options(self, task: Task | str | None = None) -> dict[str, Any]:
        """The next episode's ``reset`` options: the stage's ``tools`` and its mid-episode ``unlocks``.

        Draws the stage once, as :meth:`tools_for` does (same generator, same decisions after a resume).
        """
        stage = self._draw_stage()
        options: dict[str, Any] = {}
        if stage is not None:
            options["tools"] = sorted(self.config.stages[stage])
        rules = self.config.stage_rules(stage)
        if rules:
            options["unlocks"] = [rule.to_dict() for rule in rules]
        return options

    def _draw_stage(self) -> int | None:
        if not self.enabled:
            return None
        stage = self.stage
        if not self.final and self.config.preview_prob > 0 and self._rng.random() < self.config.preview_prob:
            stage += 1
        return stage

    @property
    def events(self) -> list[dict[str, Any]]:
        """Stage changes so far: ``{"observation", "from", "to", "signal", "tools"}``."""
        return [dict(e) for e in self._events]

    # ------------------------------------------------------------------ updates
    def observe(self, trajectories: Iterable[Trajectory]) -> bool:
        """Record one learner step's finished episodes; returns True when a stage was unlocked."""
        trajectories = [t for t in trajectories if t.status != "infra_error"]
        self._observations += 1
        for t in trajectories:
            for key in t.metrics:
                if key.startswith("tool/") and key.endswith("/unlocked_turn"):
                    tool = key[len("tool/") : -len("/unlocked_turn")]
                    self._unlocked[tool] = self._unlocked.get(tool, 0) + 1
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
        out = {
            "curriculum/stage": float(self.stage),
            "curriculum/success_rate": sum(recent) / len(recent) if recent else 0.0,
            "curriculum/unsolved_share": share if share is not None else 0.0,
            "curriculum/signal_streak": float(self._streak),
            "curriculum/unlocks": float(len(self._events)),
        }
        # Episodes (so far, all stages) in which a mid-episode rule unlocked the tool.
        out.update({f"curriculum/unlocked/{tool}": float(n) for tool, n in sorted(self._unlocked.items())})
        return out

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
            "unlock_rules": [dict(rule) for rule in self.config.unlocks],
            "unlocked": dict(self._unlocked),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        stage = int(state["stage"])
        if self.enabled and not 0 <= stage < len(self.config.stages):
            raise ConfigError(
                f"curriculum state has stage {stage}, but the config has {len(self.config.stages)} stages"
            )
        saved_rules = [dict(rule) for rule in state.get("unlock_rules", [])]
        if "unlock_rules" in state and _canonical(saved_rules) != _canonical(self.config.unlocks):
            raise ConfigError(
                f"curriculum state was saved with unlock rules {saved_rules}, but the config now has "
                f"{[dict(r) for r in self.config.unlocks]}: resume with the same curriculum.unlocks "
                "(episodes must be posed as before)"
            )
        self.stage = stage
        self._rng.bit_generator.state = state["rng"]
        self._history = [float(x) for x in state["history"]]
        self._attempts = {str(k): int(v) for k, v in state["attempts"].items()}
        self._solved = {str(k): int(v) for k, v in state["solved"].items()}
        self._streak = int(state["streak"])
        self._observations = int(state["observations"])
        self._events = [dict(e) for e in state["events"]]
        self._unlocked = {str(k): int(v) for k, v in state.get("unlocked", {}).items()}


def parse_stages(stages: Sequence[Sequence[str]]) -> tuple[tuple[str, ...], ...]:
    """Normalise stages from a config file (lists of names) to tuples."""
    return tuple(tuple(str(name) for name in stage) for stage in stages)


def _canonical(rules: Sequence[Mapping[str, Any]]) -> str:
    return json.dumps([dict(r) for r in rules], sort_keys=True)
