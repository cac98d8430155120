"""Building a search index: stream a corpus into the document store, build a backend's files beside
it, and move the finished directory into place (:func:`build_index`, ``toolgym index build``).

:mod:`toolgym.tools.search.index` holds the other half: the on-disk layout, the cache rules and
:class:`~toolgym.tools.search.index.Index`, which opens what is built here. A build:

1. checks, hashes and stores every document as it arrives (:class:`_CorpusWriter`; memory holds ids,
   not texts), in a temporary sibling of the target directory;
2. derives the cache key from the corpus hash, the backend and its ranking settings; an index already
   at the target with that key is opened instead (a corrupt one is rebuilt, with a warning);
3. builds the backend's files (BM25 arrays, Lucene, or passage embeddings) with a progress bar and
   writes the manifest, the size and sha256 of every file;
4. renames the temporary directory into place, so a killed build leaves no half-index under the real
   name, and a build that another process finished first is reused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolgym.data import iter_jsonl
from toolgym.errors import BackendError, ConfigError
from toolgym.tools.search.doc_store import DOC_FILES, DocumentStore, DocumentWriter
from toolgym.tools.search.index import Index, cache_dir, check_backend
from toolgym.tools.search.index_files import FORMAT, MANIFEST, index_file_table, read_manifest, swap_in

if TYPE_CHECKING:
    from toolgym.tools.search.dense import DenseSettings
    from toolgym.tools.search.encoder import SentenceEncoder

__all__ = ["build_command", "build_index"]

log = logging.getLogger(__name__)


def _settings(backend: str, dense: dict[str, Any] | None = None) -> dict[str, Any]:
    from toolgym.tools.search.bm25 import BM25Settings

    if backend == "dense":
        assert dense is not None
        return {"contents": "title + newline + text", **dense}
    settings = asdict(BM25Settings())
    if backend == "pyserini":
        settings = {"k1": 0.9, "b": 0.4, "engine": "anserini SimpleIndexer/SimpleSearcher"}
    return {"contents": "title + newline + text", **settings}


# ---------------------------------------------------------------------------------------------- corpus


class _CorpusWriter:
    """Checks, hashes and stores documents one at a time (the streaming half of a build).

    ``records`` pair each document with a label for messages (``file:line`` or ``document N``).
    """

    def __init__(self, out: Path) -> None:
        self.ids: list[str] = []
        self._first_seen: dict[str, str] = {}
        self._digest = hashlib.sha256()
        self._writer = DocumentWriter(out)

    def add(self, label: str, doc: Any) -> None:
        if not isinstance(doc, dict):
            raise ConfigError(
                f"{label}: expected a JSON object with id, title and text, got {type(doc).__name__}"
            )
        missing = [key for key in ("id", "title", "text") if key not in doc]
        if missing:
            raise ConfigError(
                f"{label}: document lacks {', '.join(map(repr, missing))} (each needs id, title, text)"
            )
        for key in ("id", "title", "text"):
            if not isinstance(doc[key], str):
                raise ConfigError(f"{label}: {key!r} must be a string, got {type(doc[key]).__name__}")
        doc_id = doc["id"]
        if not doc_id.strip():
            raise ConfigError(f"{label}: 'id' is empty; every document needs a unique non-empty id")
        if doc_id in self._first_seen:
            raise ConfigError(
                f"{label}: duplicate id {doc_id!r} (first used at {self._first_seen[doc_id]}); ids must be unique"
            )
        try:
            # The corpus hash: one JSON row per document, as it has always been computed.
            row = json.dumps((doc_id, doc["title"], doc["text"]), ensure_ascii=False).encode("utf-8")
            self._writer.add(doc["title"], doc["text"])
        except UnicodeEncodeError as exc:  # a lone surrogate, e.g. from a "\ud800" escape in JSON
            raise ConfigError(
                f"{label}: the document is not valid Unicode text ({exc.reason} at {exc.start})"
            ) from None
        self._first_seen[doc_id] = label
        self.ids.append(doc_id)
        self._digest.update(row)
        self._digest.update(b"\n")

    def finish(self) -> str:
        """Write the store's remaining files; returns the corpus hash."""
        self._first_seen.clear()
        if not self.ids:
            self._writer.close()
            raise ConfigError("the corpus is empty; an index needs at least one document")
        self._writer.finish(self.ids)
        return self._digest.hexdigest()

    def close(self) -> None:
        self._writer.close()


