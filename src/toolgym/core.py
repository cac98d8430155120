"""Contracts shared by every part of toolgym (the map of all of them: ARCHITECTURE.md, "Contracts").

This module is mostly docstrings on purpose: it is the one place to read what a Task, a Tool, a
Verifier, a Policy, a Harness and a Trajectory promise. Environments live in ``toolgym.envs``, tools in
``toolgym.tools``, policies and the rollout loop in ``toolgym.agents``; each depends on this module
only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from toolgym.errors import ConfigError, ToolCallError, ToolTimeout

__all__ = [
    "AsyncToolEnv",
    "Completion",
    "FunctionTool",
    "Harness",
    "Message",
    "Policy",
    "SamplingParams",
    "Score",
    "ServedPolicy",
    "TaskToolEnv",
    "Task",
    "Tool",
    "TrainablePolicy",
    "Trajectory",
    "Verifier",
    "call_tool",
    "sampled_ids_hash",
    "tool_schema",
]

#: A chat message: ``{"role": "system" | "user" | "assistant" | "tool", "content": str}`` plus
#: ``"name"`` on tool messages. Plain dicts of strings so that they JSON round-trip unchanged.
Message = dict[str, str]


@dataclass(frozen=True)
class Task:
    """One problem an environment can pose.

    Attributes:
        id: stable identifier, unique within its data set (used to pair tracks and seeds).
        prompt: the text the agent is given.
        reference: what the verifier checks against (gold answers, hidden tests, citation ids). Never
            shown to the agent.
        metadata: anything else (source, title, difficulty); JSON-serialisable.
    """

    id: str
    prompt: str
    reference: Any
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "id": self.id,
                "prompt": self.prompt,
                "reference": self.reference,
                "metadata": dict(self.metadata),
            },
            ensure_ascii=False,
        )

    @classmethod
    def from_json(cls, text: str) -> Task:
        data = json.loads(text)
        return cls(
            id=data["id"],
            prompt=data["prompt"],
            reference=data["reference"],
            metadata=data.get("metadata", {}),
        )


@runtime_checkable
class Tool(Protocol):
    """Something the agent can call.

    ``parameters`` is a JSON schema (``{"type": "object", "properties": ..., "required": ...}``);
    arguments are validated against it before ``__call__`` runs, so a tool only sees well-typed input.
    ``__call__`` returns the observation text. It raises only :class:`~toolgym.errors.ToolError` for
    the model's mistakes and :class:`~toolgym.errors.InfraError` for infrastructure failures; anything
    else is a bug and propagates. ``timeout`` (seconds) bounds one call. A ``terminal`` tool ends the
    episode: its (single) argument is the agent's answer.

    The members are read-only: nothing changes a tool after it is built, so a frozen dataclass
    (:class:`FunctionTool`) or a class with plain attributes satisfies the protocol alike.
    """

    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...

    @property
    def parameters(self) -> Mapping[str, Any]: ...

    @property
    def timeout(self) -> float: ...

    @property
    def terminal(self) -> bool: ...

    async def __call__(self, **arguments: Any) -> str: ...


@dataclass(frozen=True)
class FunctionTool:
    """A :class:`Tool` made from a plain (sync or async) function.

    ``terminal`` tools are never executed by the environment: their argument is taken as the answer.
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: Callable[..., str | Awaitable[str]] | None = None
    timeout: float = 30.0
    terminal: bool = False

    @classmethod
    def from_function(
        cls,
        fn: Callable[..., str | Awaitable[str]],
        *,
        name: str | None = None,
        timeout: float = 30.0,
        terminal: bool = False,
        constraints: Mapping[str, Mapping[str, Any]] | None = None,
        show_defaults: bool = True,
    ) -> FunctionTool:
        """A tool whose schema is read off ``fn``: its typed signature and its Google-style docstring.

        The description is the docstring before ``Args:``; each parameter's JSON type comes from its
        annotation (``str``, ``int``, ``float``, ``bool``, ``list[...]``), its description from its
        ``Args:`` entry, and a parameter without a default is required. ``constraints`` adds schema
        keywords per parameter (``{"k": {"minimum": 1}}``); ``show_defaults=False`` leaves the defaults
        out. The schema is what the model reads, so its key order is fixed: ``type``, ``items``, the
        constraints, ``description``, ``default``. A terminal tool keeps ``fn`` as its signature only.
        """
        from toolgym.schemas import function_schema  # inspect's import, paid by the tools that use it

        description, schema = function_schema(fn, constraints=constraints, show_defaults=show_defaults)
        tool_fn = None if terminal else fn
        return cls(name or fn.__name__, description, schema, tool_fn, timeout=timeout, terminal=terminal)

    async def __call__(self, **arguments: Any) -> str:
        if self.fn is None:
            raise ToolCallError("this tool ends the episode and has no output", tool=self.name)
        result = self.fn(**arguments)
        if isinstance(result, Awaitable):
            result = await result
        return str(result)


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI/Hermes function schema of a tool: ``{"type": "function", "function": {...}}``."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": dict(tool.parameters)},
    }


