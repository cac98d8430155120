"""What each tool call of an episode was worth: counterfactual replays of stored episodes.

For one stored episode, each tool call (a turn whose observation holds a tool's result) is scored by
two replays that share everything up to that call: the episode's own turns are forced, token for
token, up to and including the call, and the environment answers them as it did. Then the policy goes
on greedily, once with the call's result as the environment returned it (``reward_with``) and once with
the result replaced by :data:`EMPTY_RESULT` (``reward_without``). The call's **credit** is
``reward_with - reward_without``: what that result was worth to the rest of the episode, for this
policy. The two replays differ in nothing but the result, so a credit of 0 means the policy would have
ended the same (or as well) without it.

A replay is checked, not trusted: its tokens up to the call's result (the prompt, the forced turns, the
observations) must be the stored episode's. An environment whose answers changed or are not
deterministic, or a policy that renders its chat differently from the one that sampled the episode,
fails that check, and the episode is reported as not replayable with the position where the tokens
part, never scored.

Costs: two greedy continuations per call, each as long as the rest of the episode; ``max_calls``
bounds a pass. The answer tool ends an episode and is not a call; a call the environment refused (a
malformed call, an unknown tool: its observation is the ``error`` tool's) is not scored either.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import gymnasium

from toolgym.agents.eval.runs import EvalRun
from toolgym.agents.harness import Harness, get_harness
from toolgym.agents.rollout import run_episode
from toolgym.core import Completion, Message, Policy, SamplingParams, Trajectory
from toolgym.errors import ConfigError
from toolgym.run_files import write_atomic
from toolgym.tool_use import ToolUse

__all__ = [
    "CREDIT_FILE",
    "EMPTY_RESULT",
    "CallCredit",
    "CreditReport",
    "ForcedTurns",
    "NotReplayable",
    "ReplacedResult",
    "credit_episode",
    "credit_episodes",
    "credit_run",
    "count_calls",
    "episode_calls",
    "forced_turns",
]

#: what a removed result is replaced with (the tool message stays, with no content)
EMPTY_RESULT = ""
#: the JSON file ``toolgym credit --out DIR`` writes
CREDIT_FILE = "credit.json"
#: the observation of a call the environment refused (malformed, unknown tool): not a result
ERROR_TOOL = "error"


class ForcedTurns:
    """A policy whose first turns are given: the stored completions, returned as they were sampled;
    every later turn is ``policy``'s. Everything else (rendering, chat format, version) is ``policy``'s."""

    def __init__(self, policy: Policy, turns: Sequence[Completion]) -> None:
        self._policy = policy
        self._turns = list(turns)
        self._next = 0
        self.name: str = policy.name
        self.policy_version: int = policy.policy_version

    def __getattr__(self, name: str) -> Any:  # chat_format, tokenizer, ... : the policy's
        return getattr(self._policy, name)

    def render(
        self, messages: Sequence[Message], *, continuation: bool = False, close_turn: bool = False
    ) -> list[int]:
        return self._policy.render(messages, continuation=continuation, close_turn=close_turn)

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        if self._next < len(self._turns):
            self._next += 1
            return self._turns[self._next - 1]
        return await self._policy.generate(token_ids, sampling)


class ReplacedResult:
    """``inner``, except that the tool results of turn ``turn`` read ``text`` before ``inner`` sees them."""

    def __init__(self, inner: Harness, turn: int, text: str = EMPTY_RESULT) -> None:
        self.inner, self.turn, self.text = inner, turn, text
        self.name: str = inner.name
        self.compaction: Any = inner.compaction

    def start(self, messages: Sequence[Message], *, max_turns: int) -> list[Message]:
        return self.inner.start(messages, max_turns=max_turns)

    def after_step(self, messages: Sequence[Message], *, turn: int, max_turns: int) -> list[Message]:
        if turn == self.turn:
            messages = [{**m, "content": self.text} if m.get("role") == "tool" else m for m in messages]
        return self.inner.after_step(messages, turn=turn, max_turns=max_turns)

    def for_call_format(self, call_format: str) -> ReplacedResult:
        to_format = getattr(self.inner, "for_call_format", None)
        return self if to_format is None else ReplacedResult(to_format(call_format), self.turn, self.text)


@dataclass(frozen=True)
class CallCredit:
    """One tool call's credit (module docstring): its episode, turn, tool, whether its result showed an
    answer (None: the environment does not measure it), and the two replays' rewards."""

    task_id: str
    seed: int | None
    harness: str
    turn: int
    tool: str
    answer_shown: float | None
    reward_with: float
    reward_without: float

    @property
    def credit(self) -> float:
        return self.reward_with - self.reward_without


