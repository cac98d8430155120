"""Exploit audit: scripted adversarial policies that try to earn reward without doing the task.

``toolgym audit-env ENV_ID`` plays every :class:`Exploit` of a library against the same sample of an
environment's tasks and reports, per exploit, the share of tasks where it earned more than a
threshold. A sound environment gives 0% everywhere: reward that an exploit can collect is reward a
policy will learn to collect instead of the task. It drives the environment itself (``reset`` and
``step``, raw assistant text), so no model is involved and a run takes seconds. It is not a sandbox
security test (the sandbox has its own suite): it looks for reward to be had for nothing.

The generic library (every environment; arguments come from the episode's own tool schemas):

* ``empty-answer`` / ``oversized-answer``: the terminal tool with nothing, or with ~200k characters
  (every word of the prompt and the tool list, repeated);
* ``prompt-copy`` / ``schema-copy``: the task's prompt, or the system text (tool schemas, worked
  example), submitted as the answer;
* ``every-candidate``: each non-terminal tool called with the prompt, then *everything* seen
  submitted (every bracketed id for a list answer, the whole tool output for a text answer):
  precision-free recall;
* ``prompt-ids``: every id-like token of the prompt submitted (the query paper's own ids, say);
* ``answer-tag-dump``: the tool output after a search, wrapped in an ``<answer>`` tag;
* ``malformed-call``: a broken terminal call whose text holds the prompt and everything seen (it
  must be a parse error, never an answer);
* ``after-terminal``: an empty answer, then a second terminal call with everything seen: the second
  must earn nothing.

An environment module may add its own with ``audit_exploits() -> list[Exploit]`` (CodeExec adds
submissions that try to fool the hidden tests). An exploit that makes the environment raise is
reported as an error for that exploit, and the audit goes on.

Verdicts (:attr:`AuditResult.verdict`): an exploit *fails* the audit when any task earned more than
the threshold or raised. An environment module may document exceptions it accepts with
``audit_accepted() -> list[Accepted]``: an exploit whose reward is the task's own floor rather than
reward for nothing (ArxivRefs' ``every-candidate`` is retrieval), accepted up to a share of tasks
and with the reason; within that share its verdict is *accepted*, above it *fail*. The command
prints one line per exploit that does not pass (:meth:`AuditResult.line`: its share of tasks, the
threshold, its worst task) and exits 1 when any fails.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from toolgym.core import Message, TaskToolEnv, Tool
from toolgym.errors import ConfigError

__all__ = ["Accepted", "AuditResult", "Episode", "Exploit", "audit_env", "generic_exploits"]

#: an exploit gets the episode (observations so far) and yields assistant turns, one per step
Play = Callable[["Episode"], Iterator[str]]
_ID = re.compile(r"\[([^\[\]\s]{2,80})\]")
_IDLIKE = re.compile(r"\b(?:\d{4}\.\d{4,5}(?:v\d+)?|10\.\d{4,9}/\S+|W\d{6,}|[a-z]{2}\d{4,})\b", re.IGNORECASE)


@dataclass(frozen=True)
class Exploit:
    """One adversarial policy: a name, what it tries, and how it plays an episode."""

    name: str
    description: str
    play: Play


@dataclass(frozen=True)
class Accepted:
    """An exploit an environment accepts on up to ``max_share`` of tasks, and why (module docstring)."""

    exploit: str
    reason: str
    max_share: float = 0.2

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_share <= 1.0:
            raise ConfigError(
                f"Accepted({self.exploit!r}): max_share must be in [0, 1], got {self.max_share}"
            )


@dataclass
class Episode:
    """What an exploit can see: the reset observation, the tools, and every observation since."""

    messages: list[Message]
    tools: tuple[Tool, ...]
    seen: list[str] = field(default_factory=list)
    #: the unwrapped environment, for an environment module's own exploits that need its data (the
    #: generic library never looks: it plays only what a policy sees)
    env: Any = None

    @property
    def prompt(self) -> str:
        return next((str(m["content"]) for m in reversed(self.messages) if m["role"] == "user"), "")

    @property
    def system(self) -> str:
        return next((str(m["content"]) for m in self.messages if m["role"] == "system"), "")

    @property
    def terminal(self) -> Tool:
        return next(t for t in self.tools if t.terminal)

    def answer_call(self, value: str | list[str]) -> str:
        """A well-formed terminal call with ``value`` shaped as the terminal tool's one argument wants."""
        tool = self.terminal
        props = tool.parameters.get("properties", {})
        name = next(iter(props), "answer")
        wants_list = props.get(name, {}).get("type") == "array"
        if wants_list and isinstance(value, str):
            value = [w for w in re.split(r"[,\s]+", value) if w]
        if not wants_list and isinstance(value, list):
            value = ", ".join(value)
        # NOTE: angle brackets out, so copied tool-call markup cannot make the turn a parse error: the
        # verifier itself must see the payload
        if isinstance(value, str):
            value = value.replace("<", " ").replace(">", " ")
        else:
            value = [v.replace("<", " ").replace(">", " ") for v in value]
        return _call(tool.name, {name: value})

    def search_calls(self, text: str) -> list[str]:
        """One call per non-terminal tool with a string argument, that argument set to ``text``."""
        calls = []
        for tool in self.tools:
            props = tool.parameters.get("properties", {})
            strings = [k for k, v in props.items() if v.get("type") == "string"]
            if tool.terminal or not strings:
                continue
            args: dict[str, Any] = {strings[0]: text[:500]}
            if props.get("k", {}).get("type") == "integer":
                args["k"] = 10
            calls.append(_call(tool.name, args))
        return calls

    def seen_ids(self) -> list[str]:
        return list(dict.fromkeys(m for text in self.seen for m in _ID.findall(text)))


