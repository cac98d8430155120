"""ArxivRefs' derived data, cached on disk by content hash beside the search index.

Why: everything an :class:`~toolgym.envs.arxiv_refs.ArxivRefsEnv` holds is derived from two input
files (the corpus and the optional collection) and a few settings: parsed papers and records, the
linked collection, near-duplicates and date rules turned into banned ids, tasks and their splits.
Deriving it takes tens of seconds of one core at 100k records; every rollout worker, evaluation pool
and served session constructs environments. So it is derived once, written to disk, and every later
construction opens it (records memory-mapped and decoded on access, :mod:`toolgym.tools.papers.store`).

One directory per key, ``<cache_dir()>/arxiv-refs-<key>``, beside the search indexes
(:func:`toolgym.tools.search.index.cache_dir`: ``$TOOLGYM_CACHE/index`` or ``~/.cache/toolgym/index``)::

    manifest.json, verified.json    key, input digests, settings, the search index's name and key,
                                    every file's size and sha256 (checked as an index's are:
                                    toolgym.tools.search.index_files)
    records.bin, …, papers.json     the linked collection (toolgym.tools.papers.store)
    tasks.jsonl, stats.json         the tasks (split labels included) and the linking counts
    banned.npy, banned_offsets.npy  per source paper, the record positions its tools never return
                                    (itself, its copies, later records), sorted; the date buckets and
                                    n-gram keys that found them are not needed once they are

The key is a sha256 over the cache format, the sha256 of each input file's bytes, every setting that
changes the result (the context rule, ``date_filter``, ``near_duplicate_threshold``, ``unlinked``,
``backend``) and the source of the modules that derive it, so any change of either file, a setting or
that code gives a new key; an entry is never read for inputs it was not built from.

Opening checks the manifest (sizes always, checksums unless stamped unchanged) and that it names this
key, these input digests and this format; a missing, truncated, altered or foreign entry is rebuilt,
with a warning saying why. The manifest is a checksum, not a signature: whoever can write an entry can
edit its gold answers and recompute it, so an entry is trusted as the user's own files are, and only
when it is: an entry (or a file in it) that belongs to another user or that every user may write is
rebuilt, with a warning. A build holds an exclusive lock on ``.arxiv-refs-<key>.lock`` (``flock``:
the OS releases it if the builder dies), so processes that start together build once and the others
open the result; it writes into a temporary sibling renamed into place only when complete, and hashes
its inputs again at the end: a file edited during the build is refused, never cached under the digest
of what it was before.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from toolgym.core import Task
from toolgym.envs.arxiv_refs.derive import CacheSettings, derive, phase
from toolgym.errors import BackendError, ConfigError
from toolgym.tools.papers.collection import Collection
from toolgym.tools.papers.store import RecordStore, open_collection, write_collection
from toolgym.tools.search.index import cache_dir, load_index
from toolgym.tools.search.index_build import build_index
from toolgym.tools.search.index_files import FORMAT, MANIFEST, index_file_table, read_manifest, swap_in

__all__ = ["CACHE_FORMAT", "PREFIX", "BannedIds", "CacheSettings", "Derived", "cache_key", "load_or_build"]

log = logging.getLogger(__name__)

#: Version of this cache's layout; bump it when what is stored changes meaning.
CACHE_FORMAT = 1
#: Directory-name prefix of an entry (beside the search indexes).
PREFIX = "arxiv-refs-"
_KIND = "arxiv-refs"
#: Modules whose code decides the derived data: their source is part of the key.
_DERIVING = (
    "toolgym.splits",
    "toolgym.data",
    "toolgym.tools.papers.collection",
    "toolgym.tools.papers.copies",
    "toolgym.tools.papers.corpus",
    "toolgym.tools.papers.ids",
    "toolgym.tools.papers.markers",
    "toolgym.tools.papers.records",
    "toolgym.tools.papers.refs",
    "toolgym.tools.papers.store",
    "toolgym.envs.arxiv_refs.data",
    "toolgym.envs.arxiv_refs.leakage",
    "toolgym.envs.arxiv_refs.derive",
    "toolgym.envs.arxiv_refs.cache",
)
#: A file changed this recently is hashed again next time (its timestamps could hide a second change).
_RACY_NS = 2_000_000_000


class BannedIds(AbstractSet[str]):
    """One source paper's banned collection ids: sorted record positions, memory-mapped (read-only)."""

    def __init__(self, positions: np.ndarray, records: RecordStore) -> None:
        self._positions = positions
        self._records = records

    def __contains__(self, cid: object) -> bool:
        position = self._records.position(cid)
        if position < 0:
            return False
        at = int(np.searchsorted(self._positions, position))
        return at < len(self._positions) and int(self._positions[at]) == position

    def __iter__(self) -> Iterator[str]:
        return (self._records.ids.get(int(p)) for p in self._positions)

    def __len__(self) -> int:
        return len(self._positions)

    @classmethod
    def _from_iterable(cls, it: Iterable[Any]) -> set[Any]:  # what set operators return
        return set(it)


