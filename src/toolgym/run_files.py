"""Writing a run's files without following a symbolic link that someone else planted.

A run directory may be shared, copied or downloaded, so anyone who could write to it may have left a
symbolic link where toolgym is about to write (``config.json`` -> another user's file, a system file):
a plain ``open(path, "w")`` would write through it. Every run file is therefore written here, and a
link at its name is refused with a :class:`~toolgym.errors.ConfigError` naming the link and its target,
before a byte is written:

* :func:`open_append`, :func:`open_write` and :func:`open_update` open a file with ``O_NOFOLLOW``;
* :func:`create_new` creates a file that must not exist (``O_CREAT | O_EXCL``, which never follows a
  link), replacing a leftover regular file of an interrupted write;
* :func:`write_atomic` writes a temporary file that way and renames it over the name (a rename replaces
  a link itself, never its target), refusing a link at the name first.

The run directory itself, and the folders above it, are the user's choice. Below it, every folder
toolgym writes into (``export/``, ``learners/``, ``heldout/``, ``tensorboard/``, ``wandb/``, ...) is
taken through :func:`run_folder`, which refuses a link at each of its components: a link on a folder
would otherwise redirect every file below it (``RUN/export`` -> another run's exports, whose newest
export an export of this run would then delete and replace). toolgym creates no links in a run
directory, so any link found there is refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import IO, BinaryIO

from toolgym.errors import ConfigError

__all__ = [
    "create_new",
    "open_append",
    "open_update",
    "open_write",
    "refuse_link",
    "run_folder",
    "write_atomic",
]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _link_error(path: Path) -> ConfigError:
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return ConfigError(
        f"{path} is a symbolic link{target} that toolgym did not create; toolgym writes no run file "
        "through a link, which could point anywhere (another user's file, a system file). Nothing was "
        "written through it. Fix: remove the link (and look at who put it there), then rerun the command"
    )


def refuse_link(path: str | Path) -> None:
    """Raise :class:`ConfigError` when ``path`` is a symbolic link; a missing file is fine."""
    if os.path.islink(path):
        raise _link_error(Path(path))


def run_folder(run_dir: str | Path, *parts: str, create: bool = True) -> Path:
    """``run_dir/part/...``: each folder below ``run_dir`` made if missing (``create``) and refused when it
    is a symbolic link (a dangling one too) or not a folder; ``run_dir`` itself is the user's choice.

    Raises:
        ConfigError: a component is a link or a file (named, with the link's target).
        ValueError: a part is not a single folder name (a bug of the caller's).
    """
    path = Path(run_dir)
    for part in parts:
        if part in ("", ".", "..") or "/" in part or os.sep in part:
            raise ValueError(f"run_folder takes folder names one by one, got {part!r}")
        path = path / part
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(path)  # never follows a link at ``path`` (a dangling one is an existing name)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            if create:
                raise
            continue  # not made yet: nothing below it can be a planted link either
        if stat.S_ISLNK(mode):
            raise _link_error(path)
        if not stat.S_ISDIR(mode):
            raise ConfigError(f"{path} is not a folder; toolgym keeps a folder there. Fix: move it away")
    return path


def _open(path: Path, flags: int, mode: str) -> IO[str] | BinaryIO:
    try:
        fd = os.open(path, flags | _NOFOLLOW | _CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise _link_error(path) from None
        raise
    if "b" in mode:
        return os.fdopen(fd, mode)
    return os.fdopen(fd, mode, encoding="utf-8")


def open_append(path: str | Path) -> IO[str]:
    """``path`` opened for appending text (created if missing), never through a link."""
    return _open(Path(path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, "a")  # type: ignore[return-value]


def open_write(path: str | Path) -> IO[str]:
    """``path`` opened for writing text from empty (created if missing), never through a link."""
    return _open(Path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "w")  # type: ignore[return-value]


def open_update(path: str | Path) -> BinaryIO:
    """An existing ``path`` opened ``r+b`` (to read, write or truncate it), never through a link."""
    return _open(Path(path), os.O_RDWR, "r+b")  # type: ignore[return-value]


def create_new(path: str | Path) -> BinaryIO:
    """A new, empty ``path`` opened ``wb``: a leftover regular file there is removed first, a link refused."""
    path = Path(path)
    refuse_link(path)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # an interrupted write's temporary file (a link planted since is refused below)
    return _open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "wb")  # type: ignore[return-value]


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Replace ``path``'s content with ``data`` (text as UTF-8) atomically; a link at ``path`` is refused."""
    path = Path(path)
    refuse_link(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with create_new(tmp) as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            if not tmp.is_symlink():
                tmp.unlink()
        raise
