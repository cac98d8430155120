"""The rollout loop: the only code that runs a policy against an environment.

An episode (:func:`run_episode`):

1. reset the environment; the harness rewrites the opening, which starts the first token segment;
2. before each turn, a compacting track whose segment is nearly full goes on in a new segment
   (:class:`~toolgym.agents.compaction.Compactor`);
3. the policy samples a turn, appended as sampled (mask 1, with its behaviour logprobs);
4. the environment steps on the turn's text; the harness rewrites the observation, which is rendered
   once and appended (mask 0);
5. until the answer, the turn limit, the token budget, a cut turn or an infrastructure failure; the
   conversation and the segments are the :class:`~toolgym.core.Trajectory`.

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

NOTE (token fidelity): nothing is re-tokenised. Each segment is one growing token sequence; sampled
ids go in exactly as sampled, environment and harness text is rendered and tokenised once, when it
arrives. A compaction's new segment copies the kept turns as their sampled ids (mask 0 there).

NOTE (chat formats): the policy's ``chat_format`` (:mod:`toolgym.agents.chat.formats`) decides three
things here. Its ``call_format``, when not the default ``hermes``, goes to the environment as the reset
option ``call_format`` (the environment then lists its tools and parses actions in that syntax). Its
reasoning (``<think>...</think>``, harmony's analysis channel) is sampled and trained like any text
but left out of the action the environment steps on, counted in ``tokens/thinking``, and, with a
``thinking_budget``, capped per turn: the turn is sampled up to the budget, stopping at the block's
end; a block still open then is closed by the rollout (those tokens are mask 0) and the turn goes on.
A ``template`` format (the model's own Jinja template) is checked after every turn: when the template
would render the segment's history differently from its tokens (it rewrites history, e.g. drops
earlier ``<think>`` blocks), a new segment opens there with the template's rendering
(``episode/rewrites``), or the episode stops with a ConfigError naming the rewrite (``on_rewrite =
"refuse"``). Nothing sampled is re-tokenised either way.

NOTE (cut turns): a turn that ends at its token limit (``finish_reason == "length"``) is played as
sampled, and then nothing more is sampled: the episode stops with ``stop_reason = "turn_truncated"``
(``token_budget`` when the episode's budget cut it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import gymnasium
from gymnasium.wrappers import OrderEnforcing, PassiveEnvChecker

from toolgym.agents.chat.formats import ChatFormat, Reasoning
from toolgym.agents.compaction import Compactor, ContextPlan, TurnRecord
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
from toolgym.parsing import HERMES
from toolgym.run_files import open_append, open_write

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
        self.seconds = 0.0  # spent in reset/step
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
        t0 = time.perf_counter()
        try:
            if not self.wrappers:
                return await self.base.areset(seed=seed, options=options)
            obs, info = await asyncio.to_thread(self.env.reset, seed=seed, options=options)
            return obs, info
        finally:
            self.seconds += time.perf_counter() - t0

    async def step(self, action: str) -> StepResult:
        t0 = time.perf_counter()
        try:
            if not self.wrappers:
                return await self.base.astep(action)
            obs, reward, terminated, truncated, info = await asyncio.to_thread(self.env.step, action)
            return obs, float(reward), bool(terminated), bool(truncated), info
        finally:
            self.seconds += time.perf_counter() - t0

    def episode_metrics(self) -> dict[str, float]:
        """The counters of an episode the rollout ended before the environment did."""
        return {str(k): float(v) for k, v in self.base.episode_metrics.items()}


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
    episode = _Episode(env, policy, harness, sampling or SamplingParams(), max_total_tokens, env_id)
    try:
        await episode.play(seed, options)
    except InfraError as exc:
        episode.fail(exc)
    return episode.trajectory(seed)


class _Episode:
    """One episode's state as :func:`run_episode` plays it: :meth:`play` (reset, then a turn at a time
    until something ends it), :meth:`fail` (an infrastructure failure), :meth:`trajectory` (the
    record)."""

    def __init__(
        self,
        env: gymnasium.Env[Any, Any],
        policy: Policy,
        harness: Harness,
        sampling: SamplingParams,
        max_total_tokens: int,
        env_id: str | None,
    ) -> None:
        self.t_start = time.perf_counter()
        self.driver = _Driver(env)
        self.env_id = env_id or (env.spec.id if env.spec is not None else type(self.driver.base).__name__)
        self.policy, self.sampling = policy, sampling
        # a policy without a chat format (a user's own) speaks hermes
        self.fmt: ChatFormat | None = getattr(policy, "chat_format", None)
        self.calls = self.fmt.call_format if self.fmt is not None else HERMES.name
        if self.calls != HERMES.name:  # the scaffold's hints show the model's call syntax
            to_format = getattr(harness, "for_call_format", None)  # a user's harness may not offer it
            harness = harness if to_format is None else to_format(self.calls)
        self.harness = harness
        self.tape = _Tape(policy, sampling, max_total_tokens, self.fmt)
        self.compactor = Compactor(harness.compaction, policy, sampling, max_total_tokens)
        self.history: list[Message] = []
        self.metrics: dict[str, float] = {}
        self.task_id, self.allowed = "", ()
        self.reward, self.error, self.stop_reason = 0.0, "", "max_turns"
        self.status: Literal["ok", "truncated", "infra_error"] = "truncated"

    async def play(self, seed: int | None, options: dict[str, Any] | None) -> None:
        if self.calls != HERMES.name:  # the environment lists its tools and parses actions in that syntax
            options = {"call_format": self.calls, **(options or {})}
        obs, info = await self.driver.reset(seed, options)
        self.task_id, self.allowed = info["task_id"], tuple(info["allowed_tools"])
        max_turns = self.driver.base.max_turns
        start = self.harness.start(obs, max_turns=max_turns)
        self.history.extend(start)
        self.compactor.begin(start)
        self.tape.append(self.policy.render(start), 0)
        self.tape.segments[-1].messages = list(start)
        for turn in range(1, max_turns + 1):
            if await self._turn(turn, max_turns):
                return

    async def _turn(self, turn: int, max_turns: int) -> bool:
        """Sample a turn, step on it and show the answer; True when the episode ends here."""
        tape, metrics = self.tape, self.metrics
        if self.compactor.due(tape.left):
            compaction = await self.compactor.compact(tape, turn)
            metrics.update(compaction.metrics)
            if compaction.stop_reason:
                self.stop_reason = compaction.stop_reason
                return True
        budget = tape.left
        if budget <= 0:
            metrics["env/token_budget_exhausted"] = 1.0
            if turn == 1:  # the prompt alone filled the budget: the model never acted (see evaluate)
                metrics["env/no_first_action"] = 1.0
                metrics["env/prompt_tokens"] = float(tape.max_total_tokens - budget)
            self.stop_reason = "token_budget"
            return True
        completion = await tape.sample(budget)
        self.history.append({"role": "assistant", "content": completion.text})
        obs, self.reward, terminated, truncated, info = await self.driver.step(self._action(completion))
        self.compactor.stepped()
        metrics.update(info.get("metrics", {}))
        cut = completion.finish_reason == "length"
        by_budget = budget < self.sampling.max_tokens
        if cut:  # played as sampled (a cut call does not run); then nothing more is sampled
            metrics["env/token_budget_exhausted" if by_budget else "env/turn_truncated"] = 1.0
        if terminated or truncated:
            self.status = "ok" if terminated else "truncated"
            self.stop_reason = "answer" if terminated else "max_turns"
            return True
        new_messages = self.harness.after_step(obs, turn=turn, max_turns=max_turns)
        self.history.extend(new_messages)
        if cut:  # the answer to the cut turn is recorded (replays match), never shown: nothing follows
            self.stop_reason = "token_budget" if by_budget else "turn_truncated"
            return True
        self._show(turn, completion, new_messages)
        return False

    def _action(self, completion: Completion) -> str:
        """What the environment steps on: the turn's text less its reasoning (trained, never parsed)."""
        fmt = self.fmt
        if fmt is None or fmt.reasoning is None:
            return completion.text
        self.tape.thinking += fmt.thinking_tokens(completion.token_ids, completion.text)
        return fmt.split_reasoning(completion.text)[1]

    def _show(self, turn: int, completion: Completion, new_messages: list[Message]) -> None:
        """Append the environment's answer (mask 0) and check that the template renders it as appended."""
        shown = self.policy.render(new_messages, continuation=True)
        self.tape.append(shown, 0)
        record = TurnRecord(turn, list(completion.token_ids), completion.text, new_messages)
        self.compactor.shown(record, len(shown))
        self.tape.segments[-1].messages += [self.history[-1 - len(new_messages)], *new_messages]
        fmt = self.fmt
        if fmt is not None and fmt.checks_history:
            rewrites = self.metrics.get("episode/rewrites", 0.0) + self.tape.check_rewrite(fmt, turn)
            self.metrics["episode/rewrites"] = rewrites

    def fail(self, exc: InfraError) -> None:
        self.status, self.reward, self.stop_reason = "infra_error", 0.0, "infra_error"
        self.error = f"{type(exc).__name__}: {exc}"
        self.metrics.update(exc.episode_metrics)
        self.metrics["env/infra_error"] = 1.0
        log.warning("episode %s of %s ended as infra_error: %s", self.task_id or "?", self.env_id, self.error)

    def trajectory(self, seed: int | None) -> Trajectory:
        tape, metrics, fmt = self.tape, self.metrics, self.fmt
        segments = tape.close()
        if self.stop_reason not in ("answer", "max_turns", "infra_error"):  # the rollout ended it
            metrics = {**self.driver.episode_metrics(), **metrics}
        if self.stop_reason.startswith("compaction"):
            metrics[f"env/{self.stop_reason}"] = 1.0
        sampled, total = sum(sum(s.loss_mask) for s in segments), sum(len(s.token_ids) for s in segments)
        metrics.update({"tokens/sampled": float(sampled), "tokens/total": float(total)})
        if fmt is not None and fmt.reasoning is not None:
            metrics["tokens/thinking"] = float(tape.thinking)
            if fmt.thinking_budget:
                metrics["episode/thinking_cut"] = float(tape.thinking_cut)
        metrics.update(self.compactor.episode_metrics(len(segments)))
        return Trajectory.from_segments(
            segments,
            env_id=self.env_id,
            task_id=self.task_id,
            seed=seed,
            harness=self.harness.name,
            allowed_tools=self.allowed,
            messages=tuple(self.history),
            reward=float(self.reward) if self.status == "ok" else 0.0,
            metrics=metrics,
            status=self.status,
            # nothing sampled (a failure before the first turn): the weights it would have sampled with
            policy_version=min(tape.versions) if tape.versions else int(self.policy.policy_version),
            timings={
                "time/generate": tape.seconds,
                "time/env": self.driver.seconds,
                "time/total": time.perf_counter() - self.t_start,
            },
            error=self.error,
            stop_reason=self.stop_reason,
        )


