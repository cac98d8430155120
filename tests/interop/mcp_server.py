"""A small MCP server written with the ``mcp`` SDK, started by the tests over stdio.

Tools: ``add`` (numbers), ``lookup`` (a fixed table; unknown keys are tool errors), ``slow`` (sleeps),
``picture`` (image content, no text) and ``crash`` (kills the server process mid-call).
"""

from __future__ import annotations

import os
import time

from mcp.server.mcpserver import Image, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("toolgym-test")
TABLE = {"paris": "capital of France", "bern": "capital of Switzerland"}


@server.tool()
def add(a: float, b: float) -> str:
    """Add two numbers."""
    return str(a + b)


@server.tool()
def lookup(key: str) -> str:
    """Look a key up in the table."""
    if key.lower() not in TABLE:
        raise ToolError(f"no entry {key!r}")
    return TABLE[key.lower()]


@server.tool()
def slow(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "done"


@server.tool()
def picture() -> Image:
    """A one-pixel image."""
    return Image(data=b"\x89PNG\r\n\x1a\n", format="png")


@server.tool()
def crash() -> str:
    """End the server process without answering."""
    os._exit(3)


if __name__ == "__main__":
    server.run("stdio")
