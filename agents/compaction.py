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
from typing import Literal

from toolgym.core import Harness, Message, Policy
from toolgym.errors import ConfigError
from toolgym.unlocks import is_announcement

__all__ = ["CompactingHarness", "CompactionConfig", "ContextPlan", "TurnRecord", "plan_context"]

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
    """A track with compaction: ``start``/``after_step`` are the base track's; the rollout compacts."""

    def __init__(self, base: Harness, config: CompactionConfig | None = None) -> None:
        self.base = base
        self.compaction = config or CompactionConfig()
        suffix = "compact" if self.compaction.mode == "drop" else "summary"
        self.name = f"{base.name}+{suffix}"

    def start(self, messages: Sequence[Message], *, max_turns: int) -> list[Message]:
        return self.base.start(messages, max_turns=max_turns)

    def after_step(self, messages: Sequence[Message], *, turn: int, max_turns: int) -> list[Message]:
        return self.base.after_step(messages, turn=turn, max_turns=max_turns)


@dataclass
class TurnRecord:
    """One turn of the current segment as the rollout saw it: the sampled ids and what followed them."""

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
