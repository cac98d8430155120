"""Tool-call syntaxes: each registered format's calls round-trip through the parser, its malformed calls
become exact error observations, a call in another format is an error naming both, and an environment
told the format at reset lists its tools, shows its example and parses in it."""

from __future__ import annotations

import json

import pytest

from toolgym import FunctionTool, Score, Task, ToolEnv
from toolgym.call_formats import CALL_FORMATS, get_call_format, translate_calls
from toolgym.errors import ConfigError
from toolgym.parsing import HERMES, format_tool_call, parse, tools_system_prompt

TOOLS = {
    "search": {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "what to look for"},
            "k": {"type": "integer"},
        },
        "required": ["query"],
    },
    "answer": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
}
SCHEMAS = [
    {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": params}}
    for name, params in TOOLS.items()
]


def errors(text: str, fmt: str) -> list[str]:
    return [e.observation() for e in parse(text, TOOLS, call_format=get_call_format(fmt)).errors]


@pytest.mark.parametrize("fmt", list(CALL_FORMATS))
def test_a_written_call_parses_back_to_the_same_call(fmt):
    syntax = get_call_format(fmt)
    text = syntax.format_call("search", {"query": "Super Bowl 50", "k": 3})
    turn = parse(text, TOOLS, call_format=syntax)
    assert turn.errors == () and [(c.name, dict(c.arguments)) for c in turn.calls] == [
        ("search", {"query": "Super Bowl 50", "k": 3})
    ]


@pytest.mark.parametrize("fmt", list(CALL_FORMATS))
def test_plain_text_is_content_without_calls_or_errors(fmt):
    turn = parse("The answer is <answer>Paris</answer>", TOOLS, call_format=get_call_format(fmt))
    assert turn.calls == () and turn.errors == () and turn.answer == "Paris"


def test_hermes_is_the_default_and_its_prompt_and_calls_are_todays():
    assert get_call_format("hermes") is HERMES
    assert HERMES.tools_prompt(SCHEMAS) == tools_system_prompt(SCHEMAS)
    assert HERMES.format_call("answer", {"answer": "x"}) == format_tool_call("answer", {"answer": "x"})
    text = '<tool_call>{"name": "search", "arguments": {"query": </tool_call>'
    assert [e.observation() for e in parse(text, TOOLS).errors] == errors(text, "hermes")


@pytest.mark.parametrize(
    ("fmt", "text", "expected"),
    [
        ("llama3", '{"name": "search", "parameters": {"query": "a"', "Error: tool call is not valid JSON: "),
        (
            "llama3",
            '{"name": "search"} ; {"name": "answer", "parameters": 3}',
            "Error: answer: parameters must be",
        ),
        (
            "llama3",
            '{"name": "serch", "parameters": {}}',
            "Error: unknown tool 'serch'. Did you mean 'search'?",
        ),
        (
            "llama3",
            '{"name": "search", "parameters": {"query": "a"}, "arguments": {}}',
            "Error: search: unexpected key(s) 'arguments' in the call; expected only name and parameters",
        ),
        ("llama3", "<|python_tag|>", 'Error: empty tool call: expected {"name": ..., "parameters": {...}}'),
        ("mistral", '[TOOL_CALLS][{"name": "search", "arguments": {"query": 1}}]', "Error: search: argument"),
        ("mistral", '[TOOL_CALLS][{"name": "search", "arguments": ', "Error: tool call is not valid JSON"),
        ("mistral", "[TOOL_CALLS]search[ARGS]{bad}", "Error: tool call is not valid JSON"),
        ("mistral", "[TOOL_CALLS] nothing", "Error: [TOOL_CALLS] must be followed by a JSON list of calls"),
        (
            "harmony",
            '<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"query": ',
            "Error: tool call is not valid JSON",
        ),
        (
            "harmony",
            '<|channel|>commentary to=browser.open <|constrain|>json<|message|>{"id": 1}',
            "Error: unknown recipient 'browser.open': call tools as functions.NAME",
        ),
        (
            "harmony",
            "<|channel|>final<|message|>a<|end|><|start|>assistant<|channel|>commentary to=functions.search",
            "Error: a harmony message needs a header ending in <|message|>",
        ),
    ],
)
def test_malformed_calls_in_each_syntax_become_error_observations(fmt, text, expected):
    found = errors(text, fmt)
    assert any(error.startswith(expected) for error in found), found


def test_mistral_reads_both_the_list_and_the_args_form_and_ignores_call_ids():
    calls = get_call_format("mistral")
    listed = parse(
        '[TOOL_CALLS][{"name": "search", "arguments": {"query": "a"}, "id": "abc123xyz"}]',
        TOOLS,
        call_format=calls,
    )
    named = parse('[TOOL_CALLS]search[ARGS]{"query": "a"}', TOOLS, call_format=calls)
    assert listed.errors == named.errors == ()
    assert listed.calls == named.calls


def test_harmony_reads_the_call_after_reasoning_and_a_preamble_and_keeps_final_text():
    text = (
        "<|channel|>analysis<|message|>need to search<|end|><|start|>assistant<|channel|>commentary<|message|>"
        "Searching now.<|end|><|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json"
        '<|message|>{"query": "a"}'
    )
    turn = parse(text, TOOLS, call_format=get_call_format("harmony"))
    assert turn.errors == () and [c.name for c in turn.calls] == ["search"]
    assert turn.content == "Searching now."  # the analysis message is never the turn's text
    final = parse("<|channel|>final<|message|>Paris", TOOLS, call_format=get_call_format("harmony"))
    assert final.calls == () and final.content == "Paris"


@pytest.mark.parametrize("fmt", ["llama3", "mistral", "harmony"])
def test_a_call_in_another_models_format_is_an_error_naming_both(fmt):
    hermes_call = format_tool_call("search", {"query": "a"})
    (error,) = errors(f"Let me look. {hermes_call}", fmt)
    assert error.startswith(
        f"Error: this turn writes a tool call in the hermes format (<tool_call>...), but this model's calls are written in the {fmt} format: "
    )
    # never silently the answer: the turn has an error, so an environment does not end the episode on it


def test_llama3_reads_several_calls_joined_by_semicolons_and_counts_them():
    text = (
        '{"name": "search", "parameters": {"query": "a"}}; {"name": "answer", "parameters": {"answer": "b"}}'
    )
    turn = parse(text, TOOLS, call_format=get_call_format("llama3"), max_calls=1)
    assert [c.name for c in turn.calls] == ["search"]
    assert [e.observation() for e in turn.errors] == [
        "Error: too many tool calls in one turn (got 2, at most 1); only the first 1 ran"
    ]


def test_tools_prompts_describe_every_tool_in_the_familys_way():
    harmony = get_call_format("harmony").tools_prompt(SCHEMAS)
    assert "namespace functions {" in harmony and "type search = (_: {" in harmony
    assert "// what to look for\nquery: string,\nk?: number," in harmony
    llama = get_call_format("llama3").tools_prompt(SCHEMAS)
    assert '"parameters": dictionary of argument name' in llama and json.dumps(SCHEMAS[0], indent=4) in llama
    mistral = get_call_format("mistral").tools_prompt(SCHEMAS)
    assert json.dumps(SCHEMAS) in mistral and '[TOOL_CALLS][{"name": "search"' in mistral


def test_an_unknown_format_is_refused_with_did_you_mean():
    with pytest.raises(ConfigError, match="unknown call format 'lama3'. Did you mean 'llama3'?"):
        get_call_format("lama3")


def test_translate_rewrites_only_the_calls_of_assistant_turns():
    demo = [
        {"role": "user", "content": "Who wrote Hamlet?"},
        {"role": "assistant", "content": format_tool_call("search", {"query": "Hamlet"})},
        {"role": "assistant", "content": "plain text"},
    ]
    llama = translate_calls(demo, get_call_format("llama3"))
    assert llama[0] == demo[0] and llama[2] == demo[2]
    assert llama[1]["content"] == '{"name": "search", "parameters": {"query": "Hamlet"}}'
    assert translate_calls(demo, HERMES) == demo


class Lookup(ToolEnv):
    """One search tool and an answer tool; a worked example written in the default format."""

    def __init__(self) -> None:
        super().__init__(max_turns=3)
        self.tasks = [Task("t", "What is x?", "42")]

        class Exact:
            def score(self, task: Task, answer: object, trajectory: object) -> Score:
                return Score(float(answer == task.reference))

        self.verifier = Exact()

    async def episode_tools(self, task: Task) -> list[FunctionTool]:
        return [
            FunctionTool(
                "search", "the search tool", TOOLS["search"], fn=lambda query, k=1: f"x is 42 ({query})"
            ),
            FunctionTool("answer", "the answer tool", TOOLS["answer"], terminal=True),
        ]

    def demonstration(self, allowed_tools):
        return [
            {"role": "user", "content": "What is y?"},
            {"role": "assistant", "content": format_tool_call("search", {"query": "y"})},
        ]


@pytest.mark.parametrize("fmt", ["llama3", "mistral", "harmony"])
def test_an_environment_told_the_format_lists_shows_and_parses_in_it(fmt):
    syntax = get_call_format(fmt)
    env = Lookup()
    obs, info = env.reset(seed=0, options={"call_format": fmt})
    assert obs[0]["content"] == syntax.tools_prompt(info["tools"])
    assert obs[2]["content"] == syntax.format_call("search", {"query": "y"})
    obs, reward, terminated, _, _ = env.step(syntax.format_call("search", {"query": "x"}))
    assert obs == [{"role": "tool", "name": "search", "content": "x is 42 (x)"}] and not terminated
    obs, _, terminated, _, _ = env.step(
        format_tool_call("answer", {"answer": "42"})
    )  # hermes: not this model's
    assert not terminated and obs[0]["content"].startswith(
        "Error: this turn writes a tool call in the hermes format"
    )
    _, reward, terminated, _, _ = env.step(syntax.format_call("answer", {"answer": "42"}))
    assert terminated and reward == 1.0
    env.close()


def test_an_environment_refuses_an_unknown_call_format_at_reset():
    env = Lookup()
    with pytest.raises(ConfigError, match="unknown call format 'harmon'. Did you mean 'harmony'?"):
        env.reset(seed=0, options={"call_format": "harmon"})
    env.close()
