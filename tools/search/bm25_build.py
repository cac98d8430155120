"""Build the default backend's postings: analysis on every core, memory bounded by spilled runs.

The build reads documents from the index's document store (:mod:`toolgym.tools.search.doc_store`), never
from a corpus held in memory, in three steps:

1. **Analyse** (the expensive part: :func:`toolgym.tools.search.bm25.analyze` is Python) tasks of
   ``TASK_DOCS`` documents, in worker processes when the collection is large. A worker returns its
   task's local vocabulary and token ids; the parent maps them to global term ids in task order, so
   the index is byte-identical whatever the number of workers.
2. **Spill runs**: once ``RUN_TOKENS`` tokens are buffered, their (term, document, tf) triples are
   counted with one sort and written to a run file, sorted by term then document. Memory holds one
   run, not the collection.
3. **Merge** terms in ranges of about ``MERGE_POSTINGS`` postings: each run's slice for the range is
   read back and scattered to its place (runs are in document order, so a term's postings come out
   sorted), Lucene's float score of every posting gives the block maxima, and the arrays are appended
   to their ``.npy`` files, with each frequent term's presence map (:func:`presence_layout`). Nothing is
   memory-mapped for writing, so the build's RSS is the working
   set, not the index size.

Files written (all little-endian ``.npy`` arrays unless named otherwise)::

    bm25.json                 format facts: block size, avgdl, docCount, counts, tf width
    bm25_indptr.npy           int64 [terms + 1]: term t's postings are [indptr[t], indptr[t + 1])
    bm25_tfs.npy              uint8/uint16/uint32 [postings]: term frequencies
    bm25_blockptr.npy         int64 [terms + 1]: term t's blocks of BLOCK postings
    bm25_docs.bin             the postings' document positions (ascending within a term), block by
                              block: a block spanning fewer than 65,536 positions stores uint16 offsets
                              from its base (padded to 4 bytes), any other uint32 positions
    bm25_blockoff.npy         int64 [blocks + 1]: where each block's ids start in bm25_docs.bin
    bm25_blockbase.npy        uint32 [blocks]: the block's first document (WIDE_BLOCK: uint32 ids)
    bm25_blockmax.npy         float32 [blocks]: the block's highest boost-1 Lucene score
    bm25_blocklast.npy        uint32 [blocks]: the block's last document
    bm25_idf.npy              float32 [terms]: Lucene's idf
    bm25_norms.npy            uint8 [documents]: Lucene's one-byte length norm code (float32
                              normInverse per document when Lucene's norms are off)
    bm25_normcache.npy        float32 [256]: normInverse = 1 / (k1 * (1 - b + b * length / avgdl))
                              per norm code, as BM25Similarity caches it (empty without the norms)
    bm25_idrank.npy           uint32 [documents]: rank of the external id in sorted order (tie-break)
    bm25_presptr.npy          int64 [terms + 1]: term t's presence map is words [presptr[t],
                              presptr[t + 1]) of bm25_presence.npy (none when empty)
    bm25_presshift.npy        uint8 [terms]: the map's bit g covers documents [g << shift, (g + 1) << shift)
    bm25_presence.npy         uint64 [words]: the maps, bit g of a map set when the term occurs there
    bm25_terms.bin, bm25_terms_offsets.npy, bm25_terms_slots.npy
                              the vocabulary, term id <-> term (:mod:`toolgym.tools.search.string_table`)

Parallelism: :mod:`toolgym.tools.search.bm25_workers` (plain ``python`` subprocesses, one per CPU, at most
8; ``TOOLGYM_INDEX_WORKERS`` sets their number; small collections are analysed in-process).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from toolgym.errors import BackendError
from toolgym.tools.search.bm25 import (
    BM25Settings,
    lucene_avgdl,
    lucene_idf,
    lucene_norm_cache,
    lucene_norm_codes,
    lucene_norm_inverse,
    lucene_term_scores,
)
from toolgym.tools.search.bm25_workers import Workers, analyse_range, worker_count
from toolgym.tools.search.doc_store import DocumentStore
from toolgym.tools.search.string_table import string_table_files, write_string_table

__all__ = ["BLOCK", "FILES", "PRESENCE_BITS", "build_bm25", "presence_layout"]

log = logging.getLogger(__name__)

#: Postings per block (the unit of block-max bounds and of skipping).
BLOCK = 128
TASK_DOCS = 2048
RUN_TOKENS = 4_000_000
MERGE_POSTINGS = 4_000_000
#: A term gets a presence map when it has this many postings and at least one per 1,024 documents.
PRESENCE_MIN_DF = 64
#: Bits per posting a presence map spends (a power of two). A map bit covers 2**shift documents, the
#: largest such group with at most one posting per PRESENCE_BITS groups on average, so about one
#: document in PRESENCE_BITS that lacks the term still finds its bit set.
PRESENCE_BITS = 8
_ARRAYS = (
    "indptr",
    "tfs",
    "blockptr",
    "blockoff",
    "blockbase",
    "blockmax",
    "blocklast",
    "idf",
    "norms",
    "normcache",
    "idrank",
    "presence",
    "presptr",
    "presshift",
)
FILES = (
    "bm25.json",
    "bm25_docs.bin",
    *(f"bm25_{name}.npy" for name in _ARRAYS),
    *string_table_files("bm25_terms"),
)
#: A block's ``blockbase`` when it stores 4-byte ids (it spans 65,536 ids or more).
WIDE_BLOCK = 0xFFFFFFFF


# ----------------------------------------------------------------------------------------------- runs


@dataclass
class _Run:
    """One spilled run: postings sorted by term then document, in two raw files."""

    docs_path: Path
    tfs_path: Path
    terms: np.ndarray  # distinct term ids, ascending
    starts: np.ndarray  # int64 [len(terms) + 1]: where each term's postings start in the run

    def read(self, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        count = last - first
        docs = np.fromfile(self.docs_path, dtype=np.uint32, count=count, offset=4 * first)
        tfs = np.fromfile(self.tfs_path, dtype=np.uint32, count=count, offset=4 * first)
        return docs, tfs


class _Spiller:
    """Buffers (term id, document) token pairs and writes them out as counted, sorted runs."""

    def __init__(self, work: Path) -> None:
        self._work = work
        self._terms: list[np.ndarray] = []
        self._docs: list[np.ndarray] = []
        self._buffered = 0
        self.runs: list[_Run] = []
        self.max_tf = 0

    def add(self, term_ids: np.ndarray, docs: np.ndarray) -> None:
        self._terms.append(term_ids)
        self._docs.append(docs)
        self._buffered += len(term_ids)
        if self._buffered >= RUN_TOKENS:
            self.flush()

    def flush(self) -> None:
        if not self._buffered:
            return
        first = int(self._docs[0][0])
        span = int(self._docs[-1][-1]) - first + 1
        # One key per (term, document) occurrence; sorting the keys orders them by term, then document.
        keys = np.concatenate([t * span + (d - first) for t, d in zip(self._terms, self._docs, strict=True)])
        self._terms, self._docs, self._buffered = [], [], 0
        keys, tf = np.unique(keys, return_counts=True)
        post_terms, post_docs = np.divmod(keys, span)
        del keys
        post_docs += first
        change = np.flatnonzero(np.diff(post_terms)) + 1
        starts = np.concatenate(([0], change, [len(post_terms)])).astype(np.int64)
        run = _Run(
            self._work / f"run{len(self.runs):04d}.docs",
            self._work / f"run{len(self.runs):04d}.tfs",
            post_terms[starts[:-1]].astype(np.int64),
            starts,
        )
        post_docs.astype(np.uint32).tofile(run.docs_path)
        tf.astype(np.uint32).tofile(run.tfs_path)
        self.max_tf = max(self.max_tf, int(tf.max()))
        self.runs.append(run)


class _NpyAppender:
    """Writes a 1-d ``.npy`` file of known length by appending chunks (no memory map)."""

    def __init__(self, path: Path, dtype: Any, length: int) -> None:
        self._fh = open(path, "wb")  # noqa: SIM115 -- closed by close()
        self._dtype = np.dtype(dtype)
        self._left = length
        header = {
            "descr": np.lib.format.dtype_to_descr(self._dtype),
            "fortran_order": False,
            "shape": (length,),
        }
        np.lib.format.write_array_header_1_0(self._fh, header)

    def write(self, values: np.ndarray) -> None:
        self._fh.write(np.ascontiguousarray(values, dtype=self._dtype).tobytes())
        self._left -= len(values)

    def close(self) -> None:
        self._fh.close()
        if self._left != 0:
            raise BackendError(f"internal error: {self._fh.name} is {self._left} items short")


# ---------------------------------------------------------------------------------------------- build


def build_bm25(
    store_path: Path,
    out: Path,
    ids: Sequence[str],
    settings: BM25Settings,
    *,
    advance: Callable[[int], None] | None = None,
    workers: int | None = None,
    phase: Callable[[str], None] | None = None,
) -> list[str]:
    """Index every document of the store under ``store_path`` and write the files in ``FILES`` to ``out``.

    Args:
        store_path: The index directory holding the document store (docs.bin, docs_offsets.npy).
        out: An existing directory for the postings (usually the same directory).
        ids: The external ids in position order (for the tie-breaking rank).
        settings: BM25 parameters.
        advance: Called with the number of documents analysed after each task (drives a progress bar).
        phase: Called with a short description when the build moves on to writing the postings.
        workers: Analysis processes (default :func:`worker_count`; 0 or 1: in-process).

    Returns:
        The names of the files written, relative to ``out``.

    Raises:
        BackendError: an analysis worker failed or died.
    """
    store = DocumentStore(store_path, with_ids=False)
    n_docs = len(store)
    if n_docs >= 2**32 - 1:
        raise BackendError(f"{n_docs:,} documents: the default backend holds fewer than 2**32 - 1")
    work = out / "build-runs"
    work.mkdir()
    try:
        vocab, lengths, spiller = _analyse_all(store, store_path, work, advance, workers)
        if phase is not None:
            phase(f"writing the postings of {len(vocab):,} terms")
        _merge(out, vocab, lengths, spiller, ids, settings)
    finally:
        for leftover in work.iterdir():
            leftover.unlink()
        work.rmdir()
    return list(FILES)


def _analyse_all(
    store: DocumentStore,
    store_path: Path,
    work: Path,
    advance: Callable[[int], None] | None,
    workers: int | None,
) -> tuple[list[str], np.ndarray, _Spiller]:
    n_docs = len(store)
    tasks = [(lo, min(lo + TASK_DOCS, n_docs)) for lo in range(0, n_docs, TASK_DOCS)]
    n_workers = worker_count(n_docs) if workers is None else (workers if workers > 1 else 0)
    n_workers = min(n_workers, len(tasks))
    vocab: dict[str, int] = {}
    lengths = np.zeros(n_docs, dtype=np.int64)
    spiller = _Spiller(work)
    pool = Workers(n_workers, store_path) if n_workers > 1 else None
    if pool is not None:
        log.info("analysing %d documents in %d worker processes", n_docs, n_workers)
    try:
        results = pool.run(tasks) if pool is not None else (analyse_range(store, lo, hi) for lo, hi in tasks)
        for (lo, hi), (local_terms, tokens, task_lengths) in zip(tasks, results, strict=True):
            to_global = np.fromiter(
                (vocab.setdefault(t, len(vocab)) for t in local_terms), dtype=np.int64, count=len(local_terms)
            )
            counts = np.frombuffer(task_lengths, dtype=np.int32)
            lengths[lo:hi] = counts
            token_ids = np.frombuffer(tokens, dtype=np.int32)
            if len(token_ids):
                spiller.add(to_global[token_ids], np.repeat(np.arange(lo, hi, dtype=np.int64), counts))
            if advance is not None:
                advance(hi - lo)
    finally:
        if pool is not None:
            pool.close()
    spiller.flush()
    return list(vocab), lengths, spiller


def _merge(
    out: Path,
    terms: list[str],
    lengths: np.ndarray,
    spiller: _Spiller,
    ids: Sequence[str],
    settings: BM25Settings,
) -> None:
    n_terms, n_docs = len(terms), len(lengths)
    df = np.zeros(n_terms, dtype=np.int64)
    for run in spiller.runs:
        df[run.terms] += np.diff(run.starts)
    indptr = np.zeros(n_terms + 1, dtype=np.int64)
    np.cumsum(df, out=indptr[1:])
    n_blocks = (df + BLOCK - 1) // BLOCK
    blockptr = np.zeros(n_terms + 1, dtype=np.int64)
    np.cumsum(n_blocks, out=blockptr[1:])

    doc_count = int(np.count_nonzero(lengths))
    avgdl = lucene_avgdl(int(lengths.sum()), doc_count)
    if settings.lucene_norms:  # stored: each document's norm code, and the cache that decodes it
        stored_norms, cache = lucene_norm_codes(lengths), lucene_norm_cache(avgdl, settings)
        norms = cache[stored_norms]
    else:  # stored: each document's normInverse
        norms = stored_norms = lucene_norm_inverse(lengths, avgdl, settings)
        cache = np.zeros(0, dtype=np.float32)
    idf = lucene_idf(doc_count, df)
    tf_dtype = np.uint8 if spiller.max_tf <= 0xFF else np.uint16 if spiller.max_tf <= 0xFFFF else np.uint32

    n_postings, total_blocks = int(indptr[-1]), int(blockptr[-1])
    presshift, presptr = presence_layout(df, n_docs)
    presence = (presshift, presptr)
    writers = {
        "presence": _NpyAppender(out / "bm25_presence.npy", np.uint64, int(presptr[-1])),
        "tfs": _NpyAppender(out / "bm25_tfs.npy", tf_dtype, n_postings),
        "blockmax": _NpyAppender(out / "bm25_blockmax.npy", np.float32, total_blocks),
        "blocklast": _NpyAppender(out / "bm25_blocklast.npy", np.uint32, total_blocks),
        "blockbase": _NpyAppender(out / "bm25_blockbase.npy", np.uint32, total_blocks),
    }
    blockoff = np.zeros(total_blocks + 1, dtype=np.int64)
    try:
        with open(out / "bm25_docs.bin", "wb") as id_file:
            for a, b in _term_ranges(indptr):
                merged = _merge_range(
                    a, b, indptr, blockptr, df, n_blocks, idf, norms, presence, spiller.runs, writers
                )
                first_block = int(blockptr[a])
                blockoff[first_block + 1 : int(blockptr[b]) + 1] = id_file.tell() + merged.block_ends
                id_file.write(merged.id_bytes)
    finally:
        for writer in writers.values():
            writer.close()
    np.save(out / "bm25_blockoff.npy", blockoff)
    saved = {"indptr": indptr, "blockptr": blockptr, "idf": idf, "norms": stored_norms, "normcache": cache}
    saved |= {"presptr": presptr, "presshift": presshift}
    for name, values in saved.items():
        np.save(out / f"bm25_{name}.npy", values)
    np.save(out / "bm25_idrank.npy", _id_ranks(ids))
    write_string_table(terms, out, "bm25_terms")
    meta = {
        "block": BLOCK,
        "presence_bits": PRESENCE_BITS,
        "n_docs": n_docs,
        "n_terms": n_terms,
        "n_postings": n_postings,
        "doc_count": doc_count,
        "avgdl": float(avgdl),
        "tf_dtype": np.dtype(tf_dtype).name,
    }
    (out / "bm25.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")


def presence_layout(df: np.ndarray, n_docs: int) -> tuple[np.ndarray, np.ndarray]:
    """Each term's presence-map shift (uint8) and word offsets (int64 [terms + 1]; no map: none).

    The kernel looks a candidate document up in the maps of the frequent terms it would otherwise
    seek (and mostly miss) in their postings. ``shift`` is the largest with ``PRESENCE_BITS * df <<
    shift <= n_docs`` (0 for terms denser than that: one bit per document, an exact map).
    """
    df = np.asarray(df, dtype=np.int64)
    mapped = (df >= PRESENCE_MIN_DF) & (df * 1024 >= n_docs)
    need = PRESENCE_BITS * np.maximum(df, 1)
    shift = np.floor(np.log2(np.maximum(n_docs / need, 1.0))).astype(np.int64)
    shift += (need << (shift + 1)) <= n_docs  # float log2 can be one off either way at powers of two
    shift -= (shift > 0) & ((need << shift) > n_docs)
    words = np.where(mapped, (((max(n_docs, 1) - 1) >> shift) >> 6) + 1, 0)
    presptr = np.zeros(len(df) + 1, dtype=np.int64)
    np.cumsum(words, out=presptr[1:])
    return shift.astype(np.uint8), presptr


def _presence_maps(docs: np.ndarray, starts: np.ndarray, shift: np.ndarray, words: np.ndarray) -> np.ndarray:
    """The presence maps of one merged range's terms (``starts``: their postings' offsets in ``docs``)."""
    parts = []
    for t in np.flatnonzero(words):
        bits = np.zeros(int(words[t]) * 64, dtype=bool)
        bits[docs[starts[t] : starts[t + 1]] >> shift[t]] = True
        parts.append(np.packbits(bits, bitorder="little").view(np.uint64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)


def _term_ranges(indptr: np.ndarray) -> Iterator[tuple[int, int]]:
    """Consecutive term ranges [a, b) of about MERGE_POSTINGS postings (a huge term gets its own)."""
    n_terms = len(indptr) - 1
    a = 0
    while a < n_terms:
        b = int(np.searchsorted(indptr, indptr[a] + MERGE_POSTINGS, side="right")) - 1
        b = min(max(b, a + 1), n_terms)
        yield a, b
        a = b


@dataclass
class _MergedIds:
    """A merged term range's document ids in block-coded form (see the module docstring)."""

    id_bytes: bytes
    block_ends: np.ndarray  # int64, each block's end offset within id_bytes