@dataclass(frozen=True)
class Derived:
    """Everything an environment of one configuration holds, opened from its cache entry."""

    key: str
    path: Path
    collection: Collection
    tasks: list[Task]
    stats: dict[str, int]
    banned: dict[str, BannedIds]
    index: Any


class _Unusable(Exception):
    """An entry that exists but cannot serve this configuration (the message says why)."""


# ------------------------------------------------------------------------------------------ the key

_DIGESTS: dict[tuple[Any, ...], str] = {}
_CODE: list[str] = []


def input_digest(path: Path) -> str:
    """sha256 of the file's bytes; remembered per process while its stat signature is unchanged."""
    st = path.stat()
    stamp = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
    if stamp in _DIGESTS:
        return _DIGESTS[stamp]
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    if max(st.st_mtime_ns, st.st_ctime_ns) < time.time_ns() - _RACY_NS:
        _DIGESTS[stamp] = digest.hexdigest()
    return digest.hexdigest()


def _code_digest() -> str:
    if not _CODE:
        digest = hashlib.sha256()
        for name in _DERIVING:
            module = importlib.import_module(name)
            digest.update(name.encode() + b"\0" + Path(str(module.__file__)).read_bytes() + b"\0")
        _CODE.append(digest.hexdigest())
    return _CODE[0]


def _inputs(corpus: Path, collection: Path | None) -> dict[str, str | None]:
    return {"corpus": input_digest(corpus), "collection": input_digest(collection) if collection else None}


def _key(inputs: dict[str, str | None], settings: CacheSettings) -> str:
    source = {
        "cache_format": CACHE_FORMAT,
        "index_format": FORMAT,
        "inputs": inputs,
        "settings": settings.to_json(),
        "code": _code_digest(),
    }
    return hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:24]


def cache_key(corpus: Path, collection: Path | None, settings: CacheSettings) -> str:
    """The entry's key: the inputs' content, the settings and the deriving code (module docstring)."""
    return _key(_inputs(corpus, collection), settings)


# ------------------------------------------------------------------------------------------- build


def _write(
    tmp: Path,
    collection: Collection,
    tasks: list[Task],
    stats: dict[str, int],
    banned: Mapping[str, AbstractSet[str]],
) -> None:
    write_collection(collection, tmp)
    (tmp / "tasks.jsonl").write_text("".join(t.to_json() + "\n" for t in tasks), encoding="utf-8")
    (tmp / "stats.json").write_text(json.dumps(stats), encoding="utf-8")
    position = {cid: i for i, cid in enumerate(collection.records)}
    lists = [
        np.sort(np.fromiter((position[c] for c in banned[p.paper_id]), dtype=np.int32))
        for p in collection.papers
    ]
    offsets = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in lists], out=offsets[1:])
    np.save(tmp / "banned.npy", np.concatenate([np.zeros(0, dtype=np.int32), *lists]))
    np.save(tmp / "banned_offsets.npy", offsets)


