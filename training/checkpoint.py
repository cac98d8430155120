"""Atomic checkpoints: everything a killed run needs to continue as if it had never stopped.

A checkpoint holds the model and optimizer state, the curriculum, the data-sampler position (the index
of the next group the learner will consume), the step and policy version, the Python/NumPy/torch RNG
states, and the byte lengths of the run's JSONL files at that moment. Resuming truncates those files
back to the recorded lengths, so a step that was interrupted half-written is neither lost nor counted
twice: it is simply run again.

NOTE (atomicity): the file is written to a temporary name in the same directory, flushed and fsynced,
then renamed over the old one; a kill at any moment leaves either the old or the new checkpoint.

Failures. A run directory that refuses the write (disk full, read-only, quota) raises
:class:`~toolgym.errors.CheckpointError` saying so: the temporary file is removed, the previous
checkpoint is untouched, and rerunning the same command resumes from it (the steps after it are run
again; their log lines are cut back first, so nothing is counted twice). A checkpoint that cannot be
read (truncated or damaged outside toolgym) raises :class:`~toolgym.errors.CheckpointError` too,
rather than a deserialiser's traceback, and is never silently ignored.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import random
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np
import torch

from toolgym.errors import CheckpointError

__all__ = [
    "CHECKPOINT_NAME",
    "capture_rng",
    "load_checkpoint",
    "restore_rng",
    "save_checkpoint",
    "truncate_to",
]

CHECKPOINT_NAME = "checkpoint.pt"

log = logging.getLogger(__name__)


def capture_rng() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


class _Writer:
    """A file wrapper that remembers the ``OSError`` of a failed write.

    ``torch.save`` reports a failed write as a bare ``RuntimeError`` ("unexpected pos ..."); the
    remembered error says what really happened (``ENOSPC``, ``EROFS``).
    """

    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.fh.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.fh.flush()


def save_checkpoint(run_dir: str | Path, state: dict[str, Any]) -> Path:
    """Write ``state`` atomically to ``run_dir/checkpoint.pt`` and return its path.

    Raises:
        CheckpointError: the run directory refused the write; the previous checkpoint is untouched.
    """
    run_dir = Path(run_dir)
    final = run_dir / CHECKPOINT_NAME
    tmp = run_dir / f".{CHECKPOINT_NAME}.tmp"
    try:
        with tmp.open("wb") as fh:
            writer = _Writer(fh)
            try:
                torch.save(state, cast(BinaryIO, writer))  # torch.save only calls write and flush
            except RuntimeError:
                if writer.error is None:
                    raise
                raise writer.error from None
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise CheckpointError(
            f"could not write the checkpoint of step {state.get('step', '?')} to {final}: "
            f"{exc.strerror or exc} (errno {exc.errno}). The previous checkpoint is untouched. Fix: free "
            f"disk space or make {run_dir} writable, then rerun the same command; it resumes from the "
            "previous checkpoint and runs the steps after it again, losing nothing and counting "
            "nothing twice"
        ) from exc
    try:
        dir_fd = os.open(run_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:  # the new checkpoint is in place; only its durability is unconfirmed
        log.warning("could not fsync %s after writing the checkpoint: %s", run_dir, exc)
    return final


def load_checkpoint(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's checkpoint, or None when it has none yet.

    Raises:
        CheckpointError: the file exists but cannot be read as a checkpoint.
    """
    path = Path(run_dir) / CHECKPOINT_NAME
    if not path.is_file():
        return None
    try:
        # weights_only=False: the state holds RNG tuples and plain dicts written by this module only.
        state = torch.load(path, map_location="cpu", weights_only=False)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile) as exc:
        raise CheckpointError(
            f"cannot read the checkpoint {path} ({type(exc).__name__}: {exc}); it is damaged (it was "
            "changed or truncated outside toolgym, whose writes are atomic). Fix: restore it from a copy, "
            "or remove the run directory to start the run over"
        ) from exc
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(
            f"{path} is not a toolgym training checkpoint (expected a dict with 'step', got "
            f"{type(state).__name__}). Fix: point --out at this run's own directory"
        )
    return state


def truncate_to(path: str | Path, size: int) -> None:
    """Cut a log file back to ``size`` bytes (what it held at the checkpoint)."""
    path = Path(path)
    if path.exists() and path.stat().st_size > size:
        with path.open("r+b") as fh:
            fh.truncate(size)
