"""What an episode did with its tools: the ``use/*`` measures an environment computes at episode end.

A reward says whether the answer was right; it does not say whether the agent searched, what it
searched for, or whether what it was shown held the answer. An environment that wants those on every
episode implements :meth:`toolgym.env.ToolEnv.tool_use_metrics`: it receives each tool call of the
episode as a :class:`ToolUse` (turn, tool, arguments, the observation text it returned; the terminal
tool's call is the answer, passed on its own) and returns measures, which land in the episode's
metrics as ``use/<name>``. They are summarised per track in ``eval.json`` and per step in
``metrics.jsonl`` as means over the episodes that have them: a measure an environment does not
compute is absent ("not measured"), never 0.

The search measures most environments share are here (:func:`search_measures`); what counts as the
answer being shown is the environment's (SearchQA: a gold answer as whole SQuAD words; ArxivRefs: a
gold paper id). Names:

============================ ============================================================================
``use/searches``             search calls in the episode
``use/queries_distinct``     distinct queries (lowercased words)
``use/searched``             1 when the episode searched at all
``use/first_search_turn``    the turn of its first search (only episodes that searched)
``use/query_overlap``        mean word overlap (Jaccard) of its queries with the question
``use/reformulated``         1 when a query's overlap with the question is below
                             :data:`REFORMULATED_BELOW` (it searched with other words than the question's)
``use/opened``               documents opened (the environment's open/read tool)
``use/answer_shown``         1 when a tool result showed a gold answer
``use/answer_in_results``    1 when the answer given appears in a tool result (the agent answered from
                             what it was shown, right or wrong)
============================ ============================================================================
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["REFORMULATED_BELOW", "ToolUse", "overlap", "search_measures", "tool_use_means", "words"]

#: A query whose word overlap (Jaccard) with the question is below this counts as reformulated: the
#: question with a word or two dropped stays above it, a part of a two-part question or a name the
#: results showed falls below.
REFORMULATED_BELOW = 0.8


@dataclass(frozen=True)
class ToolUse:
    """One non-terminal tool call of an episode, as the environment ran it."""

    turn: int
    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    output: str = ""


_WORD = re.compile(r"\w+")


def words(text: str) -> frozenset[str]:
    """``text``'s lowercased words."""
    return frozenset(_WORD.findall(str(text).lower()))


def overlap(query: str, question: str) -> float:
    """Jaccard overlap of the two texts' word sets (1: the same words; 0: none shared or either empty)."""
    a, b = words(query), words(question)
    return len(a & b) / len(a | b) if a and b else 0.0


def search_measures(
    calls: Sequence[ToolUse],
    *,
    search: str = "search",
    query_key: str = "query",
    opened: Iterable[str] = ("open",),
    question: str | None = None,
) -> dict[str, float]:
    """The shared search measures (module table) of one episode's ``calls``; ``question`` None leaves
    the overlap and reformulation out (not measured)."""
    queries = [str(c.arguments.get(query_key, "")) for c in calls if c.name == search]
    opened = set(opened)
    out = {
        "use/searches": float(len(queries)),
        "use/queries_distinct": float(len({" ".join(sorted(words(q))) for q in queries})),
        "use/searched": float(bool(queries)),
        "use/opened": float(sum(c.name in opened for c in calls)),
    }
    if queries:
        out["use/first_search_turn"] = float(min(c.turn for c in calls if c.name == search))
        if question is not None:
            overlaps = [overlap(q, question) for q in queries]
            out["use/query_overlap"] = sum(overlaps) / len(overlaps)
            out["use/reformulated"] = float(min(overlaps) < REFORMULATED_BELOW)
    return out


def tool_use_means(episodes: Iterable[Any]) -> dict[str, float]:
    """Each ``use/*`` measure's mean over the episodes (trajectories) that have it; none: not measured."""
    sums: dict[str, list[float]] = {}
    for t in episodes:
        for k, v in t.metrics.items():
            if k.startswith("use/"):
                sums.setdefault(k, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in sorted(sums.items())}
