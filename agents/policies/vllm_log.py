"""The log of a vLLM engine toolgym starts: real problems on the console, the whole of it in a file.

Left to itself, vLLM writes about a hundred lines for one training run: its configuration at INFO,
start-up notices at WARNING that toolgym's own deliberate settings cause (eager mode, chunked prefill
off and every core serving on CPU), a "Failed to load weights" warning for two layers at every weight
sync, and third-party ``FutureWarning``\\ s. A :class:`~toolgym.agents.policies.vllm.VLLMPolicy` hands
every engine process (vLLM's ``LoggingConfig.pylogging_config_file``, applied in the engine core and its
workers alike) the logging configuration of :func:`engine_log_config`:

* **the console** gets WARNING and above (INFO and above when toolgym itself logs INFO: ``toolgym -v``),
  less the :data:`NOTICES` below: each is a known message with the reason it is not a problem here,
  demoted to INFO by :class:`Notices` (so ``-v`` still shows it, with its reason);
* **the log file** (a training run's ``engine.log``, an evaluation's ``OUT/engine.log``) gets everything
  at INFO and above, the demoted notices with their reasons, appended, never through a link
  (:class:`EngineLogFile`).

The weight-reload warnings are demoted where they happen, in the worker's reload
(:mod:`toolgym.agents.policies.vllm_weights`, :func:`reload_notices`), and only for the layers that hold
no weights of the checkpoint's: the rotary embedding (its cos/sin table is computed, and put back
unchanged) and a *tied* output head (toolgym points it at the freshly loaded embedding right after).
The same message for any other layer stays a warning: that is a layer that kept its old weights. That
what is demoted is benign is tested the way it matters: after a reload that demoted both, the engine's
log-probabilities equal the learner's.

A user who configures vLLM's logging themselves (``VLLM_LOGGING_CONFIG_PATH``,
``VLLM_CONFIGURE_LOGGING=0``, or ``logging_config`` / ``log_config_file`` in ``engine_kwargs``) keeps
theirs: toolgym then configures nothing.

This module imports nothing of vLLM's: the engine processes import it when they apply the configuration.
"""

from __future__ import annotations

import contextlib
import json
import logging
import logging.config
import os
import re
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolgym.run_files import open_append

__all__ = [
    "ENGINE_LOG",
    "NOTICES",
    "QUIET_WARNINGS",
    "RELOAD_LOGGER",
    "EngineLogFile",
    "Notice",
    "Notices",
    "console_level",
    "demoted_on",
    "engine_log_config",
    "python_warnings",
    "reload_notices",
    "user_configures_logging",
    "written_config",
]

#: The name of an engine's log in a training run's or an evaluation's directory.
ENGINE_LOG = "engine.log"
#: vLLM's own line format (process, pid, level, time, source line, message).
LINE_FORMAT = (
    "(%(processName)s pid=%(process)d) %(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
)
DATE_FORMAT = "%m-%d %H:%M:%S"


@dataclass(frozen=True)
class Notice:
    """A message vLLM logs at WARNING that is not a problem for toolgym's engines, and why."""

    starts: str  # the message's start (matched on the formatted message)
    reason: str


#: The start-up notices toolgym's own engine settings cause. Each is demoted to INFO with its reason.
NOTICES: tuple[Notice, ...] = (
    Notice(
        "This model does not officially support disabling chunked prefill",
        "toolgym turns chunked prefill off on CPU: vLLM cannot resume a seeded request's sampler "
        "after a chunked prefill there (VLLMPolicy)",
    ),
    Notice("Enforce eager set", "eager mode is toolgym's CPU default: compiling costs minutes there"),
    Notice("Inductor compilation was disabled", "eager mode is toolgym's CPU default"),
    Notice("Model Runner V2 requires Triton", "vLLM's CPU build runs its V1 model runner"),
    Notice("Triton is not installed", "vLLM's CPU build serves without triton-cpu"),
    Notice("Triton is installed, but doesn't include CPU backend", "vLLM's CPU build serves without it"),
    Notice("Reset SSM cache type", "concerns state-space models only"),
    Notice(
        "OMP_NUM_THREADS=",
        "vLLM's CPU build sets OMP_NUM_THREADS itself for its worker (the cores it binds) and then "
        "warns that it is set",
    ),
    Notice(
        "VLLM_CPU_NUM_OF_RESERVED_CPU is less than the minimum",
        "toolgym serves on every core on purpose (policy.cpu_reserved = 0: 1.66x the episodes/min on "
        "2 cores)",
    ),
    Notice(
        "[shutdown] Process manager: force killing",
        "vLLM's CPU worker does not leave within vLLM's 5 s grace at a close, so vLLM kills the "
        "engine's processes; toolgym checks that none is left running",
    ),
    Notice("[shutdown] force killing sub process", "the same close: the worker goes with the engine core"),
)

#: The weight-reload warnings of layers without checkpoint weights of their own (module docstring).
ROTARY = Notice(
    "RotaryEmbedding: Failed to load weights",
    "the rotary embedding's cos/sin table is computed from the config, not loaded; it is put back unchanged",
)
TIED_HEAD = Notice(
    "ParallelLMHead: Failed to load weights",
    "the output head is tied to the embedding; toolgym points it at the freshly loaded embedding",
)
#: vLLM's logger of the layerwise weight reload.
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"

