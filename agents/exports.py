"""``toolgym.agents.exports``, the old import path of :mod:`toolgym.agents.run_exports` (a training run's
inference exports): the same module (kept)."""

from __future__ import annotations

from toolgym.agents.run_exports import *  # noqa: F403  (what type checkers see; the module itself is run_exports)
from toolgym.lazy import alias_module

alias_module(__name__, "toolgym.agents.run_exports", deprecated=False)
