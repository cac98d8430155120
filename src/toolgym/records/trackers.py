"""Experiment trackers: a run's metrics, config and trajectories also sent to TensorBoard or W&B.

The run directory's own files (``metrics.jsonl``, ``trajectories.jsonl``, ``eval.json``,
``report.html``) stay the record and need nothing installed; a tracker is a copy for the tools labs
already watch. ``toolgym train --logger tensorboard,wandb`` (config key ``train.loggers``) and
``toolgym eval --out DIR --logger ...`` open them:

* ``tensorboard`` writes event files to ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR``):
  one scalar series per metric, the config as a JSON text, and trajectory tables as Markdown text
  (TensorBoard has no table type). Needs the ``tensorboard`` package (``pip install
  'toolgym[tensorboard]'``).
* ``wandb`` logs an offline Weights & Biases run under ``RUN_DIR/wandb`` (``wandb sync`` uploads it
  later; ``WANDB_MODE=online`` logs live instead), with the config, one history row per step and
  trajectories as ``wandb.Table``. ``WANDB_PROJECT`` names the project (default ``toolgym``). Needs
  ``pip install 'toolgym[wandb]'``.

A tracker's name is checked, and its package imported, when the run starts: an unknown name or a
missing package is a :class:`~toolgym.errors.ConfigError` naming the extra, before any work. A
tracker that fails later (a full disk, a crashed W&B service) is reported once and dropped: the run
goes on and its own files lose nothing. A resumed run continues the same trackers: the TensorBoard
writer drops the events of steps it logs again (``purge_step``) and the W&B run keeps its id
(``RUN_DIR/wandb/toolgym-run-id``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from toolgym.core import Trajectory
from toolgym.errors import ConfigError, MissingDependencyError, did_you_mean
from toolgym.run_files import refuse_link, run_folder, write_atomic

__all__ = [
    "TRACKERS",
    "Tracker",
    "Trackers",
    "check_trackers",
    "open_trackers",
    "parse_trackers",
    "trajectory_rows",
]

log = logging.getLogger(__name__)

# name -> (modules it imports, the extra that installs them)
TRACKERS: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorboard": (("tensorboard",), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
}
TRAJECTORY_COLUMNS = ("task_id", "harness", "reward", "status", "turns", "conversation")
_CELL_CHARS = 4000  # a conversation cell keeps its first and last characters


class Tracker(Protocol):
    """What a tracker receives; every method may raise (:class:`Trackers` contains it)."""

    def log_config(self, config: Mapping[str, Any]) -> None: ...

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_table(
        self, name: str, step: int, columns: Sequence[str], rows: Sequence[Sequence[Any]]
    ) -> None: ...

    def close(self) -> None: ...


def parse_trackers(text: str | Iterable[str]) -> tuple[str, ...]:
    """``"tensorboard,wandb"`` (or a list) as a checked tuple of tracker names, duplicates dropped."""
    items = text.split(",") if isinstance(text, str) else list(text)
    names: list[str] = []
    for raw in items:
        name = str(raw).strip().lower()
        if not name or name in names:
            continue
        if name not in TRACKERS:
            raise ConfigError(
                f"unknown logger {name!r}.{did_you_mean(name, TRACKERS)} Known loggers: "
                f"{', '.join(TRACKERS)} (the run's own files and report need none)"
            )
        names.append(name)
    return tuple(names)


def check_trackers(names: Iterable[str]) -> None:
    """Refuse a tracker whose package cannot be imported (:class:`MissingDependencyError`, naming the extra)."""
    for name in parse_trackers(list(names)):
        modules, extra = TRACKERS[name]
        for module in modules:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise MissingDependencyError(
                    module.split(".")[0], extra, f"logger {name!r} (drop it from the loggers if unwanted)"
                ) from exc


def open_trackers(
    names: Iterable[str], run_dir: str | Path, *, config: Mapping[str, Any], kind: str
) -> Trackers:
    """Check and open the named trackers for ``run_dir`` (a ``train`` or ``eval`` run) and log ``config``."""
    names = parse_trackers(list(names))
    check_trackers(names)
    run_dir = Path(run_dir)
    opened: list[tuple[str, Tracker]] = []
    try:
        for name in names:
            tracker: Tracker = (
                _TensorBoard(run_dir) if name == "tensorboard" else _Wandb(run_dir, config=config, kind=kind)
            )
            opened.append((name, tracker))
    except Exception as exc:
        for _, tracker in opened:
            tracker.close()
        raise ConfigError(f"could not open logger {name!r} in {run_dir}: {exc}") from exc
    trackers = Trackers(opened)
    trackers.log_config(config)
    return trackers


class Trackers:
    """Several trackers behind one call; one that raises is reported once and dropped."""

    def __init__(self, trackers: Sequence[tuple[str, Tracker]] = ()) -> None:
        self._trackers = dict(trackers)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._trackers)

    def __bool__(self) -> bool:
        return bool(self._trackers)

    def _each(self, method: str, *args: Any) -> None:
        for name, tracker in list(self._trackers.items()):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:  # a tracker must never stop the run
                log.warning(
                    "logger %r failed (%s: %s) and is dropped for the rest of the run; the run directory's "
                    "own files are complete",
                    name,
                    type(exc).__name__,
                    exc,
                )
                del self._trackers[name]
                with contextlib.suppress(Exception):  # already reported; closing is best effort
                    tracker.close()

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._each("log_config", config)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self._each("log_metrics", step, metrics)

    def log_table(self, name: str, step: int, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self._each("log_table", name, step, columns, rows)

    def close(self) -> None:
        """Flush and close every tracker (idempotent)."""
        self._each("close")
        self._trackers.clear()


def trajectory_rows(
    trajectories: Sequence[Trajectory], extra: Sequence[Mapping[str, Any]] | None = None
) -> tuple[list[str], list[list[Any]]]:
    """Columns and rows of a trajectory table: :data:`TRAJECTORY_COLUMNS` after ``extra``'s keys."""
    extra = extra or [{} for _ in trajectories]
    keys = list(extra[0]) if extra else []
    rows = []
    for t, more in zip(trajectories, extra, strict=True):
        text = "\n".join(f"[{m.get('role', '?')}] {m.get('content', '')}" for m in t.messages)
        if len(text) > _CELL_CHARS:
            half = _CELL_CHARS // 2
            text = f"{text[:half]}\n[... {len(text) - _CELL_CHARS} characters ...]\n{text[-half:]}"
        turns = t.metrics.get("env/turns", 0.0)
        rows.append([*(more[k] for k in keys), t.task_id, t.harness, t.reward, t.status, turns, text])
    return [*keys, *TRAJECTORY_COLUMNS], rows