async def call_tool(tool: Tool, arguments: Mapping[str, Any]) -> str:
    """Run one tool call under its timeout (raises :class:`ToolTimeout` past it)."""
    import asyncio  # not at module level: importing toolgym should not cost asyncio's import

    try:
        return await asyncio.wait_for(tool(**arguments), timeout=tool.timeout)
    except TimeoutError:
        raise ToolTimeout(f"timed out after {tool.timeout:g} s", tool=tool.name) from None


@dataclass(frozen=True)
class Score:
    """A verifier's verdict: the scalar reward and namespaced metrics (``reward/em``, ``reward/f1``)."""

    reward: float
    metrics: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class Verifier(Protocol):
    """Scores a finished episode. Pure, deterministic and offline.

    Its exceptions propagate: a verifier bug is an error, never reward 0. An *answer* the model got
    wrong (wrong type, empty) is a legitimate reward 0 with a metric that says why.
    """

    def score(self, task: Task, answer: Any, trajectory: Sequence[Message]) -> Score: ...


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one assistant turn."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def check(self) -> None:
        """Raise :class:`~toolgym.errors.ConfigError` unless every field is in range (policies call it)."""
        if self.max_tokens < 1:
            raise ConfigError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"SamplingParams.stop must hold non-empty strings, got {self.stop!r}")


