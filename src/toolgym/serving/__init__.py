"""Environments across a process boundary: ``toolgym serve`` (HTTP), its client, and ``toolgym mcp``.

:mod:`~toolgym.serving.server` serves one environment over HTTP, one session per episode, behind the
request limits of :mod:`~toolgym.serving.guards`; :mod:`~toolgym.serving.client` is the environment a
URL id gives (``toolgym.make("http://host:port")``), which checks every reply against
:mod:`~toolgym.serving.protocol`; :mod:`~toolgym.serving.mcp` serves an environment's tools as an MCP
server. Only chat messages cross the wire: the caller builds tokens, masks and logprobs as in-process.
"""
