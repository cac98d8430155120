"""The tool-call parser is total: every malformed input becomes an exact error observation."""

from __future__ import annotations

import json

import pytest

from toolgym.parsing import format_tool_call, format_tool_response, parse, tool_responses

TOOLS = {
    "search": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
        "required": ["query"],
    },
    "answer": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
}
TC = "<tool_call>{}</tool_call>".format
BIG = "x" * (1024 * 1024)

MALFORMED = [
    ("empty string", "", "Error: empty turn: write a tool call or an answer"),
    ("whitespace only", "  \n\t ", "Error: empty turn: write a tool call or an answer"),
    (
        "bad json",
        TC('{"name": "search", "arguments": {"query": "a"'),
        "Error: tool call is not valid JSON: Expecting ',' delimiter at column 46",
    ),
    (
        "single quotes",
        TC("{'name': 'search'}"),
        "Error: tool call is not valid JSON: Expecting property name enclosed in double quotes at column 2",
    ),
    (
        "trailing text in tag",
        TC('{"name": "search", "arguments": {"query": "a"}} please'),
        "Error: tool call is not valid JSON: Extra data at column 49",
    ),
    (
        "unterminated string",
        TC('{"name": "search", "arguments": {"query": "a}}'),
        "Error: tool call is not valid JSON: Unterminated string starting at column 43",
    ),
    (
        "control character in a string",
        TC('{"name": "search", "arguments": {"query": "a\tb"}}'),
        "Error: tool call is not valid JSON: Invalid control character at column 45",
    ),
    (
        "bad json over several lines",
        TC('{"name": "search",\n "arguments": {"query": "a"\n}'),
        "Error: tool call is not valid JSON: Expecting ',' delimiter at column 2 of line 3",
    ),
    ("empty tag", TC(""), 'Error: empty tool call: expected {"name": ..., "arguments": {...}}'),
    (
        "json array",
        TC("[1, 2]"),
        'Error: tool call must be a JSON object {"name": ..., "arguments": {...}}, got array',
    ),
    (
        "json string",
        TC('"search"'),
        'Error: tool call must be a JSON object {"name": ..., "arguments": {...}}, got string',
    ),
    ("no name", TC('{"arguments": {"query": "a"}}'), 'Error: tool call has no "name" string'),
    ("name not a string", TC('{"name": 3, "arguments": {}}'), 'Error: tool call has no "name" string'),
    (
        "unknown tool",
        TC('{"name": "serch", "arguments": {"query": "a"}}'),
        "Error: unknown tool 'serch'. Did you mean 'search'? Available tools: answer, search",
    ),
    (
        "unknown tool far",
        TC('{"name": "rm_rf", "arguments": {}}'),
        "Error: unknown tool 'rm_rf'. Available tools: answer, search",
    ),
    (
        "extra top-level key",
        TC('{"name": "search", "arguments": {"query": "a"}, "id": 1}'),
        "Error: search: unexpected key(s) 'id' in the call; expected only name and arguments",
    ),
    (
        "missing argument",
        TC('{"name": "search", "arguments": {}}'),
        "Error: search: missing required argument 'query'",
    ),
    ("no arguments key", TC('{"name": "search"}'), "Error: search: missing required argument 'query'"),
    (
        "extra argument",
        TC('{"name": "search", "arguments": {"query": "a", "lang": "en"}}'),
        "Error: search: unexpected argument 'lang' (allowed: k, query)",
    ),
    (
        "wrong type int",
        TC('{"name": "search", "arguments": {"query": "a", "k": "3"}}'),
        "Error: search: argument 'k' must be integer, got string",
    ),
    (
        "wrong type str",
        TC('{"name": "search", "arguments": {"query": 42}}'),
        "Error: search: argument 'query' must be string, got integer",
    ),
    (
        "null argument",
        TC('{"name": "search", "arguments": {"query": null}}'),
        "Error: search: argument 'query' must be string, got null",
    ),
    (
        "arguments not object",
        TC('{"name": "search", "arguments": [1]}'),
        "Error: search: arguments must be a JSON object, got array",
    ),
    (
        "arguments bad json string",
        TC('{"name": "search", "arguments": "{query"}'),
        "Error: search: arguments is a string that is not valid JSON: Expecting property name enclosed in "
        "double quotes at column 2",
    ),
    (
        "unclosed tag",
        '<tool_call>{"name": "search", "arguments": {"query": "a"}}',
        "Error: unclosed <tool_call> tag: end the call with </tool_call>",
    ),
    ("stray closing tag", "hello </tool_call>", "Error: found </tool_call> without a matching <tool_call>"),
    (
        "nested tags",
        '<tool_call><tool_call>{"name": "search", "arguments": {"query": "a"}}</tool_call></tool_call>',
        "Error: nested <tool_call> tags: put one JSON object in each <tool_call>...</tool_call>",
    ),
    (
        "1 MB argument",
        TC(json.dumps({"name": "search", "arguments": {"query": BIG}})),
        "Error: tool call too long (1048622 characters; at most 65536)",
    ),
    (
        "non-utf8 bytes",
        b'<tool_call>{"name": "search", "arguments": {"query": "\xff\xfe"}}</tool_call>',
        "Error: the turn is not valid UTF-8 (byte 54)",
    ),
    ("lone surrogate", "answer \ud800", "Error: the turn contains invalid Unicode (a lone surrogate)"),
    (
        "escaped lone surrogate",
        TC('{"name": "search", "arguments": {"query": "\\ud800"}}'),
        "Error: search: arguments contain invalid Unicode (a lone surrogate)",
    ),
    ("not text", 12345, "Error: expected the turn as text, got int"),
    (
        "nan literal",
        TC('{"name": "search", "arguments": {"query": "a", "k": NaN}}'),
        "Error: tool call writes NaN, which is not JSON: write a number",
    ),
    (
        "a number past python's integer-string limit",
        TC('{"name": "search", "arguments": {"query": "a", "k": ' + "9" * 4401 + "}}"),
        "Error: tool call holds a number with too many digits",
    ),
    (
        "a float out of range",
        TC('{"name": "search", "arguments": {"query": "a", "k": 1e999}}'),
        "Error: tool call holds the number 1e999, out of range",
    ),
    (
        "arguments string nested past the recursion limit",
        TC(json.dumps({"name": "search", "arguments": "[" * 20_000 + "]" * 20_000})),
        "Error: search: arguments is a string that nests too deeply: write a flat JSON object",
    ),
]


