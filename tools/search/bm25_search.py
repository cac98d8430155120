"""Answer BM25 queries over the files :mod:`toolgym.tools.search.bm25_build` wrote.

:class:`BM25Ranker` analyses a query (:func:`toolgym.tools.search.bm25.analyze`), counts repeated terms
into boosts as Anserini's bag-of-words query does, looks the terms up in the memory-mapped vocabulary
and hands the rest to the C kernel (``tools/search/_bm25kernel.c``: block-max MaxScore, Lucene's float
arithmetic, Anserini's order), which runs without the GIL: ``top_k_batch`` with ``threads > 1``
searches on that many threads of this process, sharing one copy of the pages.

The kernel's per-term data (postings' ids and frequencies, presence maps) is not memory-mapped
but read on first use (:class:`_ReadOnUse`), so memory follows the terms searched, not the file
sizes.

:func:`exhaustive_top_k` scores every posting of the query's terms with numpy, no pruning (what the
numpy backend before the kernel did): the reference the kernel is tested against.
"""

from __future__ import annotations

import json
import mmap
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from toolgym.tools.search.bm25 import analyze, lucene_term_scores
from toolgym.tools.search.string_table import StringTable

__all__ = ["BM25Ranker", "exhaustive_top_k"]


class BM25Ranker:
    """The default backend's ranker over the index directory ``path``; read-only and thread-safe.

    Raises:
        OSError, ValueError: a file is missing or its arrays do not fit together (the index layer
            turns this into BackendError with the fix).
    """

    def __init__(self, path: Path) -> None:
        from toolgym.tools.search._bm25kernel import Ranker

        meta = json.loads((path / "bm25.json").read_text(encoding="utf-8"))
        names = (
            "blockoff",
            "blockbase",
            "tfs",
            "norms",
            "normcache",
            "idrank",
            "indptr",
            "blockptr",
            "blockmax",
            "blocklast",
            "idf",
            "presence",
            "presptr",
            "presshift",
        )
        files = {name: np.load(path / f"bm25_{name}.npy", mmap_mode="r") for name in names}
        arrays = {name: np.asarray(array) for name, array in files.items()}
        ids = path / "bm25_docs.bin"
        arrays["docbytes"] = (
            np.asarray(np.memmap(ids, dtype=np.uint8, mode="r"))
            if ids.stat().st_size
            else np.zeros(0, np.uint8)
        )
        self.arrays = arrays
        self.block = int(meta["block"])

        def part(name: str, bounds: np.ndarray) -> tuple[Path, int, np.ndarray, Any]:
            array = files[name]
            return path / f"bm25_{name}.npy", int(array.offset), bounds * array.itemsize, array.dtype

        self._parts = _ReadOnUse(
            {
                "docbytes": (ids, 0, arrays["blockoff"][arrays["blockptr"]], np.uint8),
                "tfs": part("tfs", arrays["indptr"]),
                "presence": part("presence", arrays["presptr"]),
            }
        )
        self._kernel = Ranker(**(arrays | self._parts.arrays), block=self.block)
        self._terms = StringTable(path, "bm25_terms")
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._pool_lock = threading.Lock()

    def term_docs(self, tid: int) -> np.ndarray:
        """The document positions of term ``tid``'s postings, decoded from their blocks (int64)."""
        a = self.arrays
        first, last = int(a["blockptr"][tid]), int(a["blockptr"][tid + 1])
        n = int(a["indptr"][tid + 1] - a["indptr"][tid])
        out = np.empty(n, dtype=np.int64)
        for j, block in enumerate(range(first, last)):
            count = min(self.block, n - j * self.block)
            raw = a["docbytes"][int(a["blockoff"][block]) : int(a["blockoff"][block + 1])]
            base = int(a["blockbase"][block])
            if base == 0xFFFFFFFF:
                values = raw.view(np.uint32)[:count].astype(np.int64)
            else:
                values = raw.view(np.uint16)[:count].astype(np.int64) + base
            out[j * self.block : j * self.block + count] = values
        return out

    def query_terms(self, query: str) -> tuple[np.ndarray, np.ndarray]:
        """The query's known term ids (first occurrence order) and their boosts (repeat counts)."""
        counts: dict[int, int] = {}
        for term in analyze(query):
            tid = self._terms.find(term)
            if tid >= 0:
                counts[tid] = counts.get(tid, 0) + 1
        return np.fromiter(counts, dtype=np.int64, count=len(counts)), np.fromiter(
            counts.values(), dtype=np.float32, count=len(counts)
        )

    def top_k(self, query: str, k: int) -> list[tuple[int, float]]:
        """The ``k`` best (document position, float score) pairs in Anserini's order."""
        tids, boosts = self.query_terms(query)
        if not len(tids):
            return []
        self._parts.read(tids.tolist())
        return self._kernel.search(tids.tobytes(), boosts.tobytes(), k)

    def top_k_batch(self, queries: Sequence[str], k: int, threads: int = 1) -> list[list[tuple[int, float]]]:
        """:meth:`top_k` for each query, on ``threads`` threads (results in query order)."""
        if threads <= 1 or len(queries) < 2:
            return [self.top_k(q, k) for q in queries]
        with self._pool_lock:
            if self._pool is None or self._pool_size != threads:
                if self._pool is not None:
                    self._pool.shutdown()
                self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="toolgym-bm25")
                self._pool_size = threads
            pool = self._pool
        size = max(1, len(queries) // (8 * threads))
        chunks = [queries[i : i + size] for i in range(0, len(queries), size)]
        results: list[list[tuple[int, float]]] = []
        for part in pool.map(lambda chunk: [self.top_k(q, k) for q in chunk], chunks):
            results.extend(part)
        return results

    def close(self) -> None:
        """Stop the search threads, if any were started (idempotent)."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None


class _ReadOnUse:
    """Arrays the kernel reads, each term's part read from its file the first time a query uses the
    term (into zeroed memory whose pages become resident only when written, 4 KiB at a time).

    ``parts`` maps an array name to (file, where its data starts, the byte offset of each term's part
    in it [terms + 1], dtype). Memory-mapping the files would be less code, but a page fault on a
    mapped file may map a whole cached folio of neighbouring terms' data (up to 2 MiB; numpy's large
    allocations ask for 2 MiB pages the same way), so a process's memory would follow the file sizes,
    not the terms it searches. The kernel must only see terms whose parts were read (:meth:`read`).
    """

    def __init__(self, parts: dict[str, tuple[Path, int, np.ndarray, Any]]) -> None:
        self._parts = parts
        self.arrays: dict[str, np.ndarray] = {}
        self._regions: dict[str, memoryview] = {}
        for name, (_, _, bounds, dtype) in parts.items():
            size = int(bounds[-1]) if len(bounds) else 0
            region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) if size else bytearray()
            self._regions[name] = memoryview(region)
            self.arrays[name] = np.frombuffer(region, dtype=dtype)
        self._done = bytearray(len(next(iter(parts.values()))[2]))
        self._lock = threading.Lock()

    def read(self, terms: list[int]) -> None:
        """Read the parts of ``terms`` not read yet (thread-safe; a no-op once all are)."""
        todo = [t for t in terms if not self._done[t]]
        if not todo:
            return
        with self._lock:
            for name, (file, start, bounds, _) in self._parts.items():
                with open(file, "rb") as fh:
                    for t in todo:
                        first, last = int(bounds[t]), int(bounds[t + 1])
                        if last > first and not self._done[t]:
                            fh.seek(start + first)
                            if fh.readinto(self._regions[name][first:last]) != last - first:
                                raise ValueError(f"{file} is shorter than its index says")
            for t in todo:
                self._done[t] = 1


def exhaustive_top_k(ranker: BM25Ranker, query: str, k: int) -> list[tuple[int, float]]:
    """The same answer as :meth:`BM25Ranker.top_k`, by scoring every posting of the query's terms.

    Term scores are Lucene's float32 ones, summed per document in float64 and cast to float32;
    the order is score first, then the external id's rank.
    """
    tids, boosts = ranker.query_terms(query)
    if not len(tids):
        return []
    a = ranker.arrays
    total: np.ndarray | None = None
    parts = []
    for tid, boost in zip(tids.tolist(), boosts.tolist(), strict=True):
        start, end = int(a["indptr"][tid]), int(a["indptr"][tid + 1])
        docs = ranker.term_docs(tid)
        weight = np.float32(boost) * a["idf"][tid]
        norms = a["normcache"][a["norms"][docs]] if len(a["normcache"]) else a["norms"][docs]
        scores = lucene_term_scores(weight, np.asarray(a["tfs"][start:end]), norms)
        if total is None:
            total = np.zeros(len(a["idrank"]), dtype=np.float64)
        np.add.at(total, docs, scores.astype(np.float64))
        parts.append(docs)
    assert total is not None
    candidates = np.unique(np.concatenate(parts))
    final = total[candidates].astype(np.float32)
    order = np.lexsort((a["idrank"][candidates], -final))[:k]
    return [(int(candidates[i]), float(final[i])) for i in order]
