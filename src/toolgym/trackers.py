"""``toolgym.trackers``, the old import path of :mod:`toolgym.records.trackers` (TensorBoard and W&B copies of a run): the same module (kept)."""

from __future__ import annotations

from toolgym.lazy import alias_module
from toolgym.records.trackers import *  # noqa: F403  (what type checkers see; the module itself is toolgym.records.trackers)

alias_module(__name__, "toolgym.records.trackers", deprecated=False)