@pytest.mark.parametrize(("label", "text", "expected"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_turn_gives_exact_error(label, text, expected):
    turn = parse(text, TOOLS)
    assert turn.calls == ()
    assert [e.observation() for e in turn.errors] == [expected]


def test_table_is_large_enough():
    assert len(MALFORMED) >= 25


def test_two_calls_in_one_turn_runs_the_first_and_reports_the_rest():
    text = format_tool_call("search", {"query": "a"}) + format_tool_call("search", {"query": "b"})
    turn = parse(text, TOOLS)
    assert [c.arguments["query"] for c in turn.calls] == ["a"]
    assert [e.observation() for e in turn.errors] == [
        "Error: too many tool calls in one turn (got 2, at most 1); only the first 1 ran"
    ]


def test_valid_call_with_surrounding_text():
    turn = parse("Let me look.\n" + format_tool_call("search", {"query": "Denver", "k": 2}) + "\n", TOOLS)
    assert turn.errors == ()
    assert turn.calls[0].name == "search" and dict(turn.calls[0].arguments) == {"query": "Denver", "k": 2}
    assert turn.content == "Let me look."


def test_openai_style_string_arguments_are_accepted():
    turn = parse(TC('{"name": "answer", "arguments": "{\\"answer\\": \\"42\\"}"}'), TOOLS)
    assert turn.errors == () and turn.calls[0].arguments == {"answer": "42"}


def test_answer_tag_and_plain_text():
    assert parse("I think <answer> Denver Broncos </answer>", TOOLS).answer == "Denver Broncos"
    plain = parse("Just text.", TOOLS)
    assert (plain.calls, plain.errors, plain.answer, plain.content) == ((), (), None, "Just text.")


def test_unicode_arguments_survive():
    turn = parse(format_tool_call("search", {"query": "Zürich 東京 🚀"}), TOOLS)
    assert turn.calls[0].arguments["query"] == "Zürich 東京 🚀"


def test_tool_responses_read_back_what_format_tool_response_writes():
    results = ["[d1] Title: text", "line one\nline two", "Error: search: empty query"]
    transcript = "<|im_start|>user\n" + "\n".join(format_tool_response(r) for r in results) + "<|im_end|>\n"
    assert tool_responses(transcript) == results
    assert tool_responses("<|im_start|>user\nno results here<|im_end|>\n") == []
