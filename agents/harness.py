"""Harness tracks: ``bare`` (task + tool schemas only) and ``scaffold`` (planning, hints, budget).

Either may compact its context when it nears the token budget: ``bare+compact``, ``scaffold+compact``
(older tool results dropped with a note) or ``+summary`` (the policy summarises); see
:mod:`toolgym.agents.compaction`.

Both tracks see the same tasks with the same seeds; only the text around the model differs. Harness
text is never trained on (the rollout appends it with mask 0).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from toolgym.agents.compaction import CompactingHarness, CompactionConfig
from toolgym.call_formats import get_call_format
from toolgym.core import Harness, Message
from toolgym.errors import ConfigError, did_you_mean
from toolgym.parsing import HERMES

__all__ = ["BareHarness", "ScaffoldHarness", "get_harness", "HARNESSES"]


class BareHarness:
    """The environment's messages, unchanged."""

    name = "bare"
    compaction = None  # not a compacting track (toolgym.agents.compaction)

    def start(self, messages: Sequence[Message], *, max_turns: int) -> list[Message]:
        return copy.deepcopy(list(messages))

    def after_step(self, messages: Sequence[Message], *, turn: int, max_turns: int) -> list[Message]:
        return copy.deepcopy(list(messages))


@dataclass(frozen=True)
class ScaffoldHarness:
    """A light agent scaffold.

    * a planning instruction appended to the system message;
    * after a failed call, a hint that repeats the exact call format (in ``call_format``'s syntax: the
      rollout sets the policy's with :meth:`for_call_format`);
    * a step-budget note after every step, and a "last turn: answer now" note;
    * context compression: tool outputs longer than ``max_tool_chars`` are shortened.
    """

    max_tool_chars: int = 1_500
    name: str = "scaffold"
    call_format: str = HERMES.name
    compaction = None  # not a compacting track (unannotated: not a dataclass field)

    PLAN = (
        "Work in steps. First decide which information you need, then call one tool per turn to get it. "
        "Read each tool result before the next call. When you know the answer, call the answer tool "
        "with a short answer (a few words, copied from the text when possible)."
    )
    HINT = (
        "Hint: that call failed. Write exactly one call as "
        '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call> with the arguments from the schema.'
    )

    def for_call_format(self, call_format: str) -> ScaffoldHarness:
        """This track with its hint written in ``call_format``'s syntax (:mod:`toolgym.call_formats`)."""
        get_call_format(call_format)  # an unknown name is refused here, naming the known ones
        return dataclasses.replace(self, call_format=call_format)

    def hint(self) -> str:
        """The failed-call hint, with an example call in this track's call syntax."""
        if self.call_format == HERMES.name:
            return self.HINT
        example = get_call_format(self.call_format).format_call("<tool>", {"<argument>": "..."})
        return (
            f"Hint: that call failed. Write exactly one call as {example} with the arguments from the schema."
        )

    def start(self, messages: Sequence[Message], *, max_turns: int) -> list[Message]:
        out = copy.deepcopy(list(messages))
        note = f"{self.PLAN} You have at most {max_turns} turns."
        for message in out:
            if message["role"] == "system":
                message["content"] = f"{message['content']}\n\n{note}"
                break
        else:
            out.insert(0, {"role": "system", "content": note})
        return out

    def after_step(self, messages: Sequence[Message], *, turn: int, max_turns: int) -> list[Message]:
        out = copy.deepcopy(list(messages))
        for message in out:
            content = message["content"]
            if message["role"] == "tool" and len(content) > self.max_tool_chars:
                message["content"] = (
                    content[: self.max_tool_chars]
                    + f"\n[... shortened by the scaffold: {len(content) - self.max_tool_chars} characters]"
                )
        notes = []
        if any(m["content"].startswith("Error:") for m in out):
            notes.append(self.hint())
        left = max_turns - turn
        notes.append(
            "This is your last turn: give your final answer now." if left <= 1 else f"{left} turns left."
        )
        out.append({"role": "user", "content": "\n".join(notes)})
        return out


HARNESSES: dict[str, type] = {"bare": BareHarness, "scaffold": ScaffoldHarness}

#: Suffixes that add context compaction to any track (see :mod:`toolgym.agents.compaction`).
COMPACTION_SUFFIXES = {"compact": "drop", "summary": "summary"}


def get_harness(name: str) -> Harness:
    """Harness by track name: ``bare`` or ``scaffold``, optionally ``+compact`` or ``+summary``.

    ``scaffold+compact`` is the scaffold whose episodes go on in a new token segment, older tool
    results replaced by a note, when the context nears its budget; ``+summary`` has the policy
    summarise its work instead (:mod:`toolgym.agents.compaction`).
    """
    base, _, suffix = name.partition("+")
    if base not in HARNESSES:
        raise ConfigError(
            f"unknown harness {name!r}.{did_you_mean(base, HARNESSES)} Choose from: {', '.join(HARNESSES)}, "
            f"each optionally with {' or '.join('+' + s for s in COMPACTION_SUFFIXES)}"
        )
    harness: Harness = HARNESSES[base]()
    if not suffix:
        return harness
    if suffix not in COMPACTION_SUFFIXES:
        raise ConfigError(
            f"unknown harness option {suffix!r} in {name!r}.{did_you_mean(suffix, COMPACTION_SUFFIXES)} "
            f"Options: {', '.join('+' + s for s in COMPACTION_SUFFIXES)}"
        )

    return CompactingHarness(harness, CompactionConfig(mode=COMPACTION_SUFFIXES[suffix]))  # type: ignore[arg-type]
