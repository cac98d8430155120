"""The error tree every part of toolgym raises from, and the rule that sorts failures into it.

The rule is *whose fault it is*, and each answer has exactly one handling:

* **The model's** (bad JSON, an unknown tool, a query that finds nothing, a call past its time
  limit): :class:`ToolError` (:class:`ToolParseError`, :class:`ToolCallError`, :class:`ToolTimeout`).
  The environment turns it into an observation (``"Error: search: ..."``) and the episode goes on.
* **The candidate's** (submitted code that crashes, loops, floods its output or kills its own test
  runner): no exception at all. The sandbox reports it as flags on its result and the verifier turns
  it into the candidate's score (failed tests, with the metric that says why).
* **The infrastructure's** (the Docker engine or a container died, an index is corrupt, a
  verification could not run, the policy's server or engine is gone): :class:`InfraError`
  (:class:`SandboxError`, :class:`BackendError`, :class:`VerificationUnavailable`,
  :class:`PolicyError`). A tool call or verifier call that raises one is retried a bounded number of
  times with back-off at the environment boundary; then the episode ends as an ``infra_error``
  trajectory, which is never scored, never trained on, and counted (``env/infra_errors``).
* **Ours** (a bug, a verifier bug, a wrong configuration): :class:`VerifierError`, any exception
  outside this tree, and :class:`ConfigError` (at start-up, with a fix-it hint and "did you mean").
  These raise: retrying cannot help, and scoring around them would hide them.

A run that cannot go on raises :class:`RunStopped` with a message saying why and how to resume:
:class:`InfraDown` when the infrastructure stays down (too many consecutive groups of episodes were
all ``infra_error``), :class:`CheckpointError` when the run directory refuses writes; the
data-parallel learner raises it when a learner process dies (naming the rank and its signal or exit
code) and, as ``toolgym.training.distributed.learners.LearnersDiverged``, when the learners' weights differ (a
bug). Rerunning the same command resumes from the last checkpoint, losing nothing and counting
nothing twice.

Where each exception type is placed (each in exactly one of the four families above):

* Sandbox (``toolgym.tools.sandbox``): ``SandboxUnavailable`` (no engine, no image) and
  ``SandboxError`` (a container could not start, an exec failed, a container died) are infra. The
  sandbox translates the docker SDK's own errors into these; one that leaks out untranslated is a bug.
* Index and paper store: ``BackendError`` (missing, truncated or corrupt files) is infra; an id the
  index does not hold (``UnknownDocument``) is a :class:`ToolCallError`, the model's.
* Verifier: :class:`VerifierError` is a verifier *bug* (a harness error, test data that cannot run)
  and raises; never reward 0. A verification that could not run because the infrastructure under it
  failed (its sandbox container died, the engine is down) is infra: a verifier raises an
  :class:`InfraError` for it, and the environment retries the call and, when the retries run out,
  raises :class:`VerificationUnavailable`.
* Policy: :class:`PolicyError` is raised at the policy boundary when its infrastructure fails (an HTTP
  server unreachable or answering 5xx after its own retries, a vLLM engine process that died). The
  rollout turns it into an ``infra_error`` trajectory. A request the server refuses (4xx), a closed
  policy or bad sampling parameters are :class:`ConfigError`; an in-process transformers policy has no
  infrastructure of its own, so its exceptions are bugs.
* Ray environment actors: an actor that died mid-episode is an :class:`InfraError`.
* Served environments (``toolgym.serving.client``): a server that cannot be reached, misses a request's
  deadline, or answers outside the protocol (wrong types, a non-finite reward, an oversized reply)
  is an :class:`InfraError`; the environment's own errors arrive as themselves, a request the server
  refuses is a :class:`ConfigError`, and a bug of the served environment or its verifier (an
  exception outside this tree, on the server) is ``ServedEnvError``, a :class:`VerifierError`.

Messages say what went wrong, what was expected versus what was got, and how to fix it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "BackendError",
    "CheckpointError",
    "ConfigError",
    "InfraDown",
    "InfraError",
    "MissingDependencyError",
    "PolicyError",
    "RunStopped",
    "SandboxError",
    "ToolCallError",
    "ToolError",
    "ToolParseError",
    "ToolTimeout",
    "ToolgymError",
    "VerificationUnavailable",
    "VerifierError",
    "check_choice",
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
    """Not the model's fault: retried at the environment boundary, then the trajectory is ``infra_error``.

    Attributes:
        episode_metrics: the environment's metrics of the episode so far (``env/infra_retries``
            included), attached by the environment when it gives up, so that the ``infra_error``
            trajectory still records them. Empty when the error did not come through an environment.
    """

    episode_metrics: dict[str, float]

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.episode_metrics = {}


class SandboxError(InfraError):
    """The code sandbox itself (container, engine) failed."""


class BackendError(InfraError):
    """A backing store (search index, paper store) is unavailable or corrupt."""


class PolicyError(InfraError):
    """The policy's infrastructure failed: its server is unreachable, its engine process died.

    Raised by the policy itself (not the rollout), because only the policy knows which of its
    failures are infrastructure and which are bugs or configuration mistakes.
    """


class VerificationUnavailable(InfraError):
    """A verification could not run for infrastructure reasons (not a verifier bug).

    The environment raises it after retrying a verifier call that kept raising an :class:`InfraError`;
    the original error is its ``__cause__``. Contrast :class:`VerifierError`, a bug, which raises at once.
    """


class RunStopped(ToolgymError):
    """A training run cannot go on; the message says why and how to resume from its last checkpoint."""


class InfraDown(RunStopped):
    """The infrastructure stayed down: too many consecutive groups of episodes were all ``infra_error``."""


class CheckpointError(RunStopped):
    """A checkpoint could not be written or read (disk full, read-only, a corrupt file)."""


class ConfigError(ToolgymError):
    """Wrong configuration, unknown id or name: raised at start-up."""


class MissingDependencyError(ConfigError, ImportError):
    """A dependency is not installed; the message names the extra that provides it.

    ``extra=None`` is a package toolgym's own dependencies need (``attrs`` under ``jsonschema``): the fix
    is to install it, or to reinstall toolgym so that pip brings it.
    """

    def __init__(self, package: str, extra: str | None, purpose: str) -> None:
        fix = (
            f"pip install 'toolgym[{extra}]'"
            if extra
            else f"pip install {package} (or reinstall toolgym, whose dependencies need it)"
        )
        super().__init__(
            f"{purpose} needs the Python package {package!r}, which is not installed. Fix: {fix}"
        )
        self.package = package
        self.extra = extra

    @classmethod
    def from_import_error(cls, exc: ImportError, purpose: str) -> MissingDependencyError:
        """The error for an import that failed under ``purpose`` (the package named by ``exc``).

        A missing package is never the model's mistake: code that catches an ``ImportError`` on the
        model's path (the parser, a tool call) raises this instead of showing the model an error.
        """
        if isinstance(exc, MissingDependencyError):
            return exc
        name = (exc.name or str(exc) or "unknown").split(".")[0]
        return cls(name, None, purpose)


class VerifierError(ToolgymError):
    """A verifier bug: it could not score an answer for a reason of its own. Never reward 0; raises.

    A served environment's bug (its environment or verifier raised outside this tree, on the server)
    arrives as ``ServedEnvError``, a subclass.

    Not an :class:`InfraError`: retrying a bug cannot help, and scoring around it would hide it. A
    verification that failed because its infrastructure did is :class:`VerificationUnavailable`.
    """


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return ``" Did you mean 'x'?"`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""


def check_choice(setting: str, value: object, choices: Iterable[str]) -> None:
    """Raise :class:`ConfigError` unless ``value`` is one of ``choices``: the one message for every
    enumerated setting ("``setting`` must be one of a, b, got 'x'. Did you mean 'a'?")."""
    options = list(choices)
    if value not in options:
        hint = did_you_mean(value, options) if isinstance(value, str) else ""
        raise ConfigError(f"{setting} must be one of {', '.join(options)}, got {value!r}.{hint}")