def _build(
    target: Path,
    key: str,
    inputs: dict[str, str | None],
    corpus: Path,
    collection_path: Path | None,
    settings: CacheSettings,
) -> None:
    """Derive, index and write the entry ``target`` (atomically: a temporary sibling renamed)."""
    collection, tasks, stats, banned = derive(corpus, collection_path, settings)
    index = build_index((r.index_doc() for r in collection.records.values()), backend=settings.backend)
    index_ref = {"name": index.path.name, "key": index.provenance["key"]}
    index.close()
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        with phase(f"ArxivRefs: writing the cache ({len(collection.records):,} records)"):
            _write(tmp, collection, tasks, stats, banned)
            manifest = {
                "format": FORMAT,
                "kind": _KIND,
                "cache_format": CACHE_FORMAT,
                "key": key,
                "inputs": inputs,
                "settings": settings.to_json(),
                "index": index_ref,
                "files": index_file_table(tmp),
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
            for path in (tmp, *tmp.iterdir()):  # never writable by others, whatever the umask
                path.chmod(path.stat().st_mode & ~0o002)
        _DIGESTS.clear()  # hash again: the build must have read the bytes the key names
        if _inputs(corpus, collection_path) != inputs:
            raise ConfigError(
                f"{corpus if collection_path is None else f'{corpus} or {collection_path}'} changed while it "
                "was read; nothing was cached. Run again once the file is complete"
            )
        try:
            swap_in(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
            # Another process (where there is no flock) finished first; the caller checks its entry.
            log.info("another process wrote %s first; using it", target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# -------------------------------------------------------------------------------------------- open


def _banned(path: Path, collection: Collection) -> dict[str, BannedIds]:
    store = collection.records
    assert isinstance(store, RecordStore)
    positions = np.load(path / "banned.npy", mmap_mode="r")
    offsets = np.load(path / "banned_offsets.npy")
    if len(offsets) != len(collection.papers) + 1 or int(offsets[-1]) != len(positions):
        raise ValueError(
            f"{path}: banned ids for {len(offsets) - 1} papers, the collection has {len(collection.papers)}"
        )
    if len(positions) and not 0 <= int(positions.min()) <= int(positions.max()) < len(store):
        raise ValueError(f"{path}: a banned position outside the {len(store)} records")
    return {
        p.paper_id: BannedIds(positions[int(offsets[i]) : int(offsets[i + 1])], store)
        for i, p in enumerate(collection.papers)
    }


def _open_index(ref: dict[str, str], collection: Collection, backend: str, entry: Path) -> Any:
    """The entry's search index; built again from the stored records when it is gone or not that index."""
    try:
        index = load_index(cache_dir() / ref["name"])
    except BackendError as exc:
        reason = str(exc)
    else:
        if index.provenance.get("key") == ref["key"]:
            return index
        index.close()
        reason = f"{index.path} holds another corpus"
    log.warning("the search index of %s cannot be used (%s); building it again", entry, reason)
    index = build_index((r.index_doc() for r in collection.records.values()), backend=backend)
    if index.provenance.get("key") != ref["key"]:
        raise BackendError(
            f"the search index built from {entry} is not the one it was written with; "
            f"Fix: delete {entry} (it is rebuilt from the input files)"
        )
    return index


def _check_owner(target: Path) -> None:
    """Raise _Unusable unless the entry and every file in it belong to this user and no one else may
    write them: its manifest is only a checksum, which whoever can edit the gold answers can recompute."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    for path in (target, *target.iterdir()):
        st = path.lstat()
        if uid is not None and st.st_uid != uid:
            raise _Unusable(
                f"{path.name} belongs to another user (uid {st.st_uid}), so its gold answers are not trusted"
            )
        if st.st_mode & 0o002:  # group write is left alone: a user's own group, under a umask of 002
            raise _Unusable(
                f"{path.name} is writable by other users (mode {st.st_mode & 0o777:o}), so its gold answers "
                "are not trusted"
            )


def _open(target: Path, key: str, inputs: dict[str, str | None], settings: CacheSettings) -> Derived:
    """The entry at ``target``, checked (module docstring). Raises _Unusable saying why it cannot serve."""
    _check_owner(target)
    try:
        manifest = read_manifest(target)
    except BackendError as exc:
        raise _Unusable(str(exc).split(" Fix:")[0].replace(f"the index at {target}", "it")) from None
    wanted = {"kind": _KIND, "cache_format": CACHE_FORMAT, "key": key, "inputs": inputs}
    for field, want in wanted.items():
        if manifest.get(field) != want:
            raise _Unusable(
                f"it was written for {field} {manifest.get(field)!r}, not {want!r} (other files or settings)"
            )
    try:
        collection = open_collection(target)
        lines = (target / "tasks.jsonl").read_text(encoding="utf-8").splitlines()
        tasks = [Task.from_json(line) for line in lines]
        stats = {
            str(k): int(v) for k, v in json.loads((target / "stats.json").read_text(encoding="utf-8")).items()
        }
        banned = _banned(target, collection)
        if not tasks or any(t.metadata["paper_id"] not in banned for t in tasks):
            raise ValueError("its tasks do not match its papers")
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise _Unusable(f"it cannot be read ({type(exc).__name__}: {exc})") from None
    index = _open_index(manifest["index"], collection, settings.backend, target)
    return Derived(key, target, collection, tasks, stats, banned, index)


@contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """Exclusive ``flock`` on ``lock`` while building (none where the OS has no flock: the rename still
    keeps every entry whole, and concurrent builders may both build)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(lock, "a+b") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building %s; waiting for it", lock.name.removesuffix(".lock")[1:])
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def load_or_build(corpus: Path, collection_path: Path | None, settings: CacheSettings) -> Derived:
    """The derived data of this configuration: opened from its cache entry, built there first if needed.

    Args:
        corpus: the corpus file (:mod:`toolgym.tools.papers.corpus`).
        collection_path: the collection file (:mod:`toolgym.tools.papers.records`), or ``None``.
        settings: what else the result depends on.

    Raises:
        ConfigError: the inputs are malformed, give no task, or changed during the build.
        BackendError: a freshly written entry cannot be read back (a full disk, say).
    """
    inputs = _inputs(corpus, collection_path)
    key = _key(inputs, settings)
    root = cache_dir()
    target = root / f"{PREFIX}{key}"
    stale = None
    if target.exists():
        try:
            derived = _open(target, key, inputs, settings)
        except _Unusable as exc:
            stale = str(exc)
        else:
            log.info("ArxivRefs cache hit: %s", target)
            return derived
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create the cache directory {root} ({exc}); set TOOLGYM_CACHE to a writable one"
        ) from None
    with _locked(root / f".{PREFIX}{key}.lock"):
        if target.exists():  # built by another process while this one waited, or the stale one
            try:
                derived = _open(target, key, inputs, settings)
            except _Unusable as exc:
                stale = str(exc)
            else:
                log.info("ArxivRefs cache hit after waiting: %s", target)
                return derived
        if stale is not None:
            log.warning("the ArxivRefs cache %s cannot be used: %s; rebuilding it", target, stale)
        _build(target, key, inputs, corpus, collection_path, settings)
        try:
            derived = _open(target, key, inputs, settings)
        except _Unusable as exc:
            raise BackendError(f"the ArxivRefs cache {target} was just written but {exc}") from None
    log.info("ArxivRefs cache written: %s", target)
    return derived
