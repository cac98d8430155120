"""The rollout loop: the only code that runs a policy against an environment.

Failures (the rule is in :mod:`toolgym.errors`): an :class:`~toolgym.errors.InfraError` raised by the
environment (after its own bounded retries) or by the policy (:class:`~toolgym.errors.PolicyError`:
its server or engine is gone) ends the episode as an ``infra_error`` trajectory: reward 0, never
scored or trained on, the error's type and message in ``error``, ``env/infra_error = 1`` and the
retries spent (``env/infra_retries``) in its metrics. Everything else (a verifier bug, a bug of ours,
a configuration error) propagates: a run must stop on a bug, not train around it.

NOTE (wrappers): gymnasium wrappers wrap only the sync ``reset``/``step``, never ``areset``/``astep``.
A bare environment (or one wrapped only by what ``gymnasium.make`` adds itself: ``OrderEnforcing``,
``PassiveEnvChecker``) is driven through its async API on the caller's event loop. An environment with
any other wrapper (observation or reward shaping, ``RecordEpisodeStatistics``, ``TimeLimit``...) is
driven through the outermost wrapper's ``reset``/``step`` in a worker thread, so every wrapper applies,
at the cost of one thread hop per call (the first such episode logs a warning saying so). The wrapper
stack must keep the contract: observations stay lists of chat messages and ``info`` keeps ``task_id``
and ``allowed_tools``.

NOTE (token fidelity): the loop keeps one growing token sequence per episode. The policy's sampled ids
are appended exactly as sampled (mask 1, with their behaviour logprobs); environment and harness text
is rendered and tokenised once, when it arrives, and appended with mask 0. Nothing is re-tokenised.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import gymnasium
from gymnasium.wrappers import OrderEnforcing, PassiveEnvChecker

from toolgym.core import (
    AsyncToolEnv,
    Harness,
    Message,
    Policy,
    SamplingParams,
    Trajectory,
    sampled_ids_hash,
)
from toolgym.errors import ConfigError, InfraError

__all__ = ["read_trajectories", "run_episode", "user_wrappers", "write_trajectories"]

log = logging.getLogger(__name__)

#: Wrappers ``gymnasium.make`` adds on its own; they change nothing an episode returns, so they never
#: force the (slower) sync path.
GYMNASIUM_DEFAULT_WRAPPERS: tuple[type[gymnasium.Wrapper[Any, Any, Any, Any]], ...] = (
    OrderEnforcing,
    PassiveEnvChecker,
)

_warned_sync_path = False

StepResult = tuple[list[Message], float, bool, bool, dict[str, Any]]


def user_wrappers(env: gymnasium.Env[Any, Any]) -> list[str]:
    """Class names of the wrappers around ``env`` other than gymnasium's defaults, outermost first."""
    names: list[str] = []
    layer: gymnasium.Env[Any, Any] = env
    while isinstance(layer, gymnasium.Wrapper):
        if not isinstance(layer, GYMNASIUM_DEFAULT_WRAPPERS):
            names.append(type(layer).__name__)
        layer = layer.env
    return names


class _Driver:
    """Calls reset/step on the right layer: the bare env's async API, or the wrapper stack's sync one."""

    def __init__(self, env: gymnasium.Env[Any, Any]) -> None:
        global _warned_sync_path
        base = env.unwrapped
        if not isinstance(base, AsyncToolEnv):
            raise ConfigError(
                f"run_episode needs a toolgym environment (areset/astep/max_turns), got "
                f"{type(base).__name__}; build it with toolgym.make or subclass toolgym.env.ToolEnv"
            )
        self.base: AsyncToolEnv = base
        self.env = env
        self.wrappers = user_wrappers(env)
        if self.wrappers and not _warned_sync_path:
            _warned_sync_path = True
            log.warning(
                "the environment is wrapped (%s): episodes run the wrappers' sync reset/step in a worker "
                "thread so that they apply; a bare toolgym environment runs on the event loop directly",
                ", ".join(self.wrappers),
            )

    async def reset(
        self, seed: int | None, options: dict[str, Any] | None
    ) -> tuple[list[Message], dict[str, Any]]:
        if not self.wrappers:
            return await self.base.areset(seed=seed, options=options)
        obs, info = await asyncio.to_thread(self.env.reset, seed=seed, options=options)
        return obs, info

    async def step(self, action: str) -> StepResult:
        if not self.wrappers:
            return await self.base.astep(action)
        obs, reward, terminated, truncated, info = await asyncio.to_thread(self.env.step, action)
        return obs, float(reward), bool(terminated), bool(truncated), info


