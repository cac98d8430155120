"""Training on several environments at once: which environment each group comes from, and per-environment state.

A config with several ``[[env]]`` tables trains one policy on all of them. Each group (``G`` samples
of one task) stays within one environment, so group-relative advantages never compare rewards of
different scales (EM in {0, 1}, F1 in [0, 1], pass@1). :class:`MixtureSampler` picks the environment
of group ``g`` by weight, then a task of that environment:

* **Weights.** Environment ``e`` is drawn with probability ``w_e / sum(w)``. With ``mixture.adapt``
  the weight is the configured one times ``max(floor, 1 - z_e)``, where ``z_e`` is the share of that
  environment's last ``window`` groups whose rewards were all equal (no variance: no gradient), so
  sampling moves towards environments that still teach something, and never leaves one for good.
* **Normalisation.** With ``mixture.normalize = "std"`` each group's advantages are divided by the
  standard deviation of its environment's recent rewards (the last ``window`` groups), so one
  environment's reward scale does not dominate the step (useful with ``train.normalize_std =
  false``; GRPO's per-group std already rescales each group otherwise).

NOTE (determinism): the environment of group ``g`` is a draw from a generator seeded by ``(seed, g)``
against the weights of the moment; the weights change only when the learner observes a step, before
the rollout gate opens for the next one. With ``train.rollouts.max_off_policy_steps = 0`` the whole sequence is
therefore a function of the seed and the observed rewards, and a resumed run (whose checkpoint holds
the per-environment history) draws exactly the groups the uninterrupted run drew. Within an
environment the task is drawn uniformly (with replacement, seeded by ``(seed, g)``); a single
environment keeps :class:`~toolgym.training.sampling.workers.GroupSampler`'s epoch order.

:class:`RunEnvs` is what the trainer builds from the config, one environment or several: names,
harnesses, curricula, task ids and the fingerprint a resume is checked against.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from toolgym.agents.harness import get_harness
from toolgym.core import Harness, TaskToolEnv, Trajectory
from toolgym.errors import ConfigError
from toolgym.records.manifest import env_fingerprint
from toolgym.training.config.run import RunConfig
from toolgym.training.config.sections import MixtureConfig
from toolgym.training.sampling.curriculum import ToolCurriculum
from toolgym.training.sampling.workers import GroupSampler, make_env

__all__ = [
    "MixtureSampler",
    "RunEnvs",
    "env_metrics",
    "mixture_metrics",
    "observe_curricula",
    "probe_env",
]

_NORMALIZE = ("none", "std")


class MixtureSampler:
    """Maps a group index to its environment, task and episode seeds (see the module docstring).

    ``task_ids[e]`` are environment ``e``'s training tasks and ``weights[e]`` its configured weight.
    With one environment it is :class:`~toolgym.training.sampling.workers.GroupSampler` exactly.
    """

    def __init__(
        self,
        task_ids: Sequence[Sequence[str]],
        weights: Sequence[float],
        *,
        group_size: int,
        seed: int,
        config: MixtureConfig | None = None,
    ) -> None:
        self.config = config or MixtureConfig()
        self.samplers = [GroupSampler(ids, group_size=group_size, seed=seed) for ids in task_ids]
        if len(weights) != len(self.samplers):
            raise ConfigError(f"{len(weights)} weights for {len(self.samplers)} environments")
        self.base = [float(w) for w in weights]
        self.group_size, self.seed = group_size, seed
        window = self.config.window
        self._flat: list[deque[bool]] = [deque(maxlen=window) for _ in self.samplers]
        self._rewards: list[deque[float]] = [deque(maxlen=window * group_size) for _ in self.samplers]

    # ------------------------------------------------------------------ draws
    def weights(self) -> list[float]:
        """The current sampling probabilities (they sum to 1)."""
        raw = list(self.base)
        if self.config.adapt:
            for e, flat in enumerate(self._flat):
                if flat:
                    raw[e] *= max(self.config.floor, 1.0 - sum(flat) / len(flat))
        total = sum(raw)
        return [w / total for w in raw]

    def env(self, index: int) -> int:
        if len(self.samplers) == 1:
            return 0
        u = float(np.random.default_rng([self.seed, index, 1]).random())
        edges = np.cumsum(self.weights())
        return min(int(np.searchsorted(edges, u, side="right")), len(edges) - 1)

    def route(self, index: int) -> tuple[int, str]:
        """Group ``index``'s environment (position in ``[[env]]``) and task id."""
        if len(self.samplers) == 1:
            return 0, self.samplers[0].task(index)
        e = self.env(index)
        ids = self.samplers[e].task_ids
        return e, ids[int(np.random.default_rng([self.seed, index, 2]).integers(len(ids)))]

    def task(self, index: int) -> str:
        return self.route(index)[1]

    def episode_seed(self, index: int, sample: int) -> int:
        return self.samplers[0].episode_seed(index, sample)

    # ------------------------------------------------------------------ signals
    def observe(self, envs: Sequence[int], groups: Sequence[Sequence[Trajectory]]) -> None:
        """Record a learner step's groups (``envs[i]`` is group ``i``'s environment)."""
        for e, group in zip(envs, groups, strict=True):
            rewards = [t.reward for t in group if t.status != "infra_error"]
            if not rewards:
                continue
            self._flat[e].append(max(rewards) - min(rewards) == 0.0)
            self._rewards[e].extend(rewards)

    def scale(self, env: int) -> float:
        """The factor a group's advantages get from ``normalize`` (1.0 for ``none`` or too few rewards)."""
        rewards = self._rewards[env]
        if self.config.normalize != "std" or len(rewards) < 2:
            return 1.0
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        return 1.0 / std if std > 1e-6 else 1.0

    def metrics(self, names: Sequence[str]) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, weight, flat in zip(names, self.weights(), self._flat, strict=True):
            out[f"mixture/{name}/weight"] = weight
            out[f"mixture/{name}/zero_variance_share"] = sum(flat) / len(flat) if flat else 0.0
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"flat": [list(d) for d in self._flat], "rewards": [list(d) for d in self._rewards]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if len(state["flat"]) != len(self._flat):
            raise ConfigError(
                f"the checkpoint's mixture has {len(state['flat'])} environments, the config {len(self._flat)}"
            )
        for d, values in zip(self._flat, state["flat"], strict=True):
            d.clear()
            d.extend(bool(v) for v in values)
        for r, values in zip(self._rewards, state["rewards"], strict=True):
            r.clear()
            r.extend(float(v) for v in values)