@dataclass
class CreditReport:
    """A credit pass over an evaluation: every scored call, and what could not be scored, with why."""

    source: str
    env_id: str
    policy: str
    calls: list[CallCredit] = field(default_factory=list)
    #: episodes that were not replayable (task id and seed, the reason), never scored
    not_replayable: list[dict[str, Any]] = field(default_factory=list)
    #: calls whose replay ended in an infrastructure failure
    infra_errors: int = 0
    episodes: int = 0
    #: calls not scored because the ``max_calls`` budget ran out
    left_out: int = 0

    def summary(self) -> dict[str, Any]:
        """The credit's distribution: over all calls, by tool, by turn and by whether the result showed an
        answer (mean, median, the share of calls above 0 and below 0, n)."""
        by_tool: dict[str, list[float]] = {}
        by_turn: dict[str, list[float]] = {}
        by_shown: dict[str, list[float]] = {}
        for call in self.calls:
            by_tool.setdefault(call.tool, []).append(call.credit)
            by_turn.setdefault(str(call.turn), []).append(call.credit)
            if call.answer_shown is not None:
                key = "answer shown" if call.answer_shown > 0 else "answer not shown"
                by_shown.setdefault(key, []).append(call.credit)
        return {
            "all": _stats([c.credit for c in self.calls]),
            "by_tool": {k: _stats(v) for k, v in sorted(by_tool.items())},
            "by_turn": {k: _stats(v) for k, v in sorted(by_turn.items(), key=lambda kv: int(kv[0]))},
            "by_answer_shown": {k: _stats(v) for k, v in sorted(by_shown.items())},
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "env_id": self.env_id,
            "policy": self.policy,
            "replacement": EMPTY_RESULT,
            "episodes": self.episodes,
            "summary": self.summary(),
            "calls": [{**asdict(c), "credit": c.credit} for c in self.calls],
            "not_replayable": self.not_replayable,
            "infra_errors": self.infra_errors,
            "left_out": self.left_out,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CreditReport:
        """A report read back from its JSON form (:meth:`to_json`; ``credit.json``)."""
        fields = CallCredit.__dataclass_fields__
        return cls(
            data["source"],
            data["env_id"],
            data["policy"],
            [CallCredit(**{k: v for k, v in c.items() if k in fields}) for c in data["calls"]],
            list(data.get("not_replayable", [])),
            int(data.get("infra_errors", 0)),
            int(data.get("episodes", 0)),
            int(data.get("left_out", 0)),
        )

    def table(self) -> str:
        """The summary as a Markdown table (one row per group)."""
        summary = self.summary()
        rows = [("all calls", summary["all"])]
        rows += [(f"tool {k}", v) for k, v in summary["by_tool"].items()]
        rows += [(f"turn {k}", v) for k, v in summary["by_turn"].items()]
        rows += [(k, v) for k, v in summary["by_answer_shown"].items()]
        lines = [
            "| calls | n | mean credit | median | credit > 0 | credit < 0 |",
            "|---|---|---|---|---|---|",
        ]
        for name, s in rows:
            if s["n"]:
                lines.append(
                    f"| {name} | {s['n']} | {s['mean']:+.3f} | {s['median']:+.3f} | "
                    f"{s['positive']:.0%} | {s['negative']:.0%} |"
                )
        return "\n".join(lines)

    def write(self, out: str | Path) -> Path:
        path = Path(out) / CREDIT_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(self.to_json(), indent=2) + "\n")
        return path


def _stats(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "mean": math.nan, "median": math.nan, "positive": math.nan, "negative": math.nan}
    n = len(values)
    return {
        "n": n,
        "mean": sum(values) / n,
        "median": statistics.median(values),
        "positive": sum(v > 1e-9 for v in values) / n,
        "negative": sum(v < -1e-9 for v in values) / n,
    }


class NotReplayable(ConfigError):
    """An episode that cannot be replayed call by call (the reason is the message)."""


