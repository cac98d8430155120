"""MCP servers as toolgym tools: :func:`mcp_tools` connects to one and wraps each of its tools.

``mcp_tools(["python", "my_server.py"])`` starts the server as a subprocess (stdio transport);
``mcp_tools("http://host:port/mcp")`` connects over Streamable HTTP. The result is an
:class:`McpToolset`: its ``tools`` are :class:`~toolgym.core.Tool` objects with the server's names,
descriptions and input schemas (validated by toolgym before a call, like every tool's), ready to be
returned from an environment's ``episode_tools``. Close the toolset when the environment closes.

The connection lives on a private thread with its own event loop, so a tool can be called from any
event loop (the rollout loop's, or the private one of gymnasium's sync ``step``) and from several
episodes at once. Errors are mapped onto the error tree:

* a result the server flags ``isError`` is a :class:`~toolgym.errors.ToolCallError` (an ``Error: ...``
  observation the model can read and recover from);
* a call that does not answer within the tool's ``timeout`` is a :class:`~toolgym.errors.ToolTimeout`;
* a server that cannot be started or reached, or dies, is an :class:`~toolgym.errors.InfraError`
  (the environment retries, then marks the episode ``infra_error``);
* content that is not text (images, audio, resources) is shown as a one-line placeholder, never
  passed through as bytes.

Needs ``pip install 'toolgym[mcp]'``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from toolgym.errors import ConfigError, InfraError, MissingDependencyError, ToolCallError, ToolTimeout

CONNECTION_CLOSED, REQUEST_TIMEOUT = -32000, -32001  # JSON-RPC codes the MCP SDK uses

__all__ = ["McpTool", "McpToolset", "mcp_tools"]

DEFAULT_TIMEOUT = 30.0
_MAX_TEXT = 100_000


def _mcp() -> Any:
    try:
        import mcp
    except ImportError as exc:
        raise MissingDependencyError("mcp", "mcp", "MCP tools") from exc
    return mcp


def render_result(result: Any) -> str:
    """The text of an MCP tool result: text parts joined, anything else a placeholder."""
    parts = []
    for item in getattr(result, "content", None) or []:
        kind = getattr(item, "type", "?")
        if kind == "text":
            parts.append(str(item.text))
        else:
            mime = getattr(item, "mime_type", None) or getattr(item, "mimeType", None) or ""
            parts.append(f"[{kind} content{' ' + mime if mime else ''} not shown]")
    if not parts and getattr(result, "structured_content", None) is not None:
        import json

        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    text = "\n".join(parts)
    return (
        text
        if len(text) <= _MAX_TEXT
        else text[:_MAX_TEXT] + f"\n[... {len(text) - _MAX_TEXT} characters cut]"
    )


@dataclass(frozen=True)
class McpTool:
    """One tool of an MCP server, as a toolgym :class:`~toolgym.core.Tool`."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    toolset: McpToolset
    timeout: float = DEFAULT_TIMEOUT
    terminal: bool = False

    async def __call__(self, **arguments: Any) -> str:
        if self.toolset.broken:  # the server died earlier: start (or reach) it again, off this loop
            await asyncio.to_thread(self.toolset.reconnect)
        return await asyncio.wrap_future(self.toolset.submit(self.name, arguments, self.timeout))


