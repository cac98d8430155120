"""Context compaction: a long episode goes on in a new token sequence instead of running out of room.

A compacting track (``<track>+compact``, ``<track>+summary``; any track can have it) watches the
episode's current token sequence. When fewer tokens remain than the next turn may need, it opens a
new **segment** (:class:`toolgym.core.Segment`): a fresh sequence that starts again with the episode's
opening messages, a note that says what was compacted, and the turns kept:

* ``drop`` (``+compact``): every kept assistant turn is copied as the exact ids it was sampled as,
  followed by its observation; observations older than the last ``keep_last`` turns are replaced by a
  one-line note. When that is still too long, the oldest turns are left out altogether (counted);
* ``summary`` (``+summary``): the policy is first asked, in the old sequence, to summarise its work
  (a sampled turn, trained like any other); the new segment carries that summary, copied as its exact
  ids, as the assistant's previous turn.

NOTE (token exactness): nothing sampled is re-tokenised. Copied assistant ids are mask 0 in the new
segment (they train in the segment that sampled them); only environment and harness text is rendered.
A compaction rule may shorten tool results and harness notes, never assistant turns or the opening
messages: :class:`CompactionConfig` refuses such a rule when it is built. Announcements of tools
unlocked mid-episode (:mod:`toolgym.unlocks`) are always kept, so an unlocked tool stays described.

Loops: compacting again before the environment took a single step, or a compacted context that still
leaves no room for a turn, ends the episode (``stop_reason = "compaction_loop"``); so does the
``max_compactions``-th compaction's successor (``compaction_limit``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from toolgym.core import Completion, Harness, Message, Policy, SamplingParams
from toolgym.errors import ConfigError
from toolgym.unlocks import is_announcement

__all__ = [
    "CompactingHarness",
    "Compaction",
    "CompactionConfig",
    "Compactor",
    "ContextPlan",
    "TokenTape",
    "TurnRecord",
    "plan_context",
]

#: Roles whose content a compaction rule may replace by a note. Assistant turns were sampled (their ids
#: are kept exactly); system messages hold the tools and the task's rules.
COMPACTABLE_ROLES = ("tool", "user")

NOTE = (
    "[Context compacted to fit the context window: {turns} earlier turn(s) left out, {results} older "
    "tool result(s) replaced by a note. Your own earlier turns below are unchanged. Continue the task.]"
)
SUMMARY_REQUEST = (
    "Your context is nearly full. Summarise your work so far in a few lines: what you found (exact "
    "names, numbers, ids), what you tried that failed, and what remains to do. Do not call a tool."
)
SUMMARY_NOTE = (
    "[Context compacted to fit the context window: your {turns} earlier turn(s) were replaced by the "
    "summary you wrote, which follows as your previous turn.]"
)
CONTINUE = "Continue the task from your summary."


@dataclass(frozen=True)
class CompactionConfig:
    """When and how an episode's context is compacted.

    Attributes:
        mode: ``drop`` (older results replaced by a note) or ``summary`` (the policy summarises).
        keep_last: in ``drop`` mode, the latest turns whose observations stay verbatim (at least 1: the
            latest observation has not been read yet).
        roles: the roles whose messages may be replaced by a note (``tool``, ``user``).
        target: a compacted context aims at no more than this share of the token budget; beyond it the
            oldest turns are left out.
        max_compactions: compactions allowed per episode; the next one ends it (``compaction_limit``).
    """

    mode: Literal["drop", "summary"] = "drop"
    keep_last: int = 1
    roles: tuple[str, ...] = ("tool",)
    target: float = 0.5
    max_compactions: int = 8

    def __post_init__(self) -> None:
        if self.mode not in ("drop", "summary"):
            raise ConfigError(f"compaction mode must be 'drop' or 'summary', got {self.mode!r}")
        bad = [r for r in self.roles if r not in COMPACTABLE_ROLES]
        if bad:
            raise ConfigError(
                f"a compaction rule may not rewrite {bad[0]!r} messages: assistant turns were sampled "
                "and are kept as their exact token ids (leave whole turns out with keep_last/target "
                "instead), and system messages carry the tools and the task. "
                f"Roles it may shorten: {', '.join(COMPACTABLE_ROLES)}"
            )
        if self.keep_last < 1 or self.max_compactions < 1 or not 0.0 < self.target < 1.0:
            raise ConfigError(
                "compaction needs keep_last >= 1, max_compactions >= 1 and 0 < target < 1, got "
                f"keep_last={self.keep_last}, max_compactions={self.max_compactions}, target={self.target}"
            )


class CompactingHarness:
    """A track with compaction: ``start``/``after_step`` are the base track's; a :class:`Compactor`
    built from ``compaction`` compacts, driven by the rollout."""

    def __init__(self, base: Harness, config: CompactionConfig | None = None) -> None:
        self.base = base
        self.compaction = config or CompactionConfig()
        suffix = "compact" if self.compaction.mode == "drop" else "summary"
        self.name = f"{base.name}+{suffix}"

    def for_call_format(self, call_format: str) -> CompactingHarness:
        """This track over its base track's :meth:`for_call_format` (when it has one)."""
        base = getattr(self.base, "for_call_format", None)
        return self if base is None else CompactingHarness(base(call_format), self.compaction)

    def start(self, messages: Sequence[Message], *, max_turns: int) -> list[Message]:
        return self.base.start(messages, max_turns=max_turns)

    def after_step(self, messages: Sequence[Message], *, turn: int, max_turns: int) -> list[Message]:
        return self.base.after_step(messages, turn=turn, max_turns=max_turns)


