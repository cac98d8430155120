"""The shared tool-use measures (pure logic): word overlap, reformulation, means that leave the
unmeasured out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from toolgym.tool_use import REFORMULATED_BELOW, ToolUse, overlap, search_measures, tool_use_means

QUESTION = "Which river flows through the capital of France?"


def test_overlap_is_the_jaccard_of_the_word_sets() -> None:
    assert overlap(QUESTION, QUESTION.lower().rstrip("?")) == 1.0  # case and punctuation aside
    assert overlap("capital of France", QUESTION) == pytest.approx(3 / 8)
    assert overlap("", QUESTION) == 0.0 and overlap("Seine", QUESTION) == 0.0


def test_search_measures_of_a_copying_and_a_reformulating_episode() -> None:
    copying = [ToolUse(1, "search", {"query": QUESTION}, "[d1] ...")]
    m = search_measures(copying, question=QUESTION)
    assert m == {
        "use/searches": 1.0,
        "use/queries_distinct": 1.0,
        "use/searched": 1.0,
        "use/opened": 0.0,
        "use/first_search_turn": 1.0,
        "use/query_overlap": 1.0,
        "use/reformulated": 0.0,
    }
    reformulating = [
        ToolUse(2, "search", {"query": QUESTION}),
        ToolUse(3, "search", {"query": "capital of France"}),
        ToolUse(4, "search", {"query": "CAPITAL of france"}),
        ToolUse(5, "open", {"doc_id": "d1"}),
    ]
    m = search_measures(reformulating, question=QUESTION)
    assert m["use/searches"] == 3.0 and m["use/queries_distinct"] == 2.0 and m["use/opened"] == 1.0
    assert m["use/first_search_turn"] == 2.0 and m["use/reformulated"] == 1.0
    assert m["use/query_overlap"] == pytest.approx((1 + 3 / 8 + 3 / 8) / 3)
    assert REFORMULATED_BELOW > 3 / 8


def test_an_episode_without_search_or_question_leaves_those_measures_out() -> None:
    m = search_measures([ToolUse(1, "open", {"doc_id": "d1"})], question=QUESTION)
    assert m == {"use/searches": 0.0, "use/queries_distinct": 0.0, "use/searched": 0.0, "use/opened": 1.0}
    m = search_measures([ToolUse(1, "search", {"query": "x"})])  # no question: no overlap
    assert "use/query_overlap" not in m and "use/reformulated" not in m


def test_means_are_over_the_episodes_that_have_a_measure() -> None:
    a = SimpleNamespace(metrics={"use/first_search_turn": 2.0, "use/searched": 1.0, "reward/f1": 1.0})
    b = SimpleNamespace(metrics={"use/searched": 0.0})
    c = SimpleNamespace(metrics={"tool/search/calls": 0.0})  # an environment that measures nothing
    assert tool_use_means([a, b, c]) == {"use/first_search_turn": 2.0, "use/searched": 0.5}
    assert tool_use_means([c]) == {}
