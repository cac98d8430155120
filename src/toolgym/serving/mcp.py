"""``toolgym mcp ENV_ID``: an environment's tools as an MCP server (stdio), for agents outside toolgym.

An MCP client (an IDE agent, another framework) lists the tools of one episode of the environment
(SearchQA's ``search``/``open`` over the local index, CodeExec's ``python`` in the hardened sandbox,
ArxivRefs' paper search) with their JSON schemas, and calls them. Every call is played as that
episode's own tool call (``step`` with the call as the assistant's turn), so a result is exactly the
observation a toolgym policy would see, errors included (``Error: ...`` results are flagged
``isError``). The terminal tool (``answer``/``submit``) is listed too: it scores the answer and
reports the reward.

The episode is reset on ``--task-id`` (default: the environment's first task) when the server starts,
and again whenever it ends (an answer, or the turn budget: pass ``--env-arg max_turns=N`` for a longer
one); state that lives in an episode, such as CodeExec's interpreter variables, lasts that long.
An infrastructure failure is an error result naming it; a verifier bug stops the server.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from toolgym.errors import InfraError, MissingDependencyError

__all__ = ["EpisodeTools", "mcp_command"]


class EpisodeTools:
    """One environment episode whose tools are called one at a time (what the MCP handlers use)."""

    def __init__(
        self, env_id: str, env_kwargs: Mapping[str, Any], *, task_id: str | None = None, seed: int = 0
    ) -> None:
        from toolgym.registry import make

        self.env = make(env_id, **dict(env_kwargs))
        self.base: Any = self.env.unwrapped
        self.options = {"task_id": task_id} if task_id else {}
        self.seed = seed
        self.episodes = 0
        self.schemas: list[dict[str, Any]] = []
        self.terminal: set[str] = set()

    async def start(self) -> None:
        _, info = await self.base.areset(seed=self.seed + self.episodes, options=self.options)
        self.episodes += 1
        self.schemas = [s["function"] for s in info["tools"]]
        self.terminal = {t.name for t in self.base.episode_tool_objects if t.terminal}

    async def call(self, name: str, arguments: Mapping[str, Any]) -> tuple[str, bool]:
        """The observation of calling ``name`` (``is_error`` when it is an ``Error: ...``)."""
        action = f"<tool_call>{json.dumps({'name': name, 'arguments': dict(arguments)})}</tool_call>"
        try:
            obs, reward, terminated, truncated, _ = await self.base.astep(action)
        except InfraError as exc:
            await self.start()
            return f"Error: infrastructure failure, the episode was restarted: {exc}", True
        texts = [str(m["content"]) for m in obs]
        if terminated:
            texts.append(f"answer scored: reward {reward:g}; a new episode started on the same task")
        elif truncated:
            texts.append("the episode's turn budget ran out; a new episode started (earlier state is gone)")
        if terminated or truncated:
            await self.start()
        text = "\n".join(texts)
        return text, text.startswith("Error:")

    def close(self) -> None:
        self.env.close()


def mcp_command(
    env_id: str, env_kwargs: Mapping[str, Any], *, task_id: str | None = None, seed: int = 0
) -> None:
    """Serve the tools over stdio until the client disconnects (``toolgym mcp``)."""
    try:
        import anyio
        import mcp_types as types
        from mcp.server.lowlevel import Server
        from mcp.server.stdio import stdio_server
    except ImportError as exc:
        raise MissingDependencyError("mcp", "mcp", "toolgym mcp") from exc
    episode = EpisodeTools(env_id, env_kwargs, task_id=task_id, seed=seed)

    async def list_tools(ctx: Any, params: Any) -> Any:
        return types.ListToolsResult(
            tools=[
                types.Tool(name=s["name"], description=s["description"], input_schema=s["parameters"])
                for s in episode.schemas
            ]
        )

    async def call_tool(ctx: Any, params: Any) -> Any:
        text, is_error = await episode.call(params.name, params.arguments or {})
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=is_error)

    server = Server(
        f"toolgym {env_id}",
        instructions=getattr(episode.base, "description", ""),
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )

    async def main() -> None:
        await episode.start()
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    try:
        anyio.run(main)
    finally:
        episode.close()