@dataclass(frozen=True)
class Completion:
    """What a policy sampled: exact token ids (the ones to train on), their logprobs, and the text.

    ``finish_reason`` is ``"stop"`` (end-of-turn token, included in ``token_ids``) or ``"length"``.
    ``policy_version`` counts the weight updates the sampling policy had seen.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish_reason: Literal["stop", "length"]
    policy_version: int = 0


@runtime_checkable
class Policy(Protocol):
    """Token-in/token-out text generator, plus the chat template that turns messages into tokens.

    ``render`` tokenises messages once: ``continuation=False`` renders the start of a conversation,
    ``continuation=True`` renders messages that follow an assistant turn (``close_turn=True`` first
    ends an assistant turn that stopped on the length limit). Both end with the assistant generation
    prompt. The rollout never re-tokenises earlier turns. ``policy_version`` counts the weight updates
    it has seen (0 for weights that never change); an episode that sampled nothing records it. An
    optional ``chat_format`` (``toolgym.agents.chat.formats``) tells the rollout the model's call syntax
    (passed to the environment at reset) and reasoning markers; without one, ``hermes``.
    """

    name: str
    policy_version: int

    def render(
        self, messages: Sequence[Message], *, continuation: bool = False, close_turn: bool = False
    ) -> list[int]: ...

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams) -> Completion: ...


@runtime_checkable
class TrainablePolicy(Policy, Protocol):
    """A policy the trainer updates in place: it samples from the very module the learner trains.

    ``model`` is that module (a ``torch.nn.Module``; typed ``Any`` because the core does not import
    torch). ``weights_lock`` is held by the learner while it changes the weights and by the sampler
    while it reads them, so no completion mixes two versions. ``policy_version`` counts the weight
    updates (the trainer bumps it after each step, and sets it on resume). ``token_exact`` is ``True``
    when the completion's token ids and logprobs are exactly what was sampled; the trainer refuses a
    policy where it is ``False``.
    """

    policy_version: int

    @property
    def token_exact(self) -> bool: ...

    @property
    def model(self) -> Any: ...

    @property
    def weights_lock(self) -> AbstractContextManager[Any]: ...


@runtime_checkable
class ServedPolicy(Policy, Protocol):
    """A policy whose weights live in a serving engine (vLLM), not in this process.

    The trainer loads its own copy of the checkpoint in ``model_dir`` to learn on and pushes the new
    weights into the engine after every step; the engine's reload is what bumps ``policy_version``.
    ``close()`` stops the engine; it is idempotent.
    """

    policy_version: int

    @property
    def token_exact(self) -> bool: ...

    @property
    def model_dir(self) -> Path: ...

    def close(self) -> None: ...


@runtime_checkable
class AsyncToolEnv(Protocol):
    """The async side of a toolgym environment, which the rollout loop drives.

    ``areset``/``astep`` have the meaning of gymnasium's ``reset``/``step`` (observation: the new chat
    messages; action: the assistant's raw text; reward 0 until the terminal step) but run on the
    caller's event loop, so many episodes share one thread. ``max_turns`` bounds the assistant turns of
    an episode; ``aclose`` releases the episode's resources (idempotent). ``episode_metrics`` are the
    current episode's metrics so far (the rollout reads them when it ends an episode itself; empty for
    an environment that keeps none). ``toolgym.env.ToolEnv`` and the Ray backend's remote environments
    satisfy it.

    NOTE (wrappers): gymnasium wrappers wrap only the sync ``reset``/``step``. The rollout loop uses
    this async path only on a bare environment; a user's wrapper makes it drive the wrapper's
    ``reset``/``step`` instead (see ``toolgym.agents.rollout``).
    """

    @property
    def max_turns(self) -> int: ...

    @property
    def episode_metrics(self) -> Mapping[str, float]: ...

    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]: ...

    async def astep(self, action: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class TaskToolEnv(AsyncToolEnv, Protocol):
    """An :class:`AsyncToolEnv` that also lists its tasks (the trainer and ``toolgym eval`` sample ids).

    ``task_ids()`` is the ids of the environment's split, in a stable order; ``options["task_id"]``
    at reset picks one of them.
    """

    def task_ids(self) -> list[str]: ...


@runtime_checkable
class Harness(Protocol):
    """What surrounds the model in an episode (``bare`` or ``scaffold``).

    ``start`` rewrites the reset observation (e.g. adds a planning instruction); ``after_step``
    rewrites a step's observation (e.g. adds tool-error hints and the remaining step budget). Harness
    text is context, never trained on (mask 0). ``compaction`` is a compacting track's
    ``toolgym.agents.compaction.CompactionConfig`` and ``None`` on any other (typed ``Any``: the core
    imports no layer above it).
    """

    name: str
    compaction: Any

    def start(self, messages: Sequence[Message], *, max_turns: int) -> list[Message]: ...

    def after_step(self, messages: Sequence[Message], *, turn: int, max_turns: int) -> list[Message]: ...


def sampled_ids_hash(token_ids: Sequence[int], loss_mask: Sequence[int]) -> str:
    """A receipt of the policy-sampled tokens (mask 1), in order, checked again by the learner."""
    sampled = [t for t, m in zip(token_ids, loss_mask, strict=True) if m]
    return hashlib.sha256(json.dumps(sampled).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Segment:
    """One token sequence (context window) of an episode; a compacted episode's later ones are
    :attr:`Trajectory.segments` (every one: :attr:`Trajectory.all_segments`).

    When an episode's context nears its token budget, a compacting harness opens a new token sequence:
    the episode's start, a note, and the kept turns, where each kept assistant turn is copied as the
    exact ids it was sampled as (mask 0 here: it trains in the segment that sampled it) and older tool
    results are replaced by a short note. The episode goes on in the new sequence. Each segment has its
    own receipt; the trainer trains every segment with the episode's advantage.

    Attributes:
        token_ids, loss_mask, logprobs, token_hash: the segment's sequence, as for a trajectory.
        start_turn: the number of the first environment turn sampled in this segment.
        context: the messages the segment opened with, as shown to the model.
        dropped_results: tool results replaced by a note in ``context``.
        dropped_turns: earlier turns left out of ``context`` altogether.
        summary: the policy's own summary the segment carries (summarising compaction), else "".
    """

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    token_hash: str
    start_turn: int
    context: tuple[Message, ...] = ()
    dropped_results: int = 0
    dropped_turns: int = 0
    summary: str = ""

    def sequence(self) -> dict[str, Any]:
        """The sequence's fields as :class:`Trajectory` holds them (ids, mask, logprobs, receipt)."""
        return {
            "token_ids": self.token_ids,
            "loss_mask": self.loss_mask,
            "logprobs": self.logprobs,
            "token_hash": self.token_hash,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Segment:
        data = dict(data)
        for key in ("token_ids", "loss_mask", "logprobs", "context"):
            data[key] = tuple(data.get(key, ()))
        return cls(**data)


@dataclass(frozen=True)
class Trajectory:
    """A finished episode, as written to JSONL.

    NOTE (masks): ``loss_mask[i] == 1`` exactly when ``token_ids[i]`` was sampled by the policy in this
    episode; prompt, tool output and harness text are 0. ``logprobs[i]`` is the behaviour policy's
    logprob for mask-1 tokens and 0.0 elsewhere. ``token_hash`` is :func:`sampled_ids_hash` of the
    sampled ids, so a learner can refuse a trajectory whose tokens were altered after sampling.

    ``status`` is ``ok`` (terminated by an answer), ``truncated`` (turn or token budget ran out) or
    ``infra_error`` (the environment's infrastructure failed; never train on or score it).
    ``stop_reason`` says why it ended: ``answer``, ``max_turns`` (the environment's turn limit),
    ``token_budget``, ``turn_truncated`` (a turn was cut at its token limit: nothing is sampled after
    it), ``compaction_loop`` / ``compaction_limit`` (see :class:`Segment`) or ``infra_error``.

    NOTE (segments): ``token_ids``, ``loss_mask``, ``logprobs`` and ``token_hash`` are the episode's
    first (for most episodes, only) token sequence; a compacted episode's later sequences are in
    ``segments``, in order. That is the record's (JSONL) form; :attr:`all_segments` gives every sequence
    alike, :meth:`from_segments` builds a trajectory from them, and :meth:`segment_views` gives every
    sequence as a trajectory of its own.
    """

    env_id: str
    task_id: str
    seed: int | None
    harness: str
    allowed_tools: tuple[str, ...]
    messages: tuple[Message, ...]
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    reward: float
    metrics: Mapping[str, float]
    status: Literal["ok", "truncated", "infra_error"]
    policy_version: int = 0
    timings: Mapping[str, float] = field(default_factory=dict)
    token_hash: str = ""
    error: str = ""
    stop_reason: str = ""
    segments: tuple[Segment, ...] = ()

    @classmethod
    def from_segments(cls, segments: Sequence[Segment], **episode: Any) -> Trajectory:
        """The trajectory of an episode whose token sequences are ``segments`` (at least one), in order."""
        first, *later = segments
        return cls(**first.sequence(), segments=tuple(later), **episode)

    @property
    def all_segments(self) -> tuple[Segment, ...]:
        """Every token sequence of the episode as a :class:`Segment`, the first one included (turn 1)."""
        first = Segment(self.token_ids, self.loss_mask, self.logprobs, self.token_hash, start_turn=1)
        return (first, *self.segments)

    def segment_views(self) -> list[Trajectory]:
        """Each token sequence of the episode as a trajectory (the episode itself when not compacted).

        A view carries the episode's reward, status and metrics with one segment's ids, mask, logprobs
        and receipt, so the learner trains and checks it like any trajectory.
        """
        if not self.segments:
            return [self]
        episode = replace(self, segments=())
        return [replace(episode, **s.sequence()) for s in self.all_segments]

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> Trajectory:
        data = json.loads(text)
        for key in ("allowed_tools", "messages", "token_ids", "loss_mask", "logprobs"):
            data[key] = tuple(data[key])
        data["segments"] = tuple(Segment.from_dict(s) for s in data.get("segments", ()))
        return cls(**data)
