"""MCP both ways: a real MCP server's tools inside a toolgym environment, and an environment's tools
served over MCP (checked against the golden trace)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from golden import golden_path

from toolgym.agents.harness import get_harness
from toolgym.agents.policies.base import ScriptedPolicy
from toolgym.agents.rollout import run_episode
from toolgym.core import FunctionTool, Message, Score, Task, Tool
from toolgym.env import ToolEnv
from toolgym.errors import ConfigError, InfraError, ToolCallError, ToolTimeout
from toolgym.tools.mcp import McpToolset, mcp_tools

SERVER = [sys.executable, str(Path(__file__).with_name("mcp_server.py"))]


@pytest.fixture(scope="module")
def toolset() -> Iterator[McpToolset]:
    with mcp_tools(SERVER, timeout=3) as tools:
        yield tools


def by_name(toolset: McpToolset) -> dict[str, Tool]:
    return {t.name: t for t in toolset.tools}


async def test_an_mcp_servers_tools_become_toolgym_tools(toolset: McpToolset) -> None:
    tools = by_name(toolset)
    assert sorted(tools) == ["add", "crash", "lookup", "picture", "slow"]
    assert (
        tools["add"].parameters["required"] == ["a", "b"] and tools["add"].description == "Add two numbers."
    )
    assert await tools["add"](a=1, b=2.5) == "3.5"
    assert await tools["lookup"](key="Paris") == "capital of France"
    with pytest.raises(ToolCallError, match="no entry 'zurich'"):
        await tools["lookup"](key="zurich")
    assert await tools["picture"]() == "[image content image/png not shown]"
    with pytest.raises(ToolTimeout, match="within 3 s"):
        await tools["slow"](seconds=30)


async def test_a_server_that_dies_is_an_infra_error_and_comes_back(toolset: McpToolset) -> None:
    tools = by_name(toolset)
    with pytest.raises(InfraError, match="closed the connection"):
        await tools["crash"]()
    assert toolset.broken
    assert await tools["add"](a=2, b=2) == "4.0"  # started again on the next call
    assert not toolset.broken


def test_bad_servers_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="a URL .* or a command as a list"):
        mcp_tools("python server.py")
    with pytest.raises(InfraError, match="could not be started or reached"):
        mcp_tools([sys.executable, "-c", "print('not an MCP server')"], timeout=3)


class Verifier:
    def score(self, task: Task, answer: object, trajectory: Sequence[Message]) -> Score:
        return Score(reward=float(str(answer).strip() == task.reference))


class MCPCalcEnv(ToolEnv):
    """The environments.md example: an environment around an existing MCP server, in a few lines."""

    def __init__(self, toolset: McpToolset) -> None:
        super().__init__(max_turns=4)
        self.toolset = toolset
        self.tasks = [Task(id="sum", prompt="What is 19.5 + 22.5? Use the add tool.", reference="42.0")]
        self.verifier = Verifier()

    async def episode_tools(self, task: Task) -> Sequence[Tool]:
        answer = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
        return [*self.toolset.tools, FunctionTool("answer", "Give the answer.", answer, terminal=True)]


async def test_an_environment_written_around_an_mcp_server(toolset: McpToolset) -> None:
    turns = [
        '<tool_call>{"name": "add", "arguments": {"a": 19.5}}</tool_call>',  # schema violation
        '<tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>',  # the tool's own error
        '<tool_call>{"name": "add", "arguments": {"a": 19.5, "b": 22.5}}</tool_call>',
        '<tool_call>{"name": "answer", "arguments": {"answer": "42.0"}}</tool_call>',
    ]
    trajectory = await run_episode(MCPCalcEnv(toolset), ScriptedPolicy(turns), get_harness("bare"), seed=0)
    tool_text = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert tool_text[0].startswith("Error: add: ") and "'b'" in tool_text[0]
    assert tool_text[1].startswith("Error: lookup: ") and tool_text[1].endswith("no entry 'x'")
    assert tool_text[2] == "42.0"
    assert trajectory.reward == 1.0 and trajectory.status == "ok"


async def test_an_environments_tools_served_over_mcp_match_the_golden_trace() -> None:
    """`toolgym mcp` driven by the real MCP client: every tool result is the golden observation."""
    first, errors = json.loads(golden_path("toolgym/SearchQA-v0").read_text())[:2]
    task_id = first["reset"]["info"]["task_id"]
    command = [sys.executable, "-m", "toolgym.cli", "mcp", "toolgym/SearchQA-v0", "--task-id", task_id]
    with mcp_tools(command, timeout=60) as served:
        native = {t["function"]["name"]: t["function"]["parameters"] for t in first["reset"]["info"]["tools"]}
        assert {t.name: t.parameters for t in served.tools} == native  # answer, open, search
        tools = by_name(served)
        compared = 0
        for step in [*first["steps"], *errors["steps"]]:
            try:
                call = json.loads(step["action"].removeprefix("<tool_call>").removesuffix("</tool_call>"))
            except json.JSONDecodeError:
                continue  # a malformed call or a plain-text turn has no MCP form
            if call["name"] not in tools or not step["observation"]:
                continue  # an unknown tool is refused by the MCP client; a terminal call has no observation
            want = step["observation"][0]["content"]
            if want.startswith("Error:"):
                with pytest.raises(ToolCallError) as err:
                    await tools[call["name"]](**call["arguments"])
                assert str(err.value) == want
            else:
                assert await tools[call["name"]](**call["arguments"]) == want
            compared += 1
        assert compared == 2  # the search result of the first episode, the type error of the second
        assert await tools["answer"](answer="308") == (
            "answer scored: reward 1; a new episode started on the same task"
        )


async def test_a_result_nested_too_deeply_to_show_is_an_infra_error(toolset: McpToolset, monkeypatch) -> None:
    """What a server answers is someone else's JSON: content too deep to write out is the server's fault
    (``InfraError``, the episode's ``infra_error``), never a raw ``RecursionError`` that ends the run."""
    import toolgym.tools.mcp as mcp_module

    deep: list = []
    for _ in range(100_000):
        deep = [deep]

    class Deep:
        content: list = []
        structured_content = deep
        is_error = False

    render = mcp_module.render_result  # the real renderer, given the server's answer replaced by a deep one
    monkeypatch.setattr(mcp_module, "render_result", lambda result: render(Deep()))
    with pytest.raises(InfraError, match="nested too deeply to show"):
        await by_name(toolset)["add"](a=1, b=2)