def _read_corpus(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield (``file:line``, parsed JSON) for each non-blank line of a JSONL (or .jsonl.gz) file."""
    for lineno, record in iter_jsonl(path, what="corpus file (expected JSONL with id, title, text per line)"):
        yield f"{path}:{lineno}", record


# ----------------------------------------------------------------------------------------------- build


def _progress(total: int, label: str) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    return progress, progress.add_task(label, total=total)


def _store_corpus(records: Iterable[tuple[str, Any]], tmp: Path) -> tuple[list[str], str]:
    """Check, hash and store every document under ``tmp``; returns the ids and the corpus hash."""
    writer = _CorpusWriter(tmp)
    try:
        for label, doc in records:
            writer.add(label, doc)
        return writer.ids, writer.finish()
    except BaseException:
        writer.close()
        raise


def _index_files(
    tmp: Path,
    backend: str,
    key: str,
    corpus_sha: str,
    ids: list[str],
    settings: dict[str, Any],
    dense: tuple[SentenceEncoder, DenseSettings] | None,
) -> dict[str, Any]:
    """Build the backend's files beside the stored documents in ``tmp``, then its manifest."""
    label = f"indexing {len(ids):,} documents ({backend})"
    progress, task = _progress(len(ids), label)
    advance: Callable[[int], None] = lambda n: progress.advance(task, n)  # noqa: E731

    def phase(text: str) -> None:
        progress.update(task, description=f"{label}: {text}")

    with progress:
        if backend == "default":
            from toolgym.tools.search.bm25 import BM25Settings
            from toolgym.tools.search.bm25_build import build_bm25

            build_bm25(tmp, tmp, ids, BM25Settings(), advance=advance, phase=phase)
        elif backend == "dense":
            from toolgym.tools.search.dense import build_dense

            assert dense is not None
            build_dense(DocumentStore(tmp, with_ids=False), tmp, *dense, advance=advance, phase=phase)
        else:
            from toolgym.tools.search.lucene import build_lucene

            contents = DocumentStore(tmp, with_ids=False).contents()
            build_lucene(ids, contents, tmp / "lucene", advance=advance)
    manifest = {
        "format": FORMAT,
        "backend": backend,
        "key": key,
        "corpus_sha256": corpus_sha,
        "settings": settings,
        "n_docs": len(ids),
        "files": index_file_table(tmp),
    }
    if dense is not None:  # where the encoder was: a hint for load_index, not part of the key
        manifest["encoder_path"] = str(dense[0].info.path)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return manifest


def _build(
    records: Iterable[tuple[str, Any]],
    backend: str,
    path: str | Path | None,
    dense_settings: DenseSettings | None = None,
) -> Index:
    check_backend(backend)
    dense: tuple[SentenceEncoder, DenseSettings] | None = None
    if backend == "dense":
        from toolgym.tools.search.dense import DenseSettings
        from toolgym.tools.search.encoder import SentenceEncoder

        chosen = dense_settings if dense_settings is not None else DenseSettings()
        dense = (SentenceEncoder(chosen.encoder_info(), batch_size=chosen.batch_size), chosen)
        settings = _settings(backend, chosen.key_settings(dense[0].info))
    elif dense_settings is not None:
        raise ConfigError(
            f"dense settings were given for the {backend!r} backend; they apply to 'dense' only"
        )
    else:
        settings = _settings(backend)
    encoder, chosen_dense = dense if dense is not None else (None, None)
    given = Path(path) if path is not None else None
    parent = given.parent if given is not None else cache_dir()
    parent.mkdir(parents=True, exist_ok=True)
    # The corpus is streamed into the store as it is read: where it goes is known only from its
    # hash, so it goes to a temporary sibling first (same file system, so the final rename is atomic).
    name = given.name if given is not None else "index"
    tmp = parent / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        ids, corpus_sha = _store_corpus(records, tmp)
        key_src = json.dumps(
            {"format": FORMAT, "backend": backend, "settings": settings, "corpus": corpus_sha}
        )
        key = hashlib.sha256(key_src.encode()).hexdigest()[:24]
        target = given if given is not None else cache_dir() / f"{backend}-{key}"

        if target.exists():
            try:
                manifest = read_manifest(target)
            except BackendError as exc:
                ours = (target / MANIFEST).exists() or any((target / n).exists() for n in DOC_FILES)
                if not target.is_dir() or (any(target.iterdir()) and not ours):
                    raise ConfigError(
                        f"{target} exists and is not a toolgym index; refusing to overwrite it. "
                        "Fix: pass another path, or remove the directory"
                    ) from None
                log.warning("%s -- rebuilding it from the corpus", exc)
            else:
                if manifest.get("key") == key:
                    try:
                        index = Index(target, manifest, encoder=encoder, dense=chosen_dense)
                    except BackendError as exc:  # checked files that still cannot be read: rebuild
                        log.warning("%s -- rebuilding it from the corpus", exc)
                    else:
                        log.info("search index cache hit: %s", target)
                        return index
                else:
                    log.warning(
                        "the index at %s was built %s; rebuilding it",
                        target,
                        _what_changed(manifest, corpus_sha, settings),
                    )

        manifest = _index_files(tmp, backend, key, corpus_sha, ids, settings, dense)
        try:
            swap_in(tmp, target)
        except OSError:
            # Another process finished the same build first: use its index if it is sound.
            if (target / MANIFEST).exists() and read_manifest(target).get("key") == key:
                log.info("another process built %s first; using it", target)
                return Index(target, read_manifest(target, verify=False), encoder=encoder, dense=chosen_dense)
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("built %s search index of %d documents at %s", backend, len(ids), target)
    return Index(target, manifest, encoder=encoder, dense=chosen_dense)


def _what_changed(manifest: dict[str, Any], corpus_sha: str, settings: dict[str, Any]) -> str:
    """Why a cached index at an explicit path does not fit: for the rebuild warning."""
    if manifest.get("corpus_sha256") != corpus_sha:
        return "from another corpus (its documents changed since)"
    old = manifest.get("settings", {}).get("encoder")
    new = settings.get("encoder")
    if old is not None and new is not None and old != new:
        return (
            f"with another encoder (sha256 {str(old.get('sha256'))[:12]}, {old.get('dim')} dimensions; "
            f"now sha256 {str(new.get('sha256'))[:12]}, {new.get('dim')})"
        )
    return "with other settings or another backend"


def build_index(
    docs: Iterable[dict[str, Any]],
    *,
    backend: str = "default",
    path: str | Path | None = None,
    dense: DenseSettings | None = None,
) -> Index:
    """Index ``docs`` (or reuse the cached index of the identical corpus) and return it open.

    Args:
        docs: ``{"id", "title", "text"}`` dicts; ids unique and non-empty.
        backend: ``"default"`` (in-process BM25), ``"pyserini"`` (Lucene, extra ``toolgym[pyserini]``) or
            ``"dense"`` (a sentence encoder, extra ``toolgym[dense]``).
        path: Where to keep the index; defaults to the cache directory, keyed by corpus and settings.
        dense: The dense backend's settings (encoder, prefixes, dtype, HNSW); default ``DenseSettings()``.

    Raises:
        ConfigError: unknown backend, a malformed document, duplicate ids, an empty corpus, ``path``
            holding something that is not an index, an encoder directory that is not an encoder, or
            dense settings for a BM25 backend.
        MissingDependencyError: a backend without its extra.
    """
    return _build(((f"document {i}", doc) for i, doc in enumerate(docs, 1)), backend, path, dense)


def build_command(corpus: Path, backend: str, out: Path | None, dense: DenseSettings | None = None) -> Path:
    """Body of ``toolgym index build``: index a JSONL corpus and return the index directory.

    Args:
        corpus: JSONL (optionally gzipped), one ``{"id", "title", "text"}`` object per line.
        backend: A name from :data:`BACKENDS`.
        out: Index directory; ``None`` uses the cache directory.
        dense: The dense backend's settings.

    Raises:
        ConfigError: unreadable corpus, or a malformed line (the message names ``file:line``).
    """
    check_backend(backend)
    index = _build(_read_corpus(Path(corpus)), backend, out, dense)
    path = index.path
    index.close()
    return path
