"""The error tree every part of toolgym raises from.

Three families, and the rule that decides between them is *whose fault it is*:

* :class:`ToolError` — the model's fault (bad JSON, an unknown tool, a query that finds nothing to
  open). The environment turns it into an observation (``"Error: search: ..."``) and the episode
  goes on. Tools raise nothing else for the model's mistakes.
* :class:`InfraError` — not the model's fault (a container died, an index is corrupt). The episode is
  marked ``infra_error`` and is retried or dropped; it is never scored.
* :class:`ConfigError` — the user's configuration is wrong. Raised at start-up, with a fix-it hint and,
  for names, a "did you mean" suggestion.

Messages say what went wrong, what was expected versus what was got, and how to fix it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "BackendError",
    "ConfigError",
    "InfraError",
    "MissingDependencyError",
    "SandboxError",
    "ToolCallError",
    "ToolError",
    "ToolParseError",
    "ToolTimeout",
    "ToolgymError",
    "VerifierError",
    "did_you_mean",
]


class ToolgymError(Exception):
    """Root of every error toolgym raises on purpose."""


class ToolError(ToolgymError):
    """The model's mistake; becomes an ``Error: <tool>: <message>`` observation."""

    def __init__(self, message: str, *, tool: str | None = None) -> None:
        super().__init__(message)
        self.tool = tool

    def observation(self) -> str:
        """The text the model sees for this error."""
        prefix = f"Error: {self.tool}: " if self.tool else "Error: "
        return prefix + str(self)


class ToolParseError(ToolError):
    """Bad JSON, an unknown tool, or arguments that break the tool's JSON schema."""


class ToolCallError(ToolError):
    """A well-formed call that failed (no such document, the code raised, ...)."""


class ToolTimeout(ToolError):
    """The tool ran past its time limit."""


class InfraError(ToolgymError):
    """Not the model's fault: the trajectory is marked ``infra_error`` and never scored."""


class SandboxError(InfraError):
    """The code sandbox itself (container, engine) failed."""


class BackendError(InfraError):
    """A backing store (search index, paper store) is unavailable or corrupt."""


class ConfigError(ToolgymError):
    """Wrong configuration, unknown id or name: raised at start-up."""


class MissingDependencyError(ConfigError, ImportError):
    """An optional dependency is not installed; the message names the extra that provides it."""

    def __init__(self, package: str, extra: str, purpose: str) -> None:
        super().__init__(
            f"{purpose} needs the Python package {package!r}, which is not installed. "
            f"Fix: pip install 'toolgym[{extra}]'"
        )
        self.package = package
        self.extra = extra


class VerifierError(ToolgymError):
    """A verifier could not score an answer. Never converted into reward 0."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return ``" Did you mean 'x'?"`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""
