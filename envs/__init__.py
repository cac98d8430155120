"""toolgym.envs: the environments (one package each, registered by :mod:`toolgym.registry`) and the checker.

:func:`check_env` is gymnasium's ``check_env`` plus toolgym's own contract checks; run it on every
environment you write (``toolgym new-env`` generates a test that does). ``audit`` plays scripted
exploits against an environment (``toolgym audit-env``). :class:`ServedEnv` is an environment served
by ``toolgym serve`` on another process or machine (:mod:`toolgym.serving.client`; exported lazily,
so that this package does not import the serving layer).
"""

from __future__ import annotations

from toolgym.envs.checker import EnvCheckError, check_env
from toolgym.lazy import lazy_exports

_EXPORTS = {"ServedEnv": "toolgym.serving.client"}
__all__ = ["EnvCheckError", "ServedEnv", "check_env"]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