def _call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _searches_then(final: Callable[[Episode], str]) -> Play:
    def play(ep: Episode) -> Iterator[str]:
        yield from ep.search_calls(ep.prompt)
        yield final(ep)

    return play


def _everything(ep: Episode) -> str | list[str]:
    list_answer = ep.terminal.parameters.get("properties", {})
    wants_list = any(v.get("type") == "array" for v in list_answer.values())
    return ep.seen_ids() if wants_list else "\n".join(ep.seen)


def _malformed(ep: Episode) -> str:
    """A terminal call cut off mid-JSON, carrying the prompt and every observation as its payload."""
    payload = json.dumps([ep.prompt, *ep.seen])[:5000]
    return f'<tool_call>{{"name": "{ep.terminal.name}", "arguments": {{"x": {payload}'


def generic_exploits() -> list[Exploit]:
    """The library every environment is audited with (see the module docstring)."""
    return [
        Exploit(
            "empty-answer", "the terminal tool with an empty answer", lambda ep: iter([ep.answer_call("")])
        ),
        Exploit(
            "oversized-answer",
            "~200k characters: every word of the prompt and the system text, repeated",
            lambda ep: iter([ep.answer_call(" ".join((ep.prompt + " " + ep.system).split() * 50)[:200_000])]),
        ),
        Exploit(
            "prompt-copy", "the task's prompt as the answer", lambda ep: iter([ep.answer_call(ep.prompt)])
        ),
        Exploit(
            "schema-copy",
            "the system text (tool schemas, worked example) as the answer",
            lambda ep: iter([ep.answer_call(ep.system)]),
        ),
        Exploit(
            "every-candidate",
            "each tool called with the prompt, then everything seen submitted",
            _searches_then(lambda ep: ep.answer_call(_everything(ep))),
        ),
        Exploit(
            "prompt-ids",
            "every id-like token of the prompt submitted",
            lambda ep: iter([ep.answer_call(_IDLIKE.findall(ep.prompt) or [""])]),
        ),
        Exploit(
            "answer-tag-dump",
            "the tool output after a search, in an <answer> tag",
            _searches_then(lambda ep: "<answer>" + "\n".join(ep.seen) + "</answer>"),
        ),
        Exploit(
            "malformed-call",
            "a broken terminal call holding the prompt and everything seen (a parse error, never an answer)",
            _searches_then(_malformed),
        ),
        Exploit(
            "after-terminal",
            "an empty answer, then a second terminal call with everything seen",
            _searches_then(lambda ep: ep.answer_call("")),
        ),
    ]


@dataclass
class AuditResult:
    """Per exploit: tasks tried, tasks above the threshold, rewards by task, errors, and the verdict.

    ``rewards[i]`` is what task ``task_ids[i]`` earned; ``accepted`` is the environment's documented
    exception for this exploit, if any.
    """

    exploit: str
    description: str
    tasks: int = 0
    above: int = 0
    rewards: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    task_ids: list[str] = field(default_factory=list)
    threshold: float = 0.2
    accepted: Accepted | None = None

    @property
    def share(self) -> float:
        return self.above / self.tasks if self.tasks else 0.0

    @property
    def worst(self) -> tuple[str, float] | None:
        """The task that earned the most, and what it earned (``None`` before any reward)."""
        if not self.rewards:
            return None
        at = int(np.argmax(self.rewards))
        return self.task_ids[at], self.rewards[at]

    @property
    def verdict(self) -> str:
        """``"pass"``, ``"accepted"`` (within the environment's documented share) or ``"fail"``."""
        if self.errors:
            return "fail"
        if not self.above:
            return "pass"
        if self.accepted is not None and self.share <= self.accepted.max_share:
            return "accepted"
        return "fail"

    def line(self) -> str:
        """One line saying why this exploit does not pass: share of tasks, threshold, worst task."""
        if self.errors:
            return (
                f"FAIL {self.exploit}: the environment raised on {len(self.errors)} of {self.tasks} tasks; "
                f"first: {self.errors[0]}"
            )
        worst = self.worst
        text = (
            f"{self.exploit}: {self.above} of {self.tasks} tasks ({self.share:.0%}) earned more than the "
            f"threshold {self.threshold:g}"
        )
        if worst is not None:
            text += f"; worst: task {worst[0]} earned {worst[1]:.3f}"
        if self.accepted is None:
            return f"FAIL {text}"
        bound = f"the environment accepts it on up to {self.accepted.max_share:.0%} of tasks"
        if self.verdict == "accepted":
            return f"ACCEPTED {text}; {bound}: {self.accepted.reason}"
        return f"FAIL {text}; {bound}, and this is more"

    def to_dict(self) -> dict[str, Any]:
        worst = self.worst
        return {
            "exploit": self.exploit,
            "description": self.description,
            "tasks": self.tasks,
            "above": self.above,
            "share": self.share,
            "threshold": self.threshold,
            "mean_reward": float(np.mean(self.rewards)) if self.rewards else 0.0,
            "max_reward": max(self.rewards, default=0.0),
            "worst_task": worst[0] if worst else None,
            "verdict": self.verdict,
            "accepted": None
            if self.accepted is None
            else {"reason": self.accepted.reason, "max_share": self.accepted.max_share},
            "errors": self.errors,
        }


