"""Atomic checkpoints: everything a killed run needs to continue as if it had never stopped.

A checkpoint holds the model and optimizer state, the curriculum, the data-sampler position (the index
of the next group the learner will consume), the step and policy version, the Python/NumPy/torch RNG
states, and the byte lengths of the run's JSONL files at that moment. Resuming truncates those files
back to the recorded lengths, so a step that was interrupted half-written is neither lost nor counted
twice: it is simply run again.

NOTE (atomicity): the file is written to a temporary name in the same directory, flushed and fsynced,
then renamed over the old one; a kill at any moment leaves either the old or the new checkpoint.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "CHECKPOINT_NAME",
    "capture_rng",
    "load_checkpoint",
    "restore_rng",
    "save_checkpoint",
    "truncate_to",
]

CHECKPOINT_NAME = "checkpoint.pt"


def capture_rng() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(run_dir: str | Path, state: dict[str, Any]) -> Path:
    """Write ``state`` atomically to ``run_dir/checkpoint.pt`` and return its path."""
    run_dir = Path(run_dir)
    final = run_dir / CHECKPOINT_NAME
    tmp = run_dir / f".{CHECKPOINT_NAME}.tmp"
    with tmp.open("wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(run_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def load_checkpoint(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's checkpoint, or None when it has none yet."""
    path = Path(run_dir) / CHECKPOINT_NAME
    if not path.is_file():
        return None
    # weights_only=False: the state holds RNG tuples and plain dicts written by this module only.
    return torch.load(path, map_location="cpu", weights_only=False)


def truncate_to(path: str | Path, size: int) -> None:
    """Cut a log file back to ``size`` bytes (what it held at the checkpoint)."""
    path = Path(path)
    if path.exists() and path.stat().st_size > size:
        with path.open("r+b") as fh:
            fh.truncate(size)