def _sampled_runs(trajectory: Trajectory) -> list[tuple[int, int]]:
    """Each run of sampled tokens (mask 1): one per sampled turn, ``(start, end)``."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, m in enumerate((*trajectory.loss_mask, 0)):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _sampled_messages(trajectory: Trajectory, turns: int) -> list[Message]:
    """The conversation from the first sampled turn on: the opening (a worked example's assistant turn
    among it) is everything before the last ``turns`` assistant messages.

    Raises:
        NotReplayable: a compacted episode, or fewer assistant messages than sampled turns.
    """
    if trajectory.segments:
        raise NotReplayable("a compacted episode (several token segments) is not replayed call by call")
    assistant = [i for i, m in enumerate(trajectory.messages) if m.get("role") == "assistant"]
    if turns > len(assistant):
        raise NotReplayable(f"its sampled tokens form {turns} runs for {len(assistant)} assistant messages")
    first = assistant[len(assistant) - turns] if turns else len(trajectory.messages)
    return list(trajectory.messages[first:])


def forced_turns(trajectory: Trajectory) -> list[Completion]:
    """The episode's sampled turns as the policy returned them: each run of sampled tokens (mask 1) with
    its logprobs, and its assistant message's text.

    Raises:
        NotReplayable: a compacted episode (several token segments), or sampled tokens that do not
            split into its assistant turns (reasoning closed by the rollout inside a turn).
    """
    runs = _sampled_runs(trajectory)
    texts = [
        str(m.get("content", ""))
        for m in _sampled_messages(trajectory, len(runs))
        if m.get("role") == "assistant"
    ]
    if len(runs) != len(texts):
        raise NotReplayable(f"its sampled tokens form {len(runs)} runs for {len(texts)} assistant turns")
    return [
        Completion(
            tuple(trajectory.token_ids[a:b]),
            tuple(trajectory.logprobs[a:b]),
            text,
            "stop",
            trajectory.policy_version,
        )
        for (a, b), text in zip(runs, texts, strict=True)
    ]


def _turn_ends(trajectory: Trajectory) -> list[tuple[int, int]]:
    """Per turn: where its sampled tokens end, and where the next turn's begin (the sequence's end after
    the last turn)."""
    runs = _sampled_runs(trajectory)
    return [
        (end, nxt)
        for (_, end), nxt in zip(runs, [*(a for a, _ in runs[1:]), len(trajectory.token_ids)], strict=True)
    ]


def episode_calls(trajectory: Trajectory) -> list[tuple[int, str, str]]:
    """The episode's tool calls with a result: ``(turn, tool, result text)``, turn 1-based (the first
    sampled turn; a worked example in the opening is not a turn); several tool messages after one turn
    are one call, their tools joined with ``+``.

    Raises:
        NotReplayable: see :func:`forced_turns`.
    """
    calls = []
    turn = 0
    names: list[str] = []
    texts: list[str] = []

    def close() -> None:
        if names and all(n != ERROR_TOOL for n in names):
            calls.append((turn, "+".join(names), "\n".join(texts)))

    for message in _sampled_messages(trajectory, len(_sampled_runs(trajectory))):
        role = message.get("role")
        if role == "assistant":
            close()
            turn += 1
            names, texts = [], []
        elif role == "tool" and turn:
            names.append(str(message.get("name") or "tool"))
            texts.append(str(message.get("content", "")))
    close()
    return calls


def count_calls(trajectories: Sequence[Trajectory]) -> int:
    """The tool calls with a result of ``trajectories`` (an episode that cannot be replayed: none)."""
    total = 0
    for trajectory in trajectories:
        with contextlib.suppress(NotReplayable):
            total += len(episode_calls(trajectory))
    return total


def _answer_shown(env: gymnasium.Env[Any, Any], turn: int, tool: str, text: str) -> float | None:
    """The environment's own ``use/answer_shown`` for one call's result (None: it does not measure it)."""
    base: Any = env.unwrapped
    measure = getattr(base, "tool_use_metrics", None)
    if measure is None:
        return None
    value = measure(base.task, [ToolUse(turn, tool, {}, text)], None).get("use/answer_shown")
    return None if value is None else float(value)


async def credit_episode(
    env: gymnasium.Env[Any, Any],
    policy: Policy,
    trajectory: Trajectory,
    *,
    sampling: SamplingParams,
    max_total_tokens: int,
    max_calls: int | None = None,
    replacement: str = EMPTY_RESULT,
) -> tuple[list[CallCredit], int]:
    """Every tool call of ``trajectory`` scored by its two replays (module docstring), at most
    ``max_calls``; returns the credits and the number of calls whose replay failed on infrastructure.

    Raises:
        NotReplayable: the episode cannot be replayed (why, and for a replay that parted from the stored
            tokens, at which token).
    """
    turns = forced_turns(trajectory)
    calls = episode_calls(trajectory)[: max_calls if max_calls is not None else None]
    bounds = _turn_ends(trajectory)
    harness = get_harness(trajectory.harness)
    options: dict[str, Any] = {"task_id": trajectory.task_id}
    base: Any = env.unwrapped  # a toolgym environment (run_episode refuses any other)
    _, info = await base.areset(seed=trajectory.seed, options=options)
    if tuple(info.get("allowed_tools", ())) != tuple(trajectory.allowed_tools):
        options["tools"] = sorted(trajectory.allowed_tools)  # a curriculum stage restricted the tools
    greedy = replace(sampling, temperature=0.0)
    credits, infra = [], 0
    for turn, tool, text in calls:
        replays = []
        plays: list[tuple[Harness, int]] = [
            (harness, bounds[turn - 1][1]),
            (ReplacedResult(harness, turn, replacement), bounds[turn - 1][0]),
        ]
        for h, shared in plays:
            replayed = await run_episode(
                env,
                ForcedTurns(policy, turns[:turn]),
                h,
                seed=trajectory.seed,
                options=options,
                sampling=greedy,
                max_total_tokens=max_total_tokens,
                env_id=trajectory.env_id,
            )
            if replayed.status == "infra_error":
                break
            _check_same_start(trajectory, replayed, shared, turn)
            replays.append(replayed)
        if len(replays) < 2:
            infra += 1
            continue
        shown = _answer_shown(env, turn, tool, text)
        credits.append(
            CallCredit(
                trajectory.task_id,
                trajectory.seed,
                trajectory.harness,
                turn,
                tool,
                shown,
                replays[0].reward,
                replays[1].reward,
            )
        )
    return credits, infra


def _check_same_start(stored: Trajectory, replayed: Trajectory, upto: int, turn: int) -> None:
    a, b = stored.token_ids[:upto], replayed.token_ids[:upto]
    if a != b:
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        raise NotReplayable(
            f"replayed up to turn {turn}'s call, its tokens part from the stored ones at token {at} of {upto} "
            "(the environment answered differently, or the policy renders its chat differently from the "
            "one that sampled the episode)"
        )


async def credit_run(
    run: EvalRun,
    make_env: Callable[[], gymnasium.Env[Any, Any]],
    policy: Policy,
    *,
    source: str,
    policy_name: str,
    max_episodes: int | None = None,
    max_calls: int | None = None,
    replacement: str = EMPTY_RESULT,
    progress: Callable[[int, int], None] | None = None,
) -> CreditReport:
    """Credit every call of ``run``'s stored episodes (every track, in the evaluation's order), at most
    ``max_episodes`` episodes and ``max_calls`` calls in all; one environment, reset per replay."""
    settings = run.settings
    stored = settings.sampling
    sampling = SamplingParams(
        max_tokens=int(stored.get("max_tokens", SamplingParams.max_tokens)),
        seed=stored.get("seed"),
        stop=tuple(stored.get("stop", ())),
    )
    report = CreditReport(source, settings.env_id, policy_name)
    episodes = credit_episodes(run, max_episodes)
    total_calls = count_calls(episodes)
    budget = total_calls if max_calls is None else min(max_calls, total_calls)
    unreplayable = 0  # calls of episodes that could not be replayed: neither scored nor left out
    env = make_env()
    try:
        for done, trajectory in enumerate(episodes, start=1):
            left = budget - len(report.calls) - report.infra_errors
            if left <= 0:
                break
            report.episodes += 1
            try:
                credits, infra = await credit_episode(
                    env,
                    policy,
                    trajectory,
                    sampling=sampling,
                    max_total_tokens=settings.max_total_tokens,
                    max_calls=left,
                    replacement=replacement,
                )
            except NotReplayable as exc:
                report.not_replayable.append(
                    {"task_id": trajectory.task_id, "seed": trajectory.seed, "why": str(exc)}
                )
                unreplayable += count_calls([trajectory])
                credits, infra = [], 0
            report.calls += credits
            report.infra_errors += infra
            if progress is not None:
                progress(done, len(episodes))
    finally:
        env.close()
    report.left_out = total_calls - len(report.calls) - report.infra_errors - unreplayable
    return report


def credit_episodes(run: EvalRun, max_episodes: int | None = None) -> list[Trajectory]:
    """The episodes a credit pass replays: every track's, in the evaluation's order, infrastructure
    failures left out (they have no reward to explain), the first ``max_episodes``."""
    settings = run.settings
    episodes = [t for track in settings.harnesses for t in run.trajectories.get(track, [])]
    return [t for t in episodes if t.status != "infra_error"][:max_episodes]
