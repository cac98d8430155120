"""``toolgym.remote``, the old import path of :mod:`toolgym.serving.client` (the client of ``toolgym serve``): the same module (deprecated)."""

from __future__ import annotations

from toolgym.lazy import alias_module
from toolgym.serving.client import *  # noqa: F403  (what type checkers see; the module itself is toolgym.serving.client)

alias_module(__name__, "toolgym.serving.client")
