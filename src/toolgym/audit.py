"""``toolgym.audit``, the old import path of :mod:`toolgym.envs.audit` (the exploit audit): the same module (deprecated)."""

from __future__ import annotations

from toolgym.envs.audit import *  # noqa: F403  (what type checkers see; the module itself is toolgym.envs.audit)
from toolgym.lazy import alias_module

alias_module(__name__, "toolgym.envs.audit")
