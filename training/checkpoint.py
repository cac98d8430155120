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

NOTE (data, not code): a run directory may be shared, copied or downloaded, so its checkpoint is read
as data: ``torch.load(weights_only=True)``, which rebuilds tensors and plain values (dicts, lists,
tuples, strings, numbers) and nothing else, so unpickling it can run no code. The state therefore holds
only those (checked when saved): NumPy's RNG state is kept as a dict of plain values and rebuilt on
load. A file that names anything else is refused with a :class:`~toolgym.errors.CheckpointError`
naming what it holds: a checkpoint of an older toolgym (NumPy's RNG state as NumPy objects) with the
command that converts it once (``toolgym checkpoint upgrade RUN``, :func:`upgrade_checkpoint`, which
itself rebuilds only those NumPy arrays), anything else as a file no toolgym wrote. Temporary files
are created, never opened through a planted link (:mod:`toolgym.run_files`).
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
from toolgym.run_files import create_new, open_update

__all__ = [
    "CHECKPOINT_NAME",
    "capture_rng",
    "load_checkpoint",
    "restore_rng",
    "save_checkpoint",
    "truncate_to",
    "upgrade_checkpoint",
]

CHECKPOINT_NAME = "checkpoint.pt"

log = logging.getLogger(__name__)


#: What a checkpoint of an older toolgym holds beyond tensors and plain values: NumPy's RNG state as
#: NumPy objects (an ``ndarray`` of ``uint32`` in NumPy's own tuple)
_OLDER_GLOBALS = frozenset(
    {
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct",
        "numpy.ndarray",
        "numpy.dtype",
        "numpy.dtypes.UInt32DType",
    }
)
_PLAIN = (str, int, float, bool, type(None), torch.Tensor, torch.dtype, torch.device)


def capture_rng() -> dict[str, Any]:
    """The Python, NumPy and torch RNG states, as tensors and plain values only (see the NOTE above)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    numpy_state = {
        "kind": str(kind),
        "keys": [int(k) for k in keys],
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }
    return {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}


def restore_rng(state: dict[str, Any]) -> None:
    """Set the RNGs to a :func:`capture_rng` state."""
    random.setstate(state["python"])
    n = state["numpy"]
    keys = np.array(n["keys"], dtype=np.uint32)
    np.random.set_state((n["kind"], keys, int(n["pos"]), int(n["has_gauss"]), float(n["gauss"])))
    torch.set_rng_state(state["torch"])


def _check_plain(value: Any, where: str = "state") -> None:
    """Raise ``TypeError`` naming the first value ``torch.load(weights_only=True)`` would refuse."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str | int):
                raise TypeError(
                    f"{where} has a {type(key).__name__} key {key!r}: a checkpoint's keys are str or int"
                )
            _check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, list | tuple) and type(value) in (list, tuple, torch.Size):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
    elif not isinstance(value, _PLAIN):
        raise TypeError(
            f"{where} is a {type(value).__module__}.{type(value).__qualname__}: a checkpoint holds tensors "
            "and plain values only (it is loaded with weights_only=True); store it as those"
        )


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
        ConfigError: a symbolic link stands at the temporary file's name (nothing is written through it).
        TypeError: ``state`` holds something other than tensors and plain values (a bug; nothing written).
    """
    run_dir = Path(run_dir)
    _check_plain(state)
    final = run_dir / CHECKPOINT_NAME
    tmp = run_dir / f".{CHECKPOINT_NAME}.tmp"
    try:
        with create_new(tmp) as fh:  # never through a link planted at the temporary name
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
    """The run's checkpoint, read as data (tensors and plain values), or None when it has none yet.

    Raises:
        CheckpointError: the file exists but cannot be read as a checkpoint: damaged, written by an
            older toolgym (the message gives the command that converts it), or holding objects no
            toolgym writes (refused; nothing in it runs).
    """
    path = Path(run_dir) / CHECKPOINT_NAME
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise _refusal(path) from None
    except (OSError, EOFError, RuntimeError, zipfile.BadZipFile) as exc:
        raise _damaged(path, exc) from exc
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(
            f"{path} is not a toolgym training checkpoint (expected a dict with 'step', got "
            f"{type(state).__name__}). Fix: point --out at this run's own directory"
        )
    return state


def upgrade_checkpoint(run_dir: str | Path) -> bool:
    """Rewrite a checkpoint of an older toolgym in today's form (``toolgym checkpoint upgrade RUN``).

    The old file is read with ``weights_only=True`` too, allowing only the NumPy array types older
    toolgym wrote (its NumPy RNG state), so converting runs no code from the file either; the new file
    replaces it atomically. Returns False when the checkpoint is already in today's form.

    Raises:
        CheckpointError: no checkpoint, or one holding anything else (refused, named, untouched).
    """
    path = Path(run_dir) / CHECKPOINT_NAME
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist: pass the --out of a `toolgym train` run")
    try:
        torch.load(path, map_location="cpu", weights_only=True)
        return False
    except pickle.UnpicklingError:
        pass
    except (OSError, EOFError, RuntimeError, zipfile.BadZipFile) as exc:
        raise _damaged(path, exc) from exc
    names = _unsafe_globals(path)
    if names is None or not set(names) <= _OLDER_GLOBALS:
        held = ", ".join(names) if names else "objects other than tensors and plain values"
        raise CheckpointError(
            f"refused {path}: it holds {held}, which no toolgym wrote (an older toolgym's checkpoint holds "
            "only NumPy arrays beyond tensors and plain values), so it is not converted and nothing in it "
            f"runs. If you did not put it there, someone with write access to {path.parent} may have"
        )
    allow = getattr(torch.serialization, "safe_globals", None)
    if allow is None:
        raise CheckpointError(f"converting {path} needs torch >= 2.6 (pip install -U torch)")
    try:
        from numpy._core.multiarray import _reconstruct  # NumPy 2
    except ImportError:
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]  # NumPy 1
    older: list[Any] = [_reconstruct, (_reconstruct, "numpy.core.multiarray._reconstruct")]
    older += [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        with allow(older):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # a global the static listing missed: still refused, still unrun
        raise _refusal(path) from None
    rng = state.get("rng") if isinstance(state, dict) else None
    if not isinstance(rng, dict) or not isinstance(rng.get("numpy"), tuple) or "step" not in state:
        raise CheckpointError(f"{path} is not a toolgym training checkpoint: nothing converted")
    kind, keys, pos, has_gauss, gauss = rng["numpy"]
    rng["numpy"] = {
        "kind": str(kind),
        "keys": [int(k) for k in keys],
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }
    try:
        _check_plain(state)
    except TypeError as exc:
        raise CheckpointError(
            f"{path} holds more than an older toolgym wrote: {exc}; nothing converted"
        ) from None
    save_checkpoint(path.parent, state)
    return True


def _unsafe_globals(path: Path) -> list[str] | None:
    """The names a checkpoint's pickle refers to beyond what ``weights_only`` allows, read without
    unpickling it; None when they cannot be listed (not a zip checkpoint, an older torch)."""
    lister = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if lister is None:
        return None
    try:
        return sorted(lister(str(path)))
    except Exception:  # noqa: BLE001 (a damaged file: the caller reports it as such)
        return None


def _refusal(path: Path) -> CheckpointError:
    """Why a checkpoint ``weights_only`` refused is not loaded, and what to do about it."""
    if not zipfile.is_zipfile(path):  # torch.save, toolgym's writer, always writes a zip archive
        return _damaged(path, "not a zip archive, which every checkpoint toolgym writes is")
    names = _unsafe_globals(path)
    if names and set(names) <= _OLDER_GLOBALS:
        return CheckpointError(
            f"{path} was written by an older toolgym: it holds NumPy objects ({', '.join(names)}), and a "
            "checkpoint is now read as tensors and plain values only, so that a run directory runs no code. "
            f"Convert it once (this runs no code from it either): `toolgym checkpoint upgrade {path.parent}`, "
            "then rerun the same command"
        )
    held = ", ".join(names) if names else "objects other than tensors and plain values"
    return CheckpointError(
        f"refused {path}: it holds {held}, which no toolgym writes; a checkpoint is read as tensors and "
        "plain values only, so toolgym runs no code from a run directory. If you did not put it there, "
        f"someone with write access to {path.parent} may have: remove it, or restore the run's own copy"
    )


def _damaged(path: Path, why: BaseException | str) -> CheckpointError:
    reason = why if isinstance(why, str) else f"{type(why).__name__}: {why}"
    return CheckpointError(
        f"cannot read the checkpoint {path} ({reason}); it is damaged (it was "
        "changed or truncated outside toolgym, whose writes are atomic). Fix: restore it from a copy, "
        "or remove the run directory to start the run over"
    )


def truncate_to(path: str | Path, size: int) -> None:
    """Cut a log file back to ``size`` bytes (what it held at the checkpoint).

    Raises:
        ConfigError: ``path`` is a symbolic link (nothing is cut through it).
    """
    path = Path(path)
    if os.path.lexists(path):
        with open_update(path) as fh:  # never through a planted link
            if os.fstat(fh.fileno()).st_size > size:
                fh.truncate(size)
