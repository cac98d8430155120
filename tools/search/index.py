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
    verified.json        when each file's checksum was last verified (see index_files)
    docs.bin, docs_offsets.npy, docs_ids.*
                         the document store (toolgym.tools.search.doc_store): texts and external ids
    bm25*.npy, bm25*.bin, bm25.json / lucene/ / dense*
                         the backend's own files (toolgym.tools.search.bm25_build lists the default's,
                         toolgym.tools.search.dense the dense one's)

Building lives in :mod:`toolgym.tools.search.index_build` (:func:`~toolgym.tools.search.index_build.build_index`,
which imports this module; this one does not import it back): it
streams its corpus, each document checked, hashed and appended to the store as it arrives, so memory
holds ids, not texts, and writes into a temporary sibling directory renamed into place only when
complete, so a killed build leaves no half-index under the real name. This module opens. Opening checks
every file against the manifest, its size always and its sha256 unless the file is unchanged since
it was last verified (:mod:`toolgym.tools.search.index_files`): a truncated or altered index is never
used silently. :func:`~toolgym.tools.search.index_build.build_index` then logs a warning and rebuilds it (it has the corpus);
:func:`load_index` raises :class:`~toolgym.errors.BackendError` saying how to fix it. Opening reads no
file whole, so it costs the same for a thousand documents or a million.

Cache directory: ``$TOOLGYM_CACHE/index`` if ``TOOLGYM_CACHE`` is set, else ``~/.cache/toolgym/index``;
the directory name is the backend plus a hash of the corpus content and the ranking settings (for
``dense``, the encoder's identity among them), so the same corpus is indexed once per encoder and any
change to it builds a new index.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from toolgym.errors import BackendError, ConfigError, ToolCallError, did_you_mean
from toolgym.tools.search.bm25 import anserini_display
from toolgym.tools.search.doc_store import DocumentStore
from toolgym.tools.search.index_files import fix_hint, read_manifest

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
    "cache_dir",
    "load_index",
]

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


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ConfigError(
            f"unknown search backend {backend!r}; expected one of {', '.join(BACKENDS)}."
            + did_you_mean(str(backend), BACKENDS)
        )


# ----------------------------------------------------------------------------------------------- index


class Index:
    """A searchable, read-only document collection. Build with :func:`~toolgym.tools.search.index_build.build_index`, reopen with :func:`load_index`.

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

    def doc_id_at(self, position: int) -> str:
        """The id of the collection's ``position``-th document (0 to ``len(self) - 1``)."""
        ids = self._store.ids
        assert ids is not None
        if not 0 <= position < self._n_docs:
            raise IndexError(f"document position {position} outside 0..{self._n_docs - 1}")
        return str(ids.get(position))

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


def load_index(
    path: str | Path, *, verify: bool | Literal["full"] = True, dense: DenseSettings | None = None
) -> Index:
    """Open an index directory written by :func:`~toolgym.tools.search.index_build.build_index` after checking every file (module docstring).

    Args:
        path: The index directory.
        verify: ``True``: sizes, and checksums of files not verified unchanged since; ``"full"``: every
            checksum; ``False``: sizes only (:func:`toolgym.tools.search.index_files.read_manifest`).
        dense: For a dense index: the encoder to embed queries with and how to search; unset fields
            come from the index (its encoder's directory when still there, its prefixes and window).

    Raises:
        BackendError: the directory is missing, incomplete or corrupt (the message says how to fix it).
        ConfigError: a dense index opened with an encoder other than the one it was built with.
    """
    path = Path(path)
    return Index(path, read_manifest(path, verify=verify), dense=dense)