@dataclass
class _Sequence:
    """One segment's growing token sequence (ids, loss mask: 1 = sampled, behaviour logprobs) and what
    it opened with (see :class:`~toolgym.core.Segment`)."""

    start_turn: int = 1
    context: list[Message] = field(default_factory=list)
    dropped_results: int = 0
    dropped_turns: int = 0
    summary: str = ""
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)  # what the ids render (not recorded)

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

    def close(self) -> Segment:
        return Segment(
            token_ids=tuple(self.ids),
            loss_mask=tuple(self.mask),
            logprobs=tuple(self.logprobs),
            token_hash=sampled_ids_hash(self.ids, self.mask),
            start_turn=self.start_turn,
            context=tuple(self.context),
            dropped_results=self.dropped_results,
            dropped_turns=self.dropped_turns,
            summary=self.summary,
        )


class _Tape:
    """The episode's token segments, in order; the last one is open: it grows, and the policy samples
    on it within the per-segment budget. A :class:`~toolgym.agents.compaction.TokenTape`."""

    def __init__(
        self, policy: Policy, sampling: SamplingParams, max_total_tokens: int, fmt: ChatFormat | None = None
    ) -> None:
        self.policy, self.sampling, self.max_total_tokens = policy, sampling, max_total_tokens
        self.fmt = fmt
        self.segments = [_Sequence()]
        self.versions: list[int] = []  # each completion's policy version
        self.seconds = 0.0  # spent sampling
        self.thinking = 0  # reasoning tokens sampled
        self.thinking_cut = 0  # reasoning blocks the thinking budget closed

    @property
    def left(self) -> int:
        return self.max_total_tokens - len(self.segments[-1].ids)

    def append(self, ids: Sequence[int], mask: int, lps: Sequence[float] | None = None) -> None:
        self.segments[-1].append(ids, mask, lps)

    def trim(self) -> None:
        self.segments[-1].trim()

    async def sample(self, budget: int) -> Completion:
        """The policy's next turn (at most ``budget`` tokens), appended as sampled."""
        t0 = time.perf_counter()
        limit = replace(self.sampling, max_tokens=min(self.sampling.max_tokens, budget))
        fmt = self.fmt
        if fmt is not None and fmt.reasoning is not None and fmt.thinking_budget:
            completion = await self._sample_thinking(limit, fmt, fmt.reasoning, fmt.thinking_budget)
        else:
            completion = await self._generate(limit)
        self.seconds += time.perf_counter() - t0
        return completion

    async def _generate(self, limit: SamplingParams) -> Completion:
        completion = await self.policy.generate(self.segments[-1].ids, limit)
        self.versions.append(completion.policy_version)
        self.append(completion.token_ids, 1, completion.logprobs)
        return completion

    async def _sample_thinking(
        self, limit: SamplingParams, fmt: ChatFormat, reasoning: Reasoning, budget: int
    ) -> Completion:
        """A turn whose reasoning is capped at ``budget`` tokens (see the module's NOTE on chat formats)."""
        first = await self._generate(
            replace(limit, max_tokens=min(limit.max_tokens, budget), stop=(*limit.stop, reasoning.close))
        )
        if first.finish_reason == "stop" and not first.text.endswith(reasoning.close):
            return first  # the turn ended within the budget
        thought, action = fmt.split_reasoning(first.text)
        forced, injected = "", []
        if first.finish_reason == "length" and thought and not action:  # cut inside its reasoning
            if fmt.tokenizer is None:
                raise ConfigError(
                    f"chat format {fmt.name!r} has no tokenizer to close a reasoning block with"
                )
            forced, injected = reasoning.forced_close, list(fmt.tokenizer.encode(reasoning.forced_close))
            self.append(injected, 0)  # NOTE (masks): the rollout's tokens, not the policy's: mask 0
            self.thinking_cut += 1
        left = limit.max_tokens - len(first.token_ids) - len(injected)
        rest = await self._generate(replace(limit, max_tokens=left)) if left > 0 else None
        return Completion(
            token_ids=(*first.token_ids, *injected, *(rest.token_ids if rest else ())),
            logprobs=(*first.logprobs, *(0.0 for _ in injected), *(rest.logprobs if rest else ())),
            text=first.text + forced + (rest.text if rest else ""),
            finish_reason=rest.finish_reason if rest else "length",
            policy_version=min(first.policy_version, rest.policy_version if rest else first.policy_version),
        )

    def check_rewrite(self, fmt: ChatFormat, turn: int) -> float:
        """1.0 when a history-rewriting template made the open segment close here (and the next open with
        the template's rendering of its messages), else 0.0; a ``refuse`` format raises instead."""
        sequence = self.segments[-1]
        problem = fmt.rewrite(sequence.messages, sequence.ids)
        if problem is None:
            return 0.0
        if getattr(fmt, "on_rewrite", "segment") == "refuse":
            raise ConfigError(
                f"the chat template rewrites the history of turn {turn}: {problem}. toolgym appends turns "
                "and never re-tokenises them; use one of toolgym's own chat formats, or on_rewrite = 'segment'"
            )
        log.debug("turn %d: the chat template rewrites history (%s); a new segment opens", turn, problem)
        messages = list(sequence.messages)
        self.trim()
        self.open(ContextPlan(self.policy.render(messages), messages, 0, 0), start_turn=turn + 1, summary="")
        return 1.0

    def open(self, plan: ContextPlan, *, start_turn: int, summary: str) -> None:
        """Close the open segment; the next one opens with ``plan``'s opening (mask 0)."""
        opened = _Sequence(start_turn, plan.context, plan.dropped_results, plan.dropped_turns, summary)
        opened.messages = list(plan.context)
        opened.append(plan.ids, 0)
        self.segments.append(opened)

    def close(self) -> list[Segment]:
        return [s.close() for s in self.segments]


def write_trajectories(path: str | Path, trajectories: Iterable[Trajectory], *, append: bool = True) -> None:
    """Append trajectories to a JSONL file (one JSON object per line, flushed per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_append(path) if append else open_write(path) as fh:  # never through a planted link
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
