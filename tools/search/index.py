"""Search indexes over a document collection: build once, cache on disk, open in milliseconds.

Three backends, over the same input — each document's title, a newline, then its text. Two rank with
the same BM25 (Lucene's, as Anserini configures it):

* ``default`` — :mod:`toolgym.tools.search.bm25` (in-process; a C kernel over memory-mapped numpy arrays,
  no server and no Java); the base install. Same scores and order as the Lucene backend, bit for bit.
* ``pyserini`` — Lucene itself via :mod:`toolgym.tools.search.lucene` (extra ``toolgym[pyserini]``); the
  reference the default backend is measured against.

and one by a sentence encoder's inner product:

* ``dense`` — :mod:`toolgym.tools.search.dense` (extra ``toolgym[dense]``): passage embeddings computed
  once at build, searched exactly or through an HNSW graph; its settings are a
  :class:`~toolgym.tools.search.dense.DenseSettings`, and the encoder's identity (a hash of its files,
  its pooling, window and prefixes) is part of the cache key.

Hybrid retrieval fuses a BM25 index and a dense index of the same corpus
(:mod:`toolgym.tools.search.hybrid`); environments choose among the three through
:mod:`toolgym.tools.search.retriever`. Every one of them is a :class:`SearchIndex`.

On-disk layout (one directory per index)::

    manifest.json        format, backend, cache key, corpus hash, settings, size and sha256 of every file
    verified.json        when each file's checksum was last verified (see index_manifest)
    docs.bin, docs_offsets.npy, docs_ids.*
                         the document store (toolgym.tools.search.doc_store): texts and external ids
    bm25*.npy, bm25*.bin, bm25.json / lucene/ / dense*
                         the backend's own files (toolgym.tools.search.bm25_build lists the default's,
                         toolgym.tools.search.dense the dense one's)

A build streams its corpus: each document is checked, hashed and appended to the store as it
arrives, so memory holds ids, not texts. It writes into a temporary sibling directory renamed into
place only when complete, so a killed build leaves no half-index under the real name. Opening checks
every file against the manifest, its size always and its sha256 unless the file is unchanged since
it was last verified (:mod:`toolgym.tools.search.index_manifest`): a truncated or altered index is never
used silently. :func:`build_index` then logs a warning and rebuilds it (it has the corpus);
:func:`load_index` raises :class:`~toolgym.errors.BackendError` saying how to fix it. Opening reads no
file whole, so it costs the same for a thousand documents or a million.

Cache directory: ``$TOOLGYM_CACHE/index`` if ``TOOLGYM_CACHE`` is set, else ``~/.cache/toolgym/index``;
the directory name is the backend plus a hash of the corpus content and the ranking settings (for
``dense``, the encoder's identity among them), so the same corpus is indexed once per encoder and any
change to it builds a new index.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from toolgym.data import iter_jsonl
from toolgym.errors import BackendError, ConfigError, ToolCallError, did_you_mean
from toolgym.tools.search.bm25 import anserini_display
from toolgym.tools.search.doc_store import DOC_FILES, DocumentStore, DocumentWriter
from toolgym.tools.search.index_manifest import FORMAT, MANIFEST, file_table, fix_hint, read_manifest

if TYPE_CHECKING:
    from toolgym.tools.search.dense import DenseSettings
    from toolgym.tools.search.encoder import SentenceEncoder

__all__ = [
    "BACKENDS",
    "MAX_K",
    "Hit",
    "Index",
    "SearchIndex",
    "UnknownDocument",
    "build_command",
    "build_index",
    "cache_dir",
    "load_index",
]

log = logging.getLogger(__name__)

BACKENDS = ("default", "pyserini", "dense")
#: Largest ``k`` a search accepts: deeper lists are a mistake in an agent's call, not a need.
MAX_K = 1000


@dataclass(frozen=True)
class Hit:
    """One search result: the document's id and its score (higher is better): BM25, the inner product
    of the query's and the passage's vectors (dense), or the fused score (hybrid)."""

    doc_id: str
    score: float


class UnknownDocument(ToolCallError, KeyError):
    """``Index.get`` was asked for an id the collection does not hold (the caller's mistake: a tool
    that reads documents by the model's id answers it as a failed call)."""

    def __init__(self, doc_id: str) -> None:
        super().__init__(f"no document with id {doc_id!r}")
        self.doc_id = doc_id

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class _Ranker(Protocol):
    def top_k(self, query: str, k: int) -> list[tuple[Any, float]]: ...

    def top_k_batch(
        self, queries: Sequence[str], k: int, threads: int = 1
    ) -> list[list[tuple[Any, float]]]: ...


class SearchIndex(Protocol):
    """What environments use of a search index; :class:`Index` and
    :class:`~toolgym.tools.search.hybrid.HybridIndex` are ones. Thread-safe.

    ``search`` raises :class:`~toolgym.errors.ToolCallError` for an empty query or ``k`` outside
    1..``MAX_K``; ``get`` raises :class:`UnknownDocument`; ``provenance`` is what results depend on
    (for run manifests).
    """

    @property
    def provenance(self) -> dict[str, Any]: ...

    def __len__(self) -> int: ...

    def search(self, query: str, k: int = 10) -> list[Hit]: ...

    def search_batch(self, queries: Sequence[str], k: int = 10, threads: int = 1) -> list[list[Hit]]: ...

    def get(self, doc_id: str) -> dict[str, str]: ...

    def close(self) -> None: ...


def cache_dir() -> Path:
    """Where cached indexes live (``$TOOLGYM_CACHE/index`` or ``~/.cache/toolgym/index``)."""
    root = os.environ.get("TOOLGYM_CACHE")
    return Path(root) / "index" if root else Path.home() / ".cache" / "toolgym" / "index"


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ConfigError(
            f"unknown search backend {backend!r}; expected one of {', '.join(BACKENDS)}."
            + did_you_mean(str(backend), BACKENDS)
        )


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


# ----------------------------------------------------------------------------------------------- index


class Index:
    """A searchable, read-only document collection. Build with :func:`build_index`, reopen with :func:`load_index`.

    Thread-safe for concurrent ``search``/``get`` calls. A ``dense`` index embeds queries with
    ``encoder`` (default: the one :func:`_dense_encoder` finds for it) and searches as ``dense`` says
    (:class:`~toolgym.tools.search.dense.DenseSettings`: exact or HNSW, ``ef_search``).
    """

    def __init__(
        self,
        path: Path,
        manifest: dict[str, Any],
        *,
        encoder: SentenceEncoder | None = None,
        dense: DenseSettings | None = None,
    ) -> None:
        self._path = path
        self._manifest = manifest
        self._backend: str = manifest["backend"]
        self._n_docs: int = manifest["n_docs"]
        self._ranker: _Ranker
        self._search: dict[str, Any] | None = None
        try:
            self._store = DocumentStore(path)
            if self._backend == "default":
                from toolgym.tools.search.bm25_search import BM25Ranker

                self._ranker = BM25Ranker(path)
            elif self._backend == "dense":
                from toolgym.tools.search.dense import DenseRanker, DenseSettings

                settings = dense if dense is not None else DenseSettings()
                ranker = DenseRanker(
                    path,
                    encoder if encoder is not None else _dense_encoder(manifest, settings),
                    search=settings.search,
                    ef_search=settings.hnsw_ef_search,
                )
                self._ranker, self._search = ranker, ranker.search_settings
        except (OSError, ValueError, KeyError) as exc:
            raise BackendError(f"cannot read the index at {path} ({exc}). {fix_hint(path)}") from None
        if len(self._store) != self._n_docs:
            raise BackendError(
                f"the index at {path} stores {len(self._store)} documents, its manifest says "
                f"{self._n_docs}. {fix_hint(path)}"
            )
        if self._backend == "pyserini":
            from toolgym.tools.search.lucene import LuceneBM25

            self._ranker = LuceneBM25(path / "lucene")

    @property
    def path(self) -> Path:
        """The index directory."""
        return self._path

    @property
    def backend(self) -> str:
        """``"default"``, ``"pyserini"`` or ``"dense"``."""
        return self._backend

    @property
    def provenance(self) -> dict[str, Any]:
        """What the results depend on: backend, ranking settings (a dense index's encoder identity among
        them), corpus hash and size, and for a dense index how it is searched (for run manifests)."""
        found = {k: self._manifest.get(k) for k in ("backend", "key", "corpus_sha256", "settings", "n_docs")}
        if self._search is not None:
            found["search"] = dict(self._search)
        return found

    def __len__(self) -> int:
        return self._n_docs

    def __repr__(self) -> str:
        return f"Index(backend={self._backend!r}, docs={self._n_docs}, path={str(self._path)!r})"

    @staticmethod
    def _check(query: str, k: int) -> None:
        if not isinstance(query, str) or not query.strip():
            raise ToolCallError("empty query: pass some words to search for")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
            raise ToolCallError(f"k must be an integer from 1 to {MAX_K}, got {k!r}")

    def _hits(self, found: list[tuple[Any, float]], k: int) -> list[Hit]:
        if self._backend == "pyserini":
            return [Hit(doc_id, score) for doc_id, score in found[:k]]
        ids = self._store.ids
        assert ids is not None
        if self._backend == "dense":
            return [Hit(ids.get(position), score) for position, score in found[:k]]
        # Already in Anserini's order; show the scores as Anserini does (4 decimals, ties nudged).
        shown = anserini_display([score for _, score in found[:k]])
        return [Hit(ids.get(position), score) for (position, _), score in zip(found, shown, strict=False)]

    def search(self, query: str, k: int = 10) -> list[Hit]:
        """The ``k`` best documents for ``query``, best first (fewer if fewer match, or the collection is smaller).

        Raises:
            ToolCallError: the query is empty or ``k`` is outside 1..``MAX_K``.
        """
        self._check(query, k)
        return self._hits(self._ranker.top_k(query, k), k)

    def search_batch(self, queries: Sequence[str], k: int = 10, threads: int = 1) -> list[list[Hit]]:
        """:meth:`search` for many queries at once, over ``threads`` threads; results in query order."""
        for query in queries:
            self._check(query, k)
        return [self._hits(found, k) for found in self._ranker.top_k_batch(list(queries), k, threads)]

    def get(self, doc_id: str) -> dict[str, str]:
        """The stored document ``{"id", "title", "text"}``.

        Raises:
            UnknownDocument: no document has this id.
            BackendError: the stored bytes are not UTF-8 (the files changed on disk after opening).
        """
        ids = self._store.ids
        assert ids is not None
        position = ids.find(doc_id) if isinstance(doc_id, str) else -1
        if position < 0:
            raise UnknownDocument(doc_id)
        raw_title, raw_text = self._store.raw(position)
        try:
            title, text = raw_title.decode("utf-8"), raw_text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BackendError(
                f"the index at {self._path} is corrupt: document {doc_id!r} is not UTF-8 ({exc}); its "
                f"files changed after it was opened. {fix_hint(self._path)}"
            ) from None
        return {"id": doc_id, "title": title, "text": text}

    def close(self) -> None:
        """Release backend resources (the Lucene reader); the object is unusable afterwards."""
        close = getattr(self._ranker, "close", None)
        if close is not None:
            close()


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


def _dense_encoder(manifest: dict[str, Any], settings: DenseSettings) -> SentenceEncoder:
    """The encoder to query a dense index with: ``settings.encoder``, else the directory the index was
    built from (when it is still there), else the shipped default; unset prefixes and window come from
    the index's record, so an index built with e5's prefixes reopens without restating them (the ranker
    then checks that the encoder is the index's)."""
    from toolgym.tools.search.encoder import SentenceEncoder, default_encoder_path, inspect_encoder

    stored = manifest.get("settings", {}).get("encoder", {})
    path: Path | None = Path(settings.encoder) if settings.encoder is not None else None
    if path is None:
        built = manifest.get("encoder_path")
        path = Path(built) if built and (Path(built) / "config.json").is_file() else default_encoder_path()
    info = inspect_encoder(
        path,
        query_prefix=settings.query_prefix
        if settings.query_prefix is not None
        else stored.get("query_prefix"),
        passage_prefix=settings.passage_prefix
        if settings.passage_prefix is not None
        else stored.get("passage_prefix"),
        max_tokens=settings.max_tokens if settings.max_tokens is not None else stored.get("max_tokens"),
    )
    return SentenceEncoder(info, batch_size=settings.batch_size)


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
        "files": file_table(tmp),
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
    _check_backend(backend)
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
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            target.rename(old)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same build first: use its index if it is sound.
            if (target / MANIFEST).exists() and read_manifest(target).get("key") == key:
                log.info("another process built %s first; using it", target)
                return Index(target, read_manifest(target, verify=False), encoder=encoder, dense=chosen_dense)
            raise
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
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


def load_index(
    path: str | Path, *, verify: bool | Literal["full"] = True, dense: DenseSettings | None = None
) -> Index:
    """Open an index directory written by :func:`build_index` after checking every file (module docstring).

    Args:
        path: The index directory.
        verify: ``True``: sizes, and checksums of files not verified unchanged since; ``"full"``: every
            checksum; ``False``: sizes only (:func:`toolgym.tools.search.index_manifest.read_manifest`).
        dense: For a dense index: the encoder to embed queries with and how to search; unset fields
            come from the index (its encoder's directory when still there, its prefixes and window).

    Raises:
        BackendError: the directory is missing, incomplete or corrupt (the message says how to fix it).
        ConfigError: a dense index opened with an encoder other than the one it was built with.
    """
    path = Path(path)
    return Index(path, read_manifest(path, verify=verify), dense=dense)


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
    _check_backend(backend)
    index = _build(_read_corpus(Path(corpus)), backend, out, dense)
    path = index.path
    index.close()
    return path