def env_metrics(
    names: Sequence[str], envs: Sequence[int], groups: Sequence[Sequence[Trajectory]], success: float
) -> dict[str, float]:
    """Per-environment rows of a step: ``env/<name>/{groups,reward_mean,success_rate,turns_mean}``."""
    out: dict[str, float] = {}
    for e, name in enumerate(names):
        trajs = [t for env, g in zip(envs, groups, strict=True) if env == e for t in g]
        ok = [t for t in trajs if t.status != "infra_error"]
        out[f"env/{name}/groups"] = float(sum(1 for env in envs if env == e))
        if ok:
            out[f"env/{name}/reward_mean"] = sum(t.reward for t in ok) / len(ok)
            out[f"env/{name}/success_rate"] = sum(t.reward >= success for t in ok) / len(ok)
            out[f"env/{name}/turns_mean"] = sum(t.metrics.get("env/turns", 0.0) for t in ok) / len(ok)
    return out


def observe_curricula(
    curricula: Sequence[ToolCurriculum], names: Sequence[str] | None, groups: Sequence[Any]
) -> list[dict[str, Any]]:
    """Each environment's curriculum sees its own episodes of a step (``groups``, each with ``env``);
    returns the step's unlock events, each naming its environment when ``names`` are given."""
    events = []
    for e, curriculum in enumerate(curricula):
        if curriculum.observe([t for g in groups if g.env == e for t in g.trajectories]):
            event = curriculum.events[-1]
            events.append({**event, "env": names[e]} if names is not None else event)
    return events


def mixture_metrics(
    names: Sequence[str],
    curricula: Sequence[ToolCurriculum],
    sampler: MixtureSampler,
    success_threshold: float,
    groups: Sequence[Any],
) -> dict[str, float]:
    """A mixture's per-environment metrics of a step: rewards (:func:`env_metrics`, an episode counting
    as a success at ``success_threshold``), each curriculum's metrics under ``curriculum/<name>/`` and
    the sampler's weights under ``mixture/<name>/``."""
    envs, trajectories = [g.env for g in groups], [g.trajectories for g in groups]
    out = env_metrics(names, envs, trajectories, success_threshold)
    for name, curriculum in zip(names, curricula, strict=True):
        out.update(
            {k.replace("curriculum/", f"curriculum/{name}/"): v for k, v in curriculum.metrics().items()}
        )
    return out | sampler.metrics(names)


def probe_env(
    env_id: str, kwargs: Mapping[str, Any], task_ids: Sequence[str], task_limit: int
) -> tuple[list[str], dict]:
    """An environment's training task ids (explicit ``task_ids``, else the first ``task_limit``, else
    all) and its fingerprint, from one probe instance; an environment that lists no tasks is refused."""

    probe = make_env(env_id, dict(kwargs))
    try:
        base = probe.unwrapped
        if not isinstance(base, TaskToolEnv):
            raise ConfigError(
                f"{env_id} is not a toolgym environment that lists its tasks (TaskToolEnv: "
                f"areset, astep, max_turns, task_ids); got {type(base).__name__}"
            )
        all_ids = list(base.task_ids())
        fingerprint = env_fingerprint(probe, env_id, dict(kwargs))
    finally:
        probe.close()
    return list(task_ids) or (all_ids[:task_limit] if task_limit else all_ids), fingerprint


@dataclass(frozen=True)
class RunEnvs:
    """A run's environments as its trainer samples them: for each (the ``[[env]]`` tables, or the one
    ``[env]``) its name, harness, tool curriculum and training task ids; and the run's task ids (a
    mixture's each prefixed with its environment's name) and environment fingerprint (a mixture's holds
    every environment's, by name, and their weights)."""

    names: list[str]
    harnesses: list[Harness]
    curricula: list[ToolCurriculum]
    by_env: list[list[str]]
    task_ids: list[str]
    fingerprint: dict[str, Any]

    @classmethod
    def of(cls, config: RunConfig) -> RunEnvs:
        """Probe each environment of ``config`` once (see :func:`probe_env`)."""
        names = [env.name for env in config.envs]
        harnesses = [get_harness(env.harness) for env in config.envs]
        curricula = [
            ToolCurriculum(
                dataclasses.replace(config.curriculum, stages=env.stages or config.curriculum.stages)
            )
            for env in config.envs
        ]
        probes = [probe_env(e.id, e.kwargs, e.task_ids, e.task_limit) for e in config.envs]
        by_env = [ids for ids, _ in probes]
        if not config.is_mixture:
            task_ids, fingerprint = by_env[0], probes[0][1]
        else:
            task_ids = [f"{n}:{t}" for n, ids in zip(names, by_env, strict=True) for t in ids]
            fingerprint = {
                "id": "mixture",
                "envs": {n: fp for n, (_, fp) in zip(names, probes, strict=True)},  # dotted diffs
                "weights": {e.name: e.weight for e in config.envs},
            }
        return cls(names, harnesses, curricula, by_env, task_ids, fingerprint)
