"""toolgym's taskset for verifiers, under the module name verifiers looks up (``toolgym-verifiers``).

verifiers imports a taskset id as a module and takes the ``Taskset`` and ``Env`` subclasses it
exports; the adapter itself is :mod:`toolgym.interop.verifiers`.
"""

from toolgym.interop.verifiers import ToolgymEnv, ToolgymTaskset

__all__ = ["ToolgymEnv", "ToolgymTaskset"]
