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
A compacting track (:mod:`toolgym.agents.compaction`) goes on in a new sequence (a segment) when the
current one nears the budget; kept turns are copied into it as their sampled ids.

NOTE (cut turns): a turn that ends at its token limit (``finish_reason == "length"``) is played as
sampled, and then nothing more is sampled: the episode stops with ``stop_reason = "turn_truncated"``
(``token_budget`` when the episode's budget cut it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import gymnasium
from gymnasium.wrappers import OrderEnforcing, PassiveEnvChecker

from toolgym.agents.compaction import SUMMARY_REQUEST, CompactionConfig, TurnRecord, plan_context
from toolgym.core import (
    AsyncToolEnv,
    Completion,
    Harness,
    Message,
    Policy,
    SamplingParams,
    Segment,
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
        harness: the track (``bare``, ``scaffold``, either with ``+compact`` / ``+summary``).
        seed, options: passed to ``reset`` (``options["tools"]`` restricts the tool set).
        sampling: per-turn sampling; ``max_tokens`` is further capped by the episode's token budget.
        max_total_tokens: the token sequence's budget; reaching it truncates the episode, unless the
            harness compacts (then it is each segment's budget).
        env_id: recorded in the trajectory (defaults to the env's spec id).

    An :class:`~toolgym.errors.InfraError` (from the environment or the policy) ends the episode with
    status ``infra_error`` and no reward; any other exception propagates (see the module docstring).
    """
    driver = _Driver(env)
    sampling = sampling or SamplingParams()
    env_id = env_id or (env.spec.id if env.spec is not None else type(driver.base).__name__)
    compaction: CompactionConfig | None = getattr(harness, "compaction", None)
    t_start = time.perf_counter()
    t_generate = t_env = 0.0
    seq = _Sequence()  # the current segment's tokens
    first: _Closed = ([], [], [])  # the first segment, once closed
    done: list[Segment] = []  # later segments, closed
    segment_turn = 1  # the first turn of the current segment
    history: list[Message] = []
    start: list[Message] = []
    turns: list[TurnRecord] = []  # every turn so far, for a compaction
    reward, error, stop_reason = 0.0, "", "max_turns"
    metrics: dict[str, float] = {}
    status: Literal["ok", "truncated", "infra_error"] = "truncated"
    versions: list[int] = []
    task_id: str = ""
    allowed: tuple[str, ...] = ()
    compactions, steps_since, largest = 0, 0, 0  # largest: the longest observation so far, in tokens
    context: list[Message] = []
    dropped = (0, 0)
    summary_text = ""
    # the summary request of a summarising compaction, rendered once per episode
    summarises = compaction is not None and compaction.mode == "summary"
    request = (
        policy.render([{"role": "user", "content": SUMMARY_REQUEST}], continuation=True) if summarises else []
    )

    async def sample(budget: int) -> Completion:
        nonlocal t_generate
        t0 = time.perf_counter()
        completion = await policy.generate(
            seq.ids, replace(sampling, max_tokens=min(sampling.max_tokens, budget))
        )
        t_generate += time.perf_counter() - t0
        versions.append(completion.policy_version)
        seq.append(completion.token_ids, 1, completion.logprobs)
        return completion

    try:
        t0 = time.perf_counter()
        obs, info = await driver.reset(seed, options)
        t_env += time.perf_counter() - t0
        task_id, allowed = info["task_id"], tuple(info["allowed_tools"])
        max_turns = driver.base.max_turns
        start = harness.start(obs, max_turns=max_turns)
        history.extend(start)
        seq.append(policy.render(start), 0)
        for turn in range(1, max_turns + 1):
            budget = max_total_tokens - len(seq.ids)
            if (
                compaction is not None
                and turns
                and budget < _reserve(compaction, sampling, len(request), largest)
            ):
                # Compact: close this segment, open the next one (see toolgym.agents.compaction).
                if steps_since == 0 or compactions >= compaction.max_compactions:
                    stop_reason = "compaction_loop" if steps_since == 0 else "compaction_limit"
                    break
                summary = None
                if compaction.mode == "summary" and budget - len(request) < sampling.max_tokens:
                    # no room left for a summary: this compaction drops instead
                    metrics["episode/summary_fallbacks"] = metrics.get("episode/summary_fallbacks", 0.0) + 1
                elif compaction.mode == "summary":
                    seq.append(request, 0)
                    completion = await sample(max_total_tokens - len(seq.ids))
                    if completion.finish_reason == "length":
                        stop_reason, metrics["env/turn_truncated"] = "turn_truncated", 1.0
                        break
                    summary = TurnRecord(turn, list(completion.token_ids), completion.text)
                plan = plan_context(
                    policy,
                    start,
                    turns,
                    compaction,
                    limit=int(compaction.target * max_total_tokens),
                    summary=summary,
                )
                if summary is None:
                    seq.trim()  # the last observation moves to the next segment: this one never showed it
                if compactions:
                    done.append(_segment(seq.close(), segment_turn, context, dropped, summary_text))
                else:
                    first = seq.close()
                compactions, steps_since = compactions + 1, 0
                seq = _Sequence()
                seq.append(plan.ids, 0)
                segment_turn, context = turn, plan.context
                dropped, summary_text = (
                    (plan.dropped_results, plan.dropped_turns),
                    summary.text if summary else "",
                )
                budget = max_total_tokens - len(seq.ids)
                if budget < sampling.max_tokens:
                    stop_reason = "compaction_loop"  # the compacted context leaves no room for a turn
                    break
            if budget <= 0:
                metrics["env/token_budget_exhausted"] = 1.0
                stop_reason = "token_budget"
                break
            completion = await sample(budget)
            history.append({"role": "assistant", "content": completion.text})
            t0 = time.perf_counter()
            obs, reward, terminated, truncated, info = await driver.step(completion.text)
            t_env += time.perf_counter() - t0
            steps_since += 1
            metrics.update(info.get("metrics", {}))
            cut = completion.finish_reason == "length"
            if cut:  # played as sampled (a cut call does not run); then nothing more is sampled
                by_budget = budget < sampling.max_tokens
                metrics["env/token_budget_exhausted" if by_budget else "env/turn_truncated"] = 1.0
            if terminated or truncated:
                status = "ok" if terminated else "truncated"
                stop_reason = "answer" if terminated else "max_turns"
                break
            new_messages = harness.after_step(obs, turn=turn, max_turns=max_turns)
            history.extend(new_messages)
            if cut:  # the answer to the cut turn is recorded (replays match), never shown: nothing follows
                stop_reason = "token_budget" if by_budget else "turn_truncated"
                break
            shown = policy.render(new_messages, continuation=True)
            seq.append(shown, 0)
            largest = max(largest, len(shown))
            turns.append(TurnRecord(turn, list(completion.token_ids), completion.text, new_messages))
    except InfraError as exc:
        status, error, reward, stop_reason = "infra_error", f"{type(exc).__name__}: {exc}", 0.0, "infra_error"
        metrics.update(getattr(exc, "episode_metrics", None) or {})
        metrics["env/infra_error"] = 1.0
        log.warning("episode %s of %s ended as infra_error: %s", task_id or "?", env_id, error)
    if compactions:
        done.append(_segment(seq.close(), segment_turn, context, dropped, summary_text))
    else:
        first = seq.close()
    if stop_reason not in ("answer", "max_turns", "infra_error"):  # the rollout ended it, not the env
        metrics = {**_env_metrics(driver.base), **metrics}
    if stop_reason.startswith("compaction"):
        metrics[f"env/{stop_reason}"] = 1.0
    sampled = sum(first[1]) + sum(sum(d.loss_mask) for d in done)
    total = len(first[0]) + sum(len(d.token_ids) for d in done)
    metrics.update({"tokens/sampled": float(sampled), "tokens/total": float(total)})
    if compaction is not None:
        metrics.update({"episode/segments": float(1 + len(done)), "episode/compactions": float(compactions)})
    return Trajectory(
        env_id=env_id,
        task_id=task_id,
        seed=seed,
        harness=harness.name,
        allowed_tools=allowed,
        messages=tuple(history),
        token_ids=tuple(first[0]),
        loss_mask=tuple(first[1]),
        logprobs=tuple(first[2]),
        reward=float(reward) if status == "ok" else 0.0,
        metrics=metrics,
        status=status,
        # nothing sampled (a failure before the first turn): the weights it would have sampled with
        policy_version=min(versions) if versions else int(getattr(policy, "policy_version", 0)),
        timings={"time/generate": t_generate, "time/env": t_env, "time/total": time.perf_counter() - t_start},
        token_hash=sampled_ids_hash(first[0], first[1]),
        error=error,
        stop_reason=stop_reason,
        segments=tuple(done),
    )


_Closed = tuple[list[int], list[int], list[float]]


class _Sequence:
    """One segment's growing token sequence: ids, loss mask (1 = sampled) and behaviour logprobs."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []

    def append(self, ids: Sequence[int], mask: int, lps: Sequence[float] | None = None) -> None:
        self.ids.extend(ids)
        self.mask.extend([mask] * len(ids))
        self.logprobs.extend(lps if lps is not None else [0.0] * len(ids))

    def trim(self) -> None:
        """Drop the context after the last sampled token."""
        keep = len(self.mask)
        while keep and not self.mask[keep - 1]:
            keep -= 1
        del self.ids[keep:], self.mask[keep:], self.logprobs[keep:]

    def close(self) -> _Closed:
        return self.ids, self.mask, self.logprobs


def _segment(
    closed: _Closed, start_turn: int, context: list[Message], dropped: tuple[int, int], summary: str
) -> Segment:
    ids, mask, lps = closed
    return Segment(
        token_ids=tuple(ids),
        loss_mask=tuple(mask),
        logprobs=tuple(lps),
        token_hash=sampled_ids_hash(ids, mask),
        start_turn=start_turn,
        context=tuple(context),
        dropped_results=dropped[0],
        dropped_turns=dropped[1],
        summary=summary,
    )


def _env_metrics(env: AsyncToolEnv) -> dict[str, float]:
    """The counters of an episode the rollout ended before the environment did (a toolgym env's).

    ``ToolEnv.episode_metrics`` is a property (a mapping); an environment may also offer a method.
    """
    read = getattr(env, "episode_metrics", None)
    if callable(read):
        read = read()
    return {str(k): float(v) for k, v in read.items()} if isinstance(read, Mapping) else {}


def _reserve(config: CompactionConfig, sampling: SamplingParams, request: int, largest: int) -> int:
    """Tokens a segment must have left before a turn, below which it is compacted first.

    ``drop``: room for the turn (its observation moves to the next segment). ``summary``: room for the
    turn, an observation as long as the longest so far, the request and the summary.
    """
    if config.mode == "drop":
        return sampling.max_tokens
    return 2 * sampling.max_tokens + request + largest


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