@dataclass
class TurnRecord:
    """One turn as the rollout saw it: the sampled ids and what followed them (shown to the policy)."""

    turn: int
    sampled: list[int]
    text: str
    shown: list[Message] = field(default_factory=list)


@dataclass(frozen=True)
class ContextPlan:
    """The opening of a new segment: its ids (all mask 0), its messages and what was left out."""

    ids: list[int]
    context: list[Message]
    dropped_results: int
    dropped_turns: int


def _dropped(message: Message, roles: Sequence[str]) -> tuple[Message, bool]:
    if message["role"] not in roles or is_announcement(message):
        return copy.deepcopy(message), False
    out = dict(message)
    out["content"] = (
        f"[{message['role']} message of {len(message['content'])} characters left out by compaction]"
    )
    return out, True


def _announcements(turns: Sequence[TurnRecord]) -> list[Message]:
    """Tool unlocks announced in turns that a compaction leaves out: the tools stay described."""
    return [copy.deepcopy(m) for record in turns for m in record.shown if is_announcement(m)]


def plan_context(
    policy: Policy,
    start: Sequence[Message],
    turns: Sequence[TurnRecord],
    config: CompactionConfig,
    *,
    limit: int,
    summary: TurnRecord | None = None,
) -> ContextPlan:
    """The opening of a new segment: the most turns that fit ``limit`` tokens, else the shortest one.

    ``drop`` mode keeps as many of the latest ``turns`` as fit (the latest observation always verbatim:
    it has not been read yet); with ``summary`` the opening is the episode's start, a note, the
    summary's exact ids and a request to continue.
    """
    if summary is not None:
        note = {"role": "user", "content": SUMMARY_NOTE.format(turns=len(turns))}
        head = [*copy.deepcopy(list(start)), note, *_announcements(turns)]
        follow = [{"role": "user", "content": CONTINUE}]
        ids = policy.render(head) + list(summary.sampled) + policy.render(follow, continuation=True)
        context = [*head, {"role": "assistant", "content": summary.text}, *follow]
        return ContextPlan(ids, context, 0, len(turns))
    pieces: dict[tuple[int, bool], tuple[list[int], list[Message], int]] = {}

    def piece(i: int, verbatim: bool) -> tuple[list[int], list[Message], int]:
        """Turn ``i`` as kept: its sampled ids and its observation (verbatim or noted), rendered once."""
        if (i, verbatim) not in pieces:
            record, shown, results = turns[i], [], 0
            for message in record.shown:
                out, dropped = (
                    (copy.deepcopy(message), False) if verbatim else _dropped(message, config.roles)
                )
                shown.append(out)
                results += int(dropped and message["role"] == "tool")
            ids = record.sampled + policy.render(shown, continuation=True)
            pieces[i, verbatim] = (ids, [{"role": "assistant", "content": record.text}, *shown], results)
        return pieces[i, verbatim]

    best: ContextPlan | None = None
    for skip in range(max(len(turns), 1)):
        kept = [piece(i, i >= len(turns) - config.keep_last) for i in range(skip, len(turns))]
        results = sum(k[2] for k in kept)
        note = {"role": "user", "content": NOTE.format(turns=skip, results=results)}
        head = [*copy.deepcopy(list(start)), note, *_announcements(turns[:skip])]
        ids = policy.render(head) + [t for k in kept for t in k[0]]
        plan = ContextPlan(ids, [*head, *(m for k in kept for m in k[1])], results, skip)
        if len(plan.ids) <= limit:
            return plan
        if best is None or len(plan.ids) < len(best.ids):
            best = plan
    assert best is not None
    return best


class TokenTape(Protocol):
    """What a compaction needs of the rollout's token sequences (:mod:`toolgym.agents.rollout`).

    ``left`` is the open segment's budget left, in tokens; ``append``, ``trim`` (drop the context after
    the last sampled token) and ``sample`` (the policy samples at most ``budget`` tokens, appended with
    mask 1) act on the open segment; ``open`` closes it and opens the next with a plan's opening.
    """

    @property
    def left(self) -> int: ...

    def append(self, ids: Sequence[int], mask: int) -> None: ...

    def trim(self) -> None: ...

    async def sample(self, budget: int) -> Completion: ...

    def open(self, plan: ContextPlan, *, start_turn: int, summary: str) -> None: ...