# ----------------------------------------------------------------------------- the trackers
class _TensorBoard:
    """Event files in ``RUN_DIR/tensorboard``, written with the ``tensorboard`` package's own event
    writer and protos (no deep-learning framework needed); the file opens at the first step logged."""

    def __init__(self, run_dir: Path) -> None:
        self.log_dir = run_dir / "tensorboard"
        self._writer: Any = None
        self._config: str | None = None

    def _emit(self, step: int, tag: str, *, value: float | None = None, text: str | None = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        if self._writer is None:
            self._writer = EventFileWriter(str(run_folder(self.log_dir.parent, self.log_dir.name)))  # no link
            if step > 0:  # a resumed run: readers drop what a dead attempt logged at steps >= this one
                start = Event(
                    step=step, wall_time=time.time(), session_log=SessionLog(status=SessionLog.START)
                )
                self._writer.add_event(start)
            if self._config is not None:
                self._emit(0, "config", text=self._config)
        if text is not None:
            metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
            shape = TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)])
            tensor = TensorProto(dtype="DT_STRING", string_val=[text.encode()], tensor_shape=shape)
            entry = Summary.Value(tag=f"{tag}/text_summary", metadata=metadata, tensor=tensor)
        else:
            entry = Summary.Value(tag=tag, simple_value=value)
        self._writer.add_event(Event(step=step, wall_time=time.time(), summary=Summary(value=[entry])))

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._config = "```json\n" + json.dumps(config, indent=2, default=str) + "\n```"

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self._emit(step, key, value=float(value))
        self._writer.flush()

    def log_table(self, name: str, step: int, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        def cell(value: Any) -> str:
            text = f"{value:.4g}" if isinstance(value, float) else str(value)
            return text.replace("|", "\\|").replace("\r", "").replace("\n", "<br>")

        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        self._emit(step, name, text="\n".join(lines))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class _Wandb:
    """An offline W&B run in ``RUN_DIR/wandb`` whose id survives a resume."""

    def __init__(self, run_dir: Path, *, config: Mapping[str, Any], kind: str) -> None:
        import wandb

        self._wandb = wandb
        folder = run_folder(run_dir, "wandb")  # never a planted link, nor the id file below
        id_file = folder / "toolgym-run-id"
        refuse_link(id_file)
        run_id = id_file.read_text(encoding="utf-8").strip() if id_file.is_file() else ""
        if not re.fullmatch(r"[a-z0-9]{1,64}", run_id):  # none yet, or not one toolgym wrote
            run_id = secrets.token_hex(4)  # W&B ids: lowercase letters and digits
            write_atomic(id_file, run_id + "\n")
        self.run = wandb.init(
            mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
            dir=str(run_dir),
            project=os.environ.get("WANDB_PROJECT", "toolgym"),
            name=run_dir.resolve().name,
            job_type=kind,
            id=run_id,
            resume="allow",
            config=dict(config),
            settings=wandb.Settings(console="off", silent=True),
            reinit="create_new",
        )

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_table(self, name: str, step: int, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        table = self._wandb.Table(columns=list(columns), data=[list(r) for r in rows])
        self.run.log({name: table}, step=step)

    def close(self) -> None:
        self.run.finish()
