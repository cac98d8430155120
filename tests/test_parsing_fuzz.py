"""Hostile tool-call texts, in every call syntax: whatever the model writes is its own parse error or a
valid call, never ``InfraError`` (which would leave the episode out of the score: a reward hack)."""

from __future__ import annotations

import json
import random

import pytest

from toolgym.call_formats import ARGS, CALL_FORMATS, H_CHANNEL, H_MESSAGE, PYTHON_TAG, TOOL_CALLS
from toolgym.errors import InfraError
from toolgym.parsing import ParsedTurn, parse

TOOLS = {
    "search": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "k": {"type": "integer", "minimum": 1, "maximum": 50}},
        "required": ["query"],
    },
    "answer": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 200}}},
}

DEEP = 20_000
#: Values a hostile model may put where JSON goes (each is a JSON text, or deliberately not one).
VALUES = [
    "9" * 4401,  # past Python's integer-string limit (ValueError, not JSONDecodeError)
    "-" + "9" * 5000,
    "1e999",  # a float that overflows to inf
    "-1e999",
    "NaN",
    "Infinity",
    "[" * DEEP + "]" * DEEP,  # past the recursion limit
    '{"a":' * DEEP + "1" + "}" * DEEP,
    json.dumps("[" * DEEP + "]" * DEEP),  # a string holding deep JSON (an OpenAI-style arguments string)
    json.dumps("9" * 4401),
    json.dumps("NaN"),
    '"\\ud800"',  # a lone surrogate, escaped
    '"\x00"',  # a raw NUL inside a string (a control character)
    '"\\u0000"',
    '"' + "x" * 200_000 + '"',  # a very long string
    '"' + "é" * 5000 + '"',
    "0.1e-99999",
    "12345678901234567890123456789",
    "[]",
    "{}",
    "null",
    "true",
    '"query"',
]
NAMES = ['"search"', '"answer"', '"nope"', "1", "null", '"' + "s" * 5000 + '"', "[" * 50 + "]" * 50]


def _bodies(rng: random.Random) -> list[str]:
    out = []
    for value in VALUES:
        out.append(f'{{"name": "search", "arguments": {{"query": {value}}}}}')
        out.append(f'{{"name": "search", "arguments": {{"query": "q", "k": {value}}}}}')
        out.append(f'{{"name": "search", "arguments": {value}}}')
        out.append(f'{{"name": {rng.choice(NAMES)}, "arguments": {value}}}')
        out.append(f'{{"name": "search", "parameters": {value}}}')
        out.append(value)
    for _ in range(200):  # random cuts and splices of the above
        a, b = rng.choice(out), rng.choice(out)
        i, j = rng.randrange(len(a) + 1), rng.randrange(len(b) + 1)
        out.append(a[:i] + b[j:])
    return out


def _turns(body: str, syntax: str) -> list[str | bytes]:
    if syntax == "hermes":
        return [
            f"<tool_call>{body}</tool_call>",
            f"<tool_call>{body}",
            f"x<tool_call>{body}</tool_call><answer>a",
        ]
    if syntax == "llama3":
        return [body, PYTHON_TAG + body, body + ";" + body]
    if syntax == "mistral":
        return [f"{TOOL_CALLS}[{body}]", f"{TOOL_CALLS}search{ARGS}{body}", f"{TOOL_CALLS}{body}"]
    return [f"{H_CHANNEL}commentary to=functions.search <|constrain|>json{H_MESSAGE}{body}<|call|>"]


def test_hostile_tool_calls_are_the_models_parse_errors_in_every_syntax() -> None:
    rng = random.Random(0)
    bodies = _bodies(rng)
    seen = {"calls": 0, "errors": 0}
    for name, syntax in CALL_FORMATS.items():
        for body in bodies:
            for turn in _turns(body, name):
                for text in (
                    turn,
                    turn.encode("utf-8", "surrogatepass") + b"\xff",
                    turn.replace("a", "\x00"),
                ):
                    try:
                        parsed = parse(text, TOOLS, call_format=syntax, max_call_chars=300_000)
                    except InfraError as exc:  # pragma: no cover - the failure this test exists for
                        pytest.fail(f"{name}: InfraError on the model's text {str(text)[:120]!r}...: {exc}")
                    assert isinstance(parsed, ParsedTurn)
                    seen["calls"] += bool(parsed.calls)
                    seen["errors"] += bool(parsed.errors)
    # the texts are not all rejected for one reason: some hold valid calls, most are errors
    assert seen["calls"] > 0 and seen["errors"] > 1000, seen


def test_a_broken_schema_is_ours_not_the_models() -> None:
    """The tool's schema is not the model's text: an invalid one is a fault of ours (``InfraError``)."""
    broken = {"search": {"type": "object", "properties": {"k": {"type": "integer", "minimum": "one"}}}}
    with pytest.raises(InfraError, match="parameter schema is not valid JSON Schema"):
        parse('<tool_call>{"name": "search", "arguments": {"k": 3}}</tool_call>', broken)
