"""A directory's file table: every file's size, and its sha256, checked before the directory is trusted.

Three kinds of directory toolgym writes once and reads many times carry one: a search index
(:mod:`toolgym.tools.search.index_files`), the converted model cache
(:mod:`toolgym.agents.policies.models`) and a training run's inference export
(:mod:`toolgym.agents.policies.run_exports`). Each keeps its table in its own JSON file with its own
other fields; the table itself, and the check, are this module's:

* :func:`file_table` lists a finished directory: ``{name: {"size": n, "sha256": hex}}``, the sha256
  only for files of at most ``hash_max_bytes`` when given (a multi-gigabyte weight file is then checked
  by its size and its own header);
* :func:`table_problem` says why a directory does not hold its table (the first file missing, of
  another size, or failing its sha256), or ``None``: sizes first (cheap, catches truncation), then
  hashes. ``verified(name, stat)`` may vouch for a file unchanged since it was last hashed (the search
  index's stat stamps), which skips that file's hash.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["file_table", "sha256_file", "table_problem"]


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_table(
    root: str | Path,
    *,
    exclude: Iterable[str] = (),
    recursive: bool = False,
    hash_max_bytes: int | None = None,
) -> dict[str, dict[str, Any]]:
    """The table of ``root``'s files (names relative to it, ``/``-separated), ``exclude`` left out."""
    root = Path(root)
    skip = set(exclude)
    paths = root.rglob("*") if recursive else root.iterdir()
    table: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in paths if p.is_file() and p.name not in skip):
        meta: dict[str, Any] = {"size": path.stat().st_size}
        if hash_max_bytes is None or meta["size"] <= hash_max_bytes:
            meta["sha256"] = sha256_file(path)
        table[path.relative_to(root).as_posix()] = meta
    return table


def table_problem(
    root: str | Path,
    files: Mapping[str, Any],
    *,
    required: Iterable[str] = (),
    verified: Callable[[str, os.stat_result], bool] | None = None,
    hash: bool = True,
) -> str | None:
    """Why ``root`` does not hold ``files`` (a :func:`file_table`), or ``None`` when it does.

    Args:
        root: the directory.
        files: its table, as recorded when it was written.
        required: names the table must list (a directory missing one is not usable whatever it holds).
        verified: ``verified(name, stat)`` True skips that file's hash (it is known unchanged).
        hash: False checks sizes only.
    """
    root = Path(root)
    for name in required:
        if name not in files:
            return f"the file table does not list {name}"
    stats: dict[str, os.stat_result] = {}
    for name, meta in files.items():
        try:
            st = (root / name).stat()
        except OSError:
            return f"{name} is missing"
        if not isinstance(meta, Mapping) or st.st_size != meta.get("size"):
            expected = meta.get("size") if isinstance(meta, Mapping) else meta
            return f"{name} has {st.st_size} bytes, the file table says {expected}"
        stats[name] = st
    if not hash:
        return None
    for name, meta in files.items():
        if "sha256" not in meta or (verified is not None and verified(name, stats[name])):
            continue
        if sha256_file(root / name) != meta["sha256"]:
            return f"{name} fails its checksum (its sha256 changed since it was written: edited or corrupt)"
    return None
