"""The manifest of an on-disk search index: every file's size and sha256, checked on open.

:func:`file_table` lists a finished index's files; :func:`read_manifest` verifies a directory against
its ``manifest.json`` and raises :class:`~toolgym.errors.BackendError` with the fix when a file is
missing, truncated, altered or from another format version (see :mod:`toolgym.tools.index`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from toolgym.errors import BackendError

__all__ = ["FORMAT", "MANIFEST", "file_table", "fix_hint", "read_manifest", "sha256_file"]

#: Version of the on-disk layout; an index of another version is rebuilt (or refused by load_index).
FORMAT = 1
MANIFEST = "manifest.json"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_table(root: Path) -> dict[str, dict[str, Any]]:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    return {
        p.relative_to(root).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in files
    }


def fix_hint(path: Path) -> str:
    return (
        f"Fix: delete {path} and build it again (build_index(docs, ...) or "
        "`toolgym index build --corpus FILE.jsonl`)"
    )


def read_manifest(path: Path, *, verify: bool = True) -> dict[str, Any]:
    """Return the manifest of the index at ``path`` after checking every file against it.

    Raises:
        BackendError: the directory is missing, incomplete, altered or from another format version.
    """
    if not path.is_dir():
        raise BackendError(f"no index at {path} (not a directory). {fix_hint(path)}")
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
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
    for name, meta in files.items():
        file = path / name
        try:
            size = file.stat().st_size
        except OSError:
            raise BackendError(f"the index at {path} lacks {name}. {fix_hint(path)}") from None
        if size != meta["size"]:
            raise BackendError(
                f"the index at {path} is corrupt: {name} has {size} bytes, the manifest says {meta['size']}. "
                + fix_hint(path)
            )
        if verify and sha256_file(file) != meta["sha256"]:
            raise BackendError(f"the index at {path} is corrupt: {name} fails its checksum. {fix_hint(path)}")
    return manifest
