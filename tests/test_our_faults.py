"""Faults of ours stay ours: a missing package, a parser bug or a hostile data file is never the model's
mistake (an ``Error:`` observation scored 0), and whatever the model writes stays the model's."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

import gymnasium
import pytest

import toolgym  # noqa: F401  (registers the environments)
from toolgym import parsing
from toolgym.core import FunctionTool, Task, Tool
from toolgym.env import ToolEnv
from toolgym.errors import ConfigError, InfraError, MissingDependencyError
from toolgym.parsing import format_tool_call, parse

TOOLS = {
    "search": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    "answer": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
}


@pytest.fixture
def no_jsonschema(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import jsonschema`` fails, as it does when a package it needs (attrs) is missing."""
    monkeypatch.setitem(sys.modules, "jsonschema", None)


def test_a_missing_package_under_the_parser_is_a_missing_dependency_not_a_parse_error(no_jsonschema):
    with pytest.raises(
        MissingDependencyError, match=r"'jsonschema', which is not installed\. Fix: pip install"
    ):
        parse(format_tool_call("search", {"query": "x"}), TOOLS)


def test_an_environment_with_a_missing_package_stops_instead_of_scoring_the_model_0(no_jsonschema):
    env = gymnasium.make("toolgym/SearchQA-v0", split="train")
    env.reset(seed=0)
    with pytest.raises(MissingDependencyError, match="jsonschema"):
        env.step(format_tool_call("search", {"query": "Super Bowl"}))
    env.close()


def test_a_parser_bug_is_an_infra_error_not_the_models_mistake(monkeypatch: pytest.MonkeyPatch):
    def broken(*args: object, **kwargs: object) -> None:
        raise TypeError("an internal slip")

    monkeypatch.setattr(parsing, "_parse", broken)
    with pytest.raises(
        InfraError, match=r"parser failed on this turn \(TypeError: an internal slip\).*toolgym bug"
    ):
        parse("anything", TOOLS)


class _ImportingEnv(ToolEnv):
    """One task, a tool whose body imports a package that is not installed."""

    def __init__(self) -> None:
        super().__init__(max_turns=2)
        self.tasks = [Task(id="t0", prompt="Look it up.", reference="x")]
        self.verifier = None

    async def episode_tools(self, task: Task) -> Sequence[Tool]:
        async def lookup(word: str) -> str:
            import toolgym_no_such_package  # noqa: F401

            return "never"

        schema = {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}
        answer = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
        return [
            FunctionTool("lookup", "Look a word up.", schema, lookup),
            FunctionTool("answer", "Give the answer.", answer, terminal=True),
        ]


def test_a_missing_package_under_a_tool_is_a_missing_dependency():
    env = _ImportingEnv()
    env.reset(seed=0)
    with pytest.raises(
        MissingDependencyError, match=r"The tool 'lookup' needs the Python package 'toolgym_no_such_package'"
    ):
        env.step(format_tool_call("lookup", {"word": "x"}))
    env.close()


def test_deeply_nested_model_json_is_the_models_parse_error():
    turn = "<tool_call>" + "[" * 20_000 + "]" * 20_000 + "</tool_call>"
    (error,) = parse(turn, TOOLS).errors
    assert error.observation() == "Error: tool call nests too deeply: write a flat JSON object"
    deep_args = json.dumps({"name": "search", "arguments": {"query": "x"}})
    deep_args = deep_args.replace('"x"', "[" * 20_000 + "]" * 20_000)
    assert parse(f"<tool_call>{deep_args}</tool_call>", TOOLS).errors


def test_a_closing_tag_inside_a_json_string_is_text_not_the_end_of_the_call():
    query = "what does </tool_call> mean? and <tool_call>?"
    turn = format_tool_call("search", {"query": query}) + " then more"
    parsed = parse(turn, TOOLS)
    assert parsed.errors == ()
    assert [c.arguments for c in parsed.calls] == [{"query": query}]
    assert parsed.content == "then more"


def test_a_body_that_is_not_one_json_object_still_ends_at_the_first_closing_tag():
    parsed = parse('<tool_call>{"name": "search"</tool_call> {"x": 1}</tool_call>', TOOLS)
    assert sorted(e.observation()[:35] for e in parsed.errors) == [
        "Error: found </tool_call> without a",
        "Error: tool call is not valid JSON:",
    ]
    assert parsed.calls == ()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"id": "q1", "question": NaN, "answers": ["a"]}',
            r"questions\.jsonl:1: not valid JSON \(NaN is not a JSON value\)",
        ),
        (
            '{"id": "q1", "question": "q", "answers": [Infinity]}',
            r"questions\.jsonl:1: not valid JSON \(Infinity",
        ),
        (
            '{"id": "q1", "question": {"text": "q"}, "answers": ["a"]}',
            r"questions\.jsonl:1: question field 'question' must be a non-empty string, got dict",
        ),
        (
            '{"id": "q1", "question": "  ", "answers": ["a"]}',
            r"'question' must be a non-empty string, got an empty string",
        ),
        (
            '{"id": {"a": 1}, "question": "q", "answers": ["a"]}',
            r"questions\.jsonl:1: question 'id' must be a string or an integer",
        ),
        (
            '{"id": "q1", "question": "q", "answers": ["a"], "extra": ' + "[" * 50_000 + "]" * 50_000 + "}",
            r"questions\.jsonl:1: the record nests too deeply to read",
        ),
    ],
    ids=["nan-question", "infinite-answer", "object-question", "blank-question", "object-id", "deep"],
)
def test_bring_your_own_questions_of_any_type_or_depth_get_a_located_error(tmp_path, line, message):
    from toolgym.envs.search_qa.data import load_questions

    path = tmp_path / "questions.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message):
        load_questions(path)


def test_a_document_whose_text_is_not_a_string_is_refused_with_its_line(tmp_path):
    from toolgym.envs.search_qa.data import load_corpus

    path = tmp_path / "docs.jsonl"
    path.write_text('{"id": "a", "text": "fine"}\n{"id": "b", "text": {"nested": "object"}}\n')
    with pytest.raises(
        ConfigError, match=r"docs\.jsonl:2: document field 'text' must be a non-empty string, got dict"
    ):
        load_corpus(path)