def _encode_ids(docs: np.ndarray, blocks: np.ndarray, writers: dict[str, _NpyAppender]) -> _MergedIds:
    """Block-code ``docs`` (the range's ids; ``blocks``: where each block starts) and write the bases."""
    counts = np.diff(np.append(blocks, len(docs)))
    first = docs[blocks]
    narrow = (docs[np.append(blocks[1:], len(docs)) - 1] - first) < 0x10000
    sizes = np.where(narrow, 2 * counts + 2 * (counts & 1), 4 * counts)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    buffer = np.zeros(int(ends[-1]) if len(ends) else 0, dtype=np.uint8)
    block_of = np.repeat(np.arange(len(blocks)), counts)
    within = np.arange(len(docs)) - blocks[block_of]
    is_narrow = narrow[block_of]
    halves, words = buffer.view(np.uint16), buffer.view(np.uint32)
    halves[(starts[block_of] // 2 + within)[is_narrow]] = (docs - first[block_of])[is_narrow]
    words[(starts[block_of] // 4 + within)[~is_narrow]] = docs[~is_narrow]
    writers["blockbase"].write(np.where(narrow, first, WIDE_BLOCK).astype(np.uint32))
    return _MergedIds(buffer.tobytes(), ends.astype(np.int64))


def _merge_range(
    a: int,
    b: int,
    indptr: np.ndarray,
    blockptr: np.ndarray,
    df: np.ndarray,
    n_blocks: np.ndarray,
    idf: np.ndarray,
    norms: np.ndarray,
    presence: tuple[np.ndarray, np.ndarray],
    runs: list[_Run],
    writers: dict[str, _NpyAppender],
) -> _MergedIds:
    base = int(indptr[a])
    total = int(indptr[b]) - base
    docs = np.empty(total, dtype=np.uint32)
    tfs = np.empty(total, dtype=np.uint32)
    fill = indptr[a:b] - base  # where each term's next posting goes
    for run in runs:  # in document order, so each term's postings land sorted
        i0, i1 = (int(x) for x in np.searchsorted(run.terms, [a, b]))
        if i0 == i1:
            continue
        first, last = int(run.starts[i0]), int(run.starts[i1])
        run_docs, run_tfs = run.read(first, last)
        here = run.terms[i0:i1] - a
        counts = np.diff(run.starts[i0 : i1 + 1])
        dest = np.repeat(fill[here] - (run.starts[i0:i1] - first), counts) + np.arange(last - first)
        docs[dest] = run_docs
        tfs[dest] = run_tfs
        fill[here] += counts
    term_of = np.repeat(np.arange(a, b), df[a:b])
    scores = lucene_term_scores(idf[term_of], tfs, norms[docs])
    del term_of
    blocks = np.repeat(indptr[a:b] - base, n_blocks[a:b]) + BLOCK * (
        np.arange(int(blockptr[b] - blockptr[a])) - np.repeat(blockptr[a:b] - blockptr[a], n_blocks[a:b])
    )
    writers["tfs"].write(tfs)
    writers["blockmax"].write(np.maximum.reduceat(scores, blocks))
    writers["blocklast"].write(docs[np.append(blocks[1:], total) - 1])
    starts = indptr[a : b + 1] - base
    presshift, presptr = presence
    writers["presence"].write(_presence_maps(docs, starts, presshift[a:b], np.diff(presptr[a : b + 1])))
    return _encode_ids(docs, blocks, writers)


def _id_ranks(ids: Sequence[str]) -> np.ndarray:
    """Each document's rank in the sorted order of external ids (code point order, which is the UTF-8
    byte order Lucene sorts ids by)."""
    order = sorted(range(len(ids)), key=ids.__getitem__)
    ranks = np.empty(len(ids), dtype=np.uint32)
    ranks[np.asarray(order, dtype=np.int64)] = np.arange(len(ids), dtype=np.uint32)
    return ranks