class McpToolset:
    """A live connection to one MCP server and its tools (see the module docstring)."""

    def __init__(
        self,
        server: str | Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        env: dict[str, str] | None = None,
    ) -> None:
        mcp = _mcp()
        if isinstance(server, str) and server.startswith(("http://", "https://")):
            self.target: Any = server
        elif isinstance(server, str) or not server:
            raise ConfigError(
                f"an MCP server is a URL (http://host:port/mcp) or a command as a list (['python', 'server.py']), "
                f"got {server!r}"
            )
        else:
            from mcp.client.stdio import StdioServerParameters

            command = [str(part) for part in server]
            self.target = StdioServerParameters(command=command[0], args=command[1:], env=env)
        self.description = server if isinstance(server, str) else " ".join(map(str, server))
        self.timeout = timeout
        self._mcp = mcp
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="toolgym-mcp", daemon=True)
        self._thread.start()
        self._client: Any = None
        self._stop: asyncio.Event | None = None
        self._runner: Future[None] | None = None
        self._dead: BaseException | None = None
        self._lock = threading.Lock()
        self.broken = False
        self.tools: list[McpTool] = []
        try:
            self._connect()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ connection
    def _transport(self) -> Any:
        """What ``mcp.Client`` connects through: the URL, or a fresh stdio transport (one per connection;
        mcp 2.0's client takes no ``StdioServerParameters`` itself)."""
        if isinstance(self.target, str):
            return self.target
        from mcp.client.stdio import stdio_client

        return stdio_client(self.target)

    def _connect(self) -> None:
        ready: Future[list[Any]] = Future()

        async def hold() -> None:
            self._stop = asyncio.Event()
            try:
                async with self._mcp.Client(self._transport(), read_timeout_seconds=self.timeout) as client:
                    self._client = client
                    listed = await client.list_tools()
                    ready.set_result(list(listed.tools))
                    await self._stop.wait()
            except BaseException as exc:  # noqa: BLE001 - reported to the caller or to later calls
                self._dead = exc
                if not ready.done():
                    ready.set_exception(exc)
            finally:
                self._client = None

        self._runner = asyncio.run_coroutine_threadsafe(hold(), self._loop)
        try:
            listed = ready.result(timeout=max(self.timeout, 60.0))
        except FutureTimeout as exc:
            raise InfraError(f"MCP server {self.description} did not list its tools within 60 s") from exc
        except Exception as exc:
            raise InfraError(f"MCP server {self.description} could not be started or reached: {exc}") from exc
        names = [t.name for t in listed]
        if len(set(names)) != len(names):
            raise ConfigError(f"MCP server {self.description} lists a tool name twice: {names}")
        self.tools = [
            McpTool(
                name=t.name,
                description=t.description or t.title or t.name,
                parameters=dict(t.input_schema or {"type": "object", "properties": {}}),
                toolset=self,
                timeout=self.timeout,
            )
            for t in listed
        ]

    def submit(self, name: str, arguments: Mapping[str, Any], timeout: float) -> Future[str]:
        """Start one call on the connection's loop; its future holds the observation text."""
        if self._client is None:
            raise InfraError(f"MCP server {self.description} is not connected ({self._dead or 'closed'})")

        async def call() -> str:
            try:
                result = await asyncio.wait_for(self._client.call_tool(name, dict(arguments)), timeout)
            except TimeoutError as exc:
                raise ToolTimeout(f"no answer from the MCP server within {timeout:g} s", tool=name) from exc
            except self._mcp.MCPError as exc:
                if exc.code == CONNECTION_CLOSED:  # the server died: infrastructure, and reconnect next time
                    self.broken = True
                    raise InfraError(
                        f"MCP server {self.description} closed the connection during {name}"
                    ) from exc
                if exc.code == REQUEST_TIMEOUT:
                    raise ToolTimeout(
                        f"no answer from the MCP server within {timeout:g} s", tool=name
                    ) from exc
                raise ToolCallError(exc.message, tool=name) from exc  # refused: unknown tool, bad params
            except (ToolTimeout, ToolCallError):
                raise
            except Exception as exc:
                raise InfraError(
                    f"MCP server {self.description} failed: {type(exc).__name__}: {exc}"
                ) from exc
            try:
                text = render_result(result)
            except RecursionError:  # structured content nested past what can be written out
                raise InfraError(
                    f"MCP server {self.description} answered {name} with content nested too deeply to show"
                ) from None
            if getattr(result, "is_error", False):
                raise ToolCallError(text or "the tool reported an error", tool=name)
            return text

        return asyncio.run_coroutine_threadsafe(call(), self._loop)

    def reconnect(self) -> None:
        """Replace a connection whose server died (several callers at once reconnect once)."""
        with self._lock:
            if not self.broken:
                return
            self._disconnect()
            old = {t.name: t.parameters for t in self.tools}
            self._connect()
            if {t.name: t.parameters for t in self.tools} != old:
                raise InfraError(f"MCP server {self.description} came back with other tools than before")
            self.broken = False

    def _disconnect(self) -> None:
        if self._stop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._runner is not None:
            with contextlib.suppress(Exception):  # a dead connection is closed already
                self._runner.result(timeout=30)
            self._runner = None

    def close(self) -> None:
        """Disconnect (the stdio server process ends) and stop the thread. Idempotent."""
        self._disconnect()
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()

    def __enter__(self) -> McpToolset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def mcp_tools(
    server: str | Sequence[str], *, timeout: float = DEFAULT_TIMEOUT, env: dict[str, str] | None = None
) -> McpToolset:
    """Connect to an MCP server (a URL, or a command to start over stdio) and wrap its tools."""
    return McpToolset(server, timeout=timeout, env=env)
