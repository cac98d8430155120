"""The file table of an on-disk search index (``manifest.json``): every file's size and sha256, checked
on open.

The table is :mod:`toolgym.file_table`'s, shared with the model cache and the exports; here it lives in
the index's ``manifest.json`` beside the index's format version. :func:`read_manifest` verifies a
directory against it and raises :class:`~toolgym.errors.BackendError` with the fix when a file is
missing, truncated, altered or from another format version (see :mod:`toolgym.tools.search.index`);
:func:`swap_in` puts a finished build in its place.

Hashing a million-passage index takes seconds, so opening it in milliseconds needs a shortcut, the
one ``git status`` takes: after a file's sha256 has been verified, its stat signature (size, mtime,
ctime, inode, device) goes into ``verified.json`` beside the manifest; a later open whose stat matches
skips the hash. Any write to a file changes its ctime, which no program can set back, so a file
changed since it was verified is always hashed again. Timestamps are coarse (a few milliseconds), so a
file modified within ``RACY_SECONDS`` of being verified is not stamped (it is hashed again next time,
as git treats "racily clean" entries). Without a writable directory there are no stamps and every
open hashes every file. What the stamps do not cover: bits that rot on the disk without
any write (no ctime change); ``read_manifest(path, verify="full")`` hashes everything regardless.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from toolgym.errors import BackendError
from toolgym.file_table import file_table, table_problem

__all__ = ["FORMAT", "MANIFEST", "VERIFIED", "fix_hint", "index_file_table", "read_manifest", "swap_in"]

log = logging.getLogger(__name__)

#: Version of the on-disk layout; an index of another version is rebuilt (or refused by load_index).
FORMAT = 5
MANIFEST = "manifest.json"
VERIFIED = "verified.json"


def index_file_table(root: Path) -> dict[str, dict[str, Any]]:
    """The file table of a finished index directory (every file hashed; the table's own files left out)."""
    return file_table(root, exclude=(MANIFEST, VERIFIED), recursive=True)


#: A file changed this recently is not stamped: another change within the same timestamp tick could
#: go unseen.
RACY_SECONDS = 2.0


def swap_in(tmp: Path, target: Path) -> None:
    """Rename the finished directory ``tmp`` to ``target``; a ``target`` already there is renamed aside
    first and removed after, so readers see the old directory or the new one, never half of either.

    Raises:
        OSError: a rename failed (``tmp`` is left in place); typically another process's build took
            ``target`` first, and the caller decides whether to use it.
    """
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        target.rename(old)
    try:
        tmp.rename(target)
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def fix_hint(path: Path) -> str:
    return (
        f"Fix: delete {path} and build it again (build_index(docs, ...) or "
        "`toolgym index build --corpus FILE.jsonl`)"
    )


def _signature(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _load_stamps(path: Path, manifest_digest: str) -> dict[str, list[int]]:
    try:
        data = json.loads((path / VERIFIED).read_text(encoding="utf-8"))
        if data.get("manifest_sha256") == manifest_digest and isinstance(data.get("files"), dict):
            return {str(k): list(v) for k, v in data["files"].items()}
    except (OSError, ValueError, TypeError, AttributeError):
        pass  # no stamps, or unreadable ones: verify everything
    return {}


def _save_stamps(path: Path, manifest_digest: str, stamps: dict[str, list[int]]) -> None:
    tmp = path / f".{VERIFIED}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text(json.dumps({"manifest_sha256": manifest_digest, "files": stamps}), encoding="utf-8")
        os.replace(tmp, path / VERIFIED)
    except OSError as exc:  # a read-only index: it is simply verified in full on every open
        log.debug("cannot record verified files in %s (%s)", path, exc)
        tmp.unlink(missing_ok=True)


def read_manifest(path: Path, *, verify: bool | Literal["full"] = True) -> dict[str, Any]:
    """Return the manifest of the index at ``path`` after checking every file against it.

    Args:
        path: The index directory.
        verify: ``True``: sizes always, and the sha256 of every file not verified unchanged since
            (see the module docstring); ``"full"``: the sha256 of every file; ``False``: sizes only.

    Raises:
        BackendError: the directory is missing, incomplete, altered or from another format version.
    """
    if not path.is_dir():
        raise BackendError(f"no index at {path} (not a directory). {fix_hint(path)}")
    try:
        raw = (path / MANIFEST).read_bytes()
        manifest = json.loads(raw.decode("utf-8"))
        files = manifest["files"]
        fmt = manifest["format"]
    except FileNotFoundError:
        raise BackendError(
            f"the index at {path} has no {MANIFEST}: its build never finished. {fix_hint(path)}"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BackendError(
            f"the index manifest {path / MANIFEST} is unreadable ({exc}). {fix_hint(path)}"
        ) from None
    if fmt != FORMAT:
        raise BackendError(
            f"the index at {path} has format {fmt!r}, this toolgym reads {FORMAT}. {fix_hint(path)}"
        )
    digest = hashlib.sha256(raw).hexdigest()
    stamps = _load_stamps(path, digest) if verify is True else {}
    problem = table_problem(
        path, files, hash=bool(verify), verified=lambda name, st: stamps.get(name) == _signature(st)
    )
    if problem is not None:
        what = "lacks" if problem.endswith(" is missing") else "is corrupt:"
        detail = problem.removesuffix(" is missing") if what == "lacks" else problem
        raise BackendError(f"the index at {path} {what} {detail}. {fix_hint(path)}")
    if verify:
        settled = time.time_ns() - int(RACY_SECONDS * 1e9)  # too recent to trust: hashed again next time
        verified = {}
        for name in files:
            st = (path / name).stat()
            if max(st.st_mtime_ns, st.st_ctime_ns) < settled:
                verified[name] = _signature(st)
        if verified != stamps:
            _save_stamps(path, digest, verified)
    return manifest