@dataclass(frozen=True)
class Compaction:
    """What one compaction did: why the episode stops ("" when it goes on) and the metrics it set."""

    stop_reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


class Compactor:
    """One episode's compaction, all the rollout knows of it: when a segment is full, and what follows.

    The rollout tells it the episode's opening (:meth:`begin`), every environment step (:meth:`stepped`)
    and every turn whose observation the policy was shown (:meth:`shown`). Before each turn it asks
    :meth:`due` with the tokens left; when due, :meth:`compact` closes the open segment on the rollout's
    :class:`TokenTape` (having the policy summarise first, in ``summary`` mode) and opens the next one.
    Without a configuration (a track that does not compact) it is never due.
    """

    def __init__(
        self, config: CompactionConfig | None, policy: Policy, sampling: SamplingParams, max_total_tokens: int
    ) -> None:
        self.config, self.policy = config, policy
        self.sampling, self.max_total_tokens = sampling, max_total_tokens
        self.count = 0  # compactions so far
        self.start: list[Message] = []
        self.turns: list[TurnRecord] = []  # every turn shown so far
        self._steps_since = 0  # environment steps since the last compaction
        self._largest = 0  # the longest observation so far, in tokens
        self._fallbacks = 0  # summarising compactions that dropped instead (no room for a summary)
        # the summary request of a summarising compaction, rendered once per episode
        summarises = config is not None and config.mode == "summary"
        request = [{"role": "user", "content": SUMMARY_REQUEST}]
        self.request = policy.render(request, continuation=True) if summarises else []

    def begin(self, start: Sequence[Message]) -> None:
        """The episode's opening messages (every segment starts again with them)."""
        self.start = list(start)

    def stepped(self) -> None:
        """The environment took a step."""
        self._steps_since += 1

    def shown(self, record: TurnRecord, shown_tokens: int) -> None:
        """A turn whose observation (``shown_tokens`` long) was shown to the policy."""
        self.turns.append(record)
        self._largest = max(self._largest, shown_tokens)

    def due(self, left: int) -> bool:
        """Whether the open segment, with ``left`` tokens left, must be compacted before the next turn.

        ``drop``: when the turn no longer fits (its observation moves to the next segment).
        ``summary``: when the turn, an observation as long as the longest so far, the request and the
        summary no longer fit.
        """
        if self.config is None or not self.turns:
            return False
        reserve = self.sampling.max_tokens
        if self.config.mode == "summary":
            reserve = 2 * self.sampling.max_tokens + len(self.request) + self._largest
        return left < reserve

    async def compact(self, tape: TokenTape, turn: int) -> Compaction:
        """Close the open segment and open the next one, whose first turn is ``turn``.

        Compacting again before the environment took a step is a loop, and past ``max_compactions``
        a limit: the episode stops. A summary that does not fit falls back to dropping results; one
        cut at its token limit ends the episode (``turn_truncated``), as any cut turn does.
        """
        config = self.config
        assert config is not None, "due() is never true without a configuration"
        if self._steps_since == 0 or self.count >= config.max_compactions:
            return Compaction("compaction_loop" if self._steps_since == 0 else "compaction_limit")
        metrics: dict[str, float] = {}
        summary = None
        if config.mode == "summary" and tape.left - len(self.request) < self.sampling.max_tokens:
            self._fallbacks += 1  # no room left for a summary: this compaction drops instead
            metrics["episode/summary_fallbacks"] = float(self._fallbacks)
        elif config.mode == "summary":
            tape.append(self.request, 0)
            completion = await tape.sample(tape.left)
            if completion.finish_reason == "length":
                return Compaction("turn_truncated", {"env/turn_truncated": 1.0})
            summary = TurnRecord(turn, list(completion.token_ids), completion.text)
        plan = plan_context(
            self.policy,
            self.start,
            self.turns,
            config,
            limit=int(config.target * self.max_total_tokens),
            summary=summary,
        )
        if summary is None:
            tape.trim()  # the last observation moves to the next segment: this one never showed it
        self.count, self._steps_since = self.count + 1, 0
        tape.open(plan, start_turn=turn, summary=summary.text if summary else "")
        if tape.left < self.sampling.max_tokens:  # the compacted context leaves no room for a turn
            return Compaction("compaction_loop", metrics)
        return Compaction("", metrics)

    def episode_metrics(self, segments: int) -> dict[str, float]:
        """The episode's compaction counters (none for a track that does not compact)."""
        if self.config is None:
            return {}
        return {"episode/segments": float(segments), "episode/compactions": float(self.count)}
