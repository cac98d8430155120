"""toolgym.envs: the environments (one package each, registered by :mod:`toolgym.registry`) and the checker.

:func:`check_env` is gymnasium's ``check_env`` plus toolgym's own contract checks; run it on every
environment you write (``toolgym new-env`` generates a test that does). :class:`RemoteEnv` is an
environment served by ``toolgym serve`` on another process or machine (:mod:`toolgym.remote`).
"""

from __future__ import annotations

from toolgym.envs.checker import EnvCheckError, check_env
from toolgym.remote import RemoteEnv

__all__ = ["EnvCheckError", "RemoteEnv", "check_env"]
