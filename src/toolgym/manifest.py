"""``toolgym.manifest``, the old import path of :mod:`toolgym.records.manifest` (run manifests): the same module (kept)."""

from __future__ import annotations

from toolgym.lazy import alias_module
from toolgym.records.manifest import *  # noqa: F403  (what type checkers see; the module itself is toolgym.records.manifest)

alias_module(__name__, "toolgym.records.manifest", deprecated=False)