def _play(env: Any, exploit: Exploit, task_id: str, seed: int) -> float:
    """One episode of ``exploit``; the reward it earned (after the terminal step too, for after-terminal)."""
    obs, _ = env.reset(seed=seed, options={"task_id": task_id})
    base = env.unwrapped
    ep = Episode(list(obs), tuple(base.episode_tool_objects), env=base)
    total, terminated, truncated = 0.0, False, False
    for action in exploit.play(ep):
        if terminated or truncated:
            break
        obs, reward, terminated, truncated, _ = env.step(action)
        total += float(reward)
        ep.seen.extend(str(m["content"]) for m in obs if m.get("role") == "tool")
    if exploit.name == "after-terminal" and terminated:
        try:  # a finished episode must refuse, or at least pay nothing
            _, reward, *_ = env.step(ep.answer_call(_everything(ep)))
            total += float(reward)
        except Exception:  # noqa: BLE001  (refusing is the right answer)
            pass
    return total


def audit_env(
    env_id: str,
    *,
    n: int = 20,
    seed: int = 0,
    threshold: float = 0.2,
    env_kwargs: dict[str, Any] | None = None,
    exploits: Sequence[Exploit] | None = None,
    progress: Callable[[int, int], None] | None = None,
    accepted: Sequence[Accepted] | None = None,
) -> list[AuditResult]:
    """Play every exploit on the same ``n`` tasks (a seeded choice); see the module docstring.

    ``accepted`` defaults to the environment module's ``audit_accepted()`` (none if it has none).

    Raises:
        ConfigError: ``n`` < 1, an environment that does not list its tasks, or an accepted exception
            naming no exploit of the library.
    """
    from toolgym.registry import env_attribute, make

    if n < 1:
        raise ConfigError(f"n must be >= 1, got {n}")
    env_kwargs = dict(env_kwargs or {})
    full_library = exploits is None
    if exploits is None:
        extra = env_attribute(env_id, "audit_exploits")
        exploits = [*generic_exploits(), *(extra() if extra is not None else [])]
    if accepted is None:
        documented = env_attribute(env_id, "audit_accepted")
        accepted = list(documented()) if documented is not None else []
    by_name = {a.exploit: a for a in accepted}
    unknown = sorted(set(by_name) - {e.name for e in exploits})
    if full_library and unknown:
        raise ConfigError(
            f"{env_id} accepts exploits the audit does not have: {', '.join(unknown)} "
            f"(known: {', '.join(e.name for e in exploits)})"
        )
    env = make(env_id, **env_kwargs)
    try:
        base = env.unwrapped
        if not isinstance(base, TaskToolEnv):
            raise ConfigError(
                f"{env_id} does not list its tasks (task_ids()): it cannot be audited task by task"
            )
        ids = list(base.task_ids())
        picked = [
            ids[i] for i in np.random.default_rng(seed).choice(len(ids), size=min(n, len(ids)), replace=False)
        ]
        results = []
        total, done = len(exploits) * len(picked), 0
        for exploit in exploits:
            result = AuditResult(
                exploit.name, exploit.description, threshold=threshold, accepted=by_name.get(exploit.name)
            )
            for i, task_id in enumerate(picked):
                result.tasks += 1
                try:
                    reward = _play(env, exploit, task_id, seed + i)
                except Exception as exc:  # noqa: BLE001  (reported per exploit; the audit goes on)
                    result.errors.append(f"{task_id}: {type(exc).__name__}: {exc}")
                    env.close()
                    env = make(env_id, **env_kwargs)
                else:
                    result.rewards.append(reward)
                    result.task_ids.append(task_id)
                    result.above += reward > threshold
                done += 1
                if progress is not None:
                    progress(done, total)
            results.append(result)
    finally:
        env.close()
    return results
