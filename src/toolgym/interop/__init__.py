"""Adapters that put toolgym environments inside other frameworks (each an optional extra).

* :mod:`toolgym.interop.openenv` — an environment as an OpenEnv ``Environment`` and server, driven by
  OpenEnv's own clients (``pip install 'toolgym[openenv]'``);
* :mod:`toolgym.interop.trl` — an environment as TRL ``GRPOTrainer``'s ``environment_factory``, with a
  dataset of its tasks (``pip install 'toolgym[trl]'``).

The environment server (``toolgym serve``) and MCP (``toolgym mcp``, :mod:`toolgym.tools.mcp`) are the
other two ways in and out.
"""