async def run_episode(
    env: gymnasium.Env[Any, Any],
    policy: Policy,
    harness: Harness,
    *,
    seed: int | None = None,
    options: dict[str, Any] | None = None,
    sampling: SamplingParams | None = None,
    max_total_tokens: int = 4096,
    env_id: str | None = None,
) -> Trajectory:
    """Run one episode and return its :class:`~toolgym.core.Trajectory`.

    Args:
        env: a toolgym environment (an :class:`~toolgym.core.AsyncToolEnv` underneath), wrapped or
            not: user wrappers apply (see the module's NOTE on wrappers).
        policy: token-in/token-out policy with a chat template.
        harness: the track (``bare`` or ``scaffold``).
        seed, options: passed to ``reset`` (``options["tools"]`` restricts the tool set).
        sampling: per-turn sampling; ``max_tokens`` is further capped by the episode's token budget.
        max_total_tokens: the whole sequence's budget; reaching it truncates the episode.
        env_id: recorded in the trajectory (defaults to the env's spec id).

    An :class:`~toolgym.errors.InfraError` (from the environment or the policy) ends the episode with
    status ``infra_error`` and no reward; any other exception propagates (see the module docstring).
    """
    driver = _Driver(env)
    sampling = sampling or SamplingParams()
    env_id = env_id or (env.spec.id if env.spec is not None else type(driver.base).__name__)
    t_start = time.perf_counter()
    t_generate = t_env = 0.0
    token_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    history: list[Message] = []
    reward, error = 0.0, ""
    metrics: dict[str, float] = {}
    status: Literal["ok", "truncated", "infra_error"] = "truncated"
    versions: list[int] = []
    task_id: str = ""
    allowed: tuple[str, ...] = ()

    def append(ids: Sequence[int], mask: int, lps: Sequence[float] | None = None) -> None:
        token_ids.extend(ids)
        loss_mask.extend([mask] * len(ids))
        logprobs.extend(lps if lps is not None else [0.0] * len(ids))

    try:
        t0 = time.perf_counter()
        obs, info = await driver.reset(seed, options)
        t_env += time.perf_counter() - t0
        task_id, allowed = info["task_id"], tuple(info["allowed_tools"])
        max_turns = driver.base.max_turns
        messages = harness.start(obs, max_turns=max_turns)
        history.extend(messages)
        append(policy.render(messages), 0)
        for turn in range(1, max_turns + 1):
            budget = max_total_tokens - len(token_ids)
            if budget <= 0:
                metrics["env/token_budget_exhausted"] = 1.0
                break
            t0 = time.perf_counter()
            completion = await policy.generate(
                token_ids, replace(sampling, max_tokens=min(sampling.max_tokens, budget))
            )
            t_generate += time.perf_counter() - t0
            versions.append(completion.policy_version)
            append(completion.token_ids, 1, completion.logprobs)
            history.append({"role": "assistant", "content": completion.text})
            t0 = time.perf_counter()
            obs, reward, terminated, truncated, info = await driver.step(completion.text)
            t_env += time.perf_counter() - t0
            metrics.update(info.get("metrics", {}))
            if terminated or truncated:
                status = "ok" if terminated else "truncated"
                break
            new_messages = harness.after_step(obs, turn=turn, max_turns=max_turns)
            history.extend(new_messages)
            append(
                policy.render(
                    new_messages, continuation=True, close_turn=completion.finish_reason == "length"
                ),
                0,
            )
    except InfraError as exc:
        status, error, reward = "infra_error", f"{type(exc).__name__}: {exc}", 0.0
        metrics.update(getattr(exc, "episode_metrics", None) or {})
        metrics["env/infra_error"] = 1.0
        log.warning("episode %s of %s ended as infra_error: %s", task_id or "?", env_id, error)
    sampled = sum(loss_mask)
    metrics.update({"tokens/sampled": float(sampled), "tokens/total": float(len(token_ids))})
    return Trajectory(
        env_id=env_id,
        task_id=task_id,
        seed=seed,
        harness=harness.name,
        allowed_tools=allowed,
        messages=tuple(history),
        token_ids=tuple(token_ids),
        loss_mask=tuple(loss_mask),
        logprobs=tuple(logprobs),
        reward=float(reward) if status == "ok" else 0.0,
        metrics=metrics,
        status=status,
        # nothing sampled (a failure before the first turn): the weights it would have sampled with
        policy_version=min(versions) if versions else int(getattr(policy, "policy_version", 0)),
        timings={"time/generate": t_generate, "time/env": t_env, "time/total": time.perf_counter() - t_start},
        token_hash=sampled_ids_hash(token_ids, loss_mask),
        error=error,
    )


def write_trajectories(path: str | Path, trajectories: Iterable[Trajectory], *, append: bool = True) -> None:
    """Append trajectories to a JSONL file (one JSON object per line, flushed per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a" if append else "w", encoding="utf-8") as fh:
        for trajectory in trajectories:
            fh.write(trajectory.to_json() + "\n")
            fh.flush()


def read_trajectories(path: str | Path) -> list[Trajectory]:
    """Read a JSONL trajectory file; a malformed line is reported with its line number."""
    out = []
    with Path(path).open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                out.append(Trajectory.from_json(line))
            except (json.JSONDecodeError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}:{lineno}: not a trajectory record ({exc})") from exc
    return out