#: Third-party warnings toolgym cannot act on, by category and the module they are reported from:
#: vLLM's CPU build touches the deprecated ``torch.distributed.reduce_op`` while scanning modules.
QUIET_WARNINGS: tuple[tuple[type[Warning], str], ...] = ((FutureWarning, "vllm.triton_utils.dispatcher"),)


def demote(record: logging.LogRecord, reason: str) -> None:
    """Make ``record`` an INFO line that carries ``reason``."""
    record.msg = f"{record.getMessage()} [not a problem: {reason}]"
    record.args = None
    record.levelno = logging.INFO
    record.levelname = logging.getLevelName(logging.INFO)


class Notices(logging.Filter):
    """Demote the known messages of ``notices`` (default :data:`NOTICES`) to INFO, with their reason.

    As a handler's filter it sees every record the handler gets, whichever logger it came from; a
    demoted record then passes the handlers whose level lets INFO through. ``demoted`` counts them.
    """

    def __init__(self, notices: tuple[Notice, ...] = NOTICES) -> None:
        super().__init__()
        self.notices = notices
        self.demoted = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING:
            message = record.getMessage()
            for notice in self.notices:
                if message.startswith(notice.starts):
                    demote(record, notice.reason)
                    self.demoted += 1
                    break
        return True


class _AtLeast(logging.Filter):
    """Pass the records at ``level`` or above: a handler's level is checked *before* its filters, so a
    record a filter demotes needs this second check."""

    def __init__(self, level: str) -> None:
        super().__init__()
        self.level = logging.getLevelName(level)

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


class EngineLogFile(logging.FileHandler):
    """A ``FileHandler`` that appends to its file and never writes through a link planted at its name."""

    def __init__(self, filename: str) -> None:
        super().__init__(filename, mode="a", encoding="utf-8")

    def _open(self) -> Any:
        return open_append(self.baseFilename)


def console_level() -> str:
    """WARNING, or INFO when toolgym's own logger shows INFO (``toolgym -v``)."""
    return "INFO" if logging.getLogger("toolgym").isEnabledFor(logging.INFO) else "WARNING"


def engine_log_config(log_file: str | Path | None, level: str, stream: str) -> dict[str, Any]:
    """The ``logging.config.dictConfig`` of every engine process (module docstring).

    Args:
        log_file: the file that gets the whole log at INFO and above, or ``None`` (none kept).
        level: the console's level (``WARNING``; ``INFO`` shows everything the file gets).
        stream: the console stream (vLLM's ``VLLM_LOGGING_STREAM``: ``ext://sys.stdout``).
    """
    module = __name__
    handlers: dict[str, Any] = {
        "console": {
            "class": "logging.StreamHandler",
            "stream": stream,
            "formatter": "line",
            "filters": ["notices", "console_level"],
        }
    }
    if log_file is not None:
        handlers["file"] = {
            "()": f"{module}.EngineLogFile",
            "filename": str(Path(log_file).absolute()),
            "formatter": "line",
            "filters": ["notices"],
        }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"line": {"format": LINE_FORMAT, "datefmt": DATE_FORMAT}},
        "filters": {
            "notices": {"()": f"{module}.Notices"},
            "console_level": {"()": f"{module}._AtLeast", "level": level},
        },
        "handlers": handlers,
        "loggers": {"vllm": {"handlers": list(handlers), "level": "INFO", "propagate": False}},
    }


def user_configures_logging(engine_kwargs: Mapping[str, Any]) -> bool:
    """True when the user set vLLM's logging up themselves (module docstring): toolgym then stays out."""
    if {"logging_config", "log_config_file"} & set(engine_kwargs):
        return True
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH"):
        return True
    return os.environ.get("VLLM_CONFIGURE_LOGGING", "1").strip().lower() in ("0", "false")


@contextlib.contextmanager
def written_config(config: Mapping[str, Any]) -> Iterator[str]:
    """``config`` in a private temporary JSON file for the engine's processes; removed on exit.

    The configuration is applied in this process too, before vLLM is imported here, so the notices
    vLLM logs while it imports are demoted as well; vLLM applies the file again as it starts.
    """
    handle, name = tempfile.mkstemp(prefix="toolgym-vllm-logging-", suffix=".json")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as fh:
            json.dump(config, fh)
        logging.config.dictConfig(dict(config))
        for category, module in QUIET_WARNINGS:  # this process; the engine's: python_warnings()
            warnings.filterwarnings("ignore", category=category, module=re.escape(module) + r"\Z")
        yield name
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def python_warnings(current: str | None) -> str:
    """``PYTHONWARNINGS`` for the engine processes: ``current`` (the user's, kept) plus :data:`QUIET_WARNINGS`."""
    ours = [f"ignore::{category.__name__}:{module}" for category, module in QUIET_WARNINGS]
    return ",".join([current, *ours] if current else ours)


def reload_notices(tied_head: bool) -> tuple[Notice, ...]:
    """The reload warnings that are benign for a model: the rotary embedding's, the head's when tied."""
    return (ROTARY, TIED_HEAD) if tied_head else (ROTARY,)


@contextlib.contextmanager
def demoted_on(logger_name: str, notices: tuple[Notice, ...]) -> Iterator[Notices]:
    """While inside, records of ``notices`` logged on ``logger_name`` itself are demoted (counted)."""
    notice_filter = Notices(notices)
    target = logging.getLogger(logger_name)
    target.addFilter(notice_filter)
    try:
        yield notice_filter
    finally:
        target.removeFilter(notice_filter)
