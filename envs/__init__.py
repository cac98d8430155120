"""toolgym.envs: the environments (one module each, registered by :mod:`toolgym.registry`) and the checker.

:func:`check_env` is gymnasium's ``check_env`` plus toolgym's own contract checks; run it on every
environment you write (``toolgym new-env`` generates a test that does).
"""

from __future__ import annotations

from toolgym.envs.checker import EnvCheckError, check_env

__all__ = ["EnvCheckError", "check_env"]
