"""The search engine: BM25 and dense indexes over a document collection, built once and opened in milliseconds.

:func:`build_index` / :func:`load_index` (:mod:`toolgym.tools.search.index`) are the entry points; the
BM25 backends rank with Lucene's BM25 as Anserini configures it, the dense one by a sentence encoder's
inner product; :func:`open_retriever` picks ``bm25``, ``dense`` or ``hybrid`` (both fused) as the
environments do. Modules: ``index`` (build, cache, load) ·
``index_files`` (its checked file table) · ``doc_store`` (the stored documents) · ``string_table``
(memory-mapped string <-> position tables) · the default backend: ``bm25`` (analysis, Lucene's float
arithmetic), ``bm25_tokenize`` (Lucene's word segmentation), ``porter`` (Lucene's Porter stemmer),
``bm25_build`` (spilling postings build), ``bm25_workers`` (its analysis subprocesses), ``bm25_search``
(queries through the C kernel ``_bm25kernel.c``) · ``lucene`` (Lucene itself through pyjnius) ·
``encoder`` (sentence encoders from a local directory) · ``dense`` (the dense backend: embeddings,
exact or HNSW search) · ``hybrid`` (fused rankings) · ``retriever`` (bm25, dense or hybrid).

Public names are imported lazily (:mod:`toolgym.lazy`), so a module of the package (an analysis
worker, say) can be imported without the rest.
"""

from __future__ import annotations

from toolgym.lazy import lazy_exports

_EXPORTS = {
    "BACKENDS": "toolgym.tools.search.index",
    "DenseSettings": "toolgym.tools.search.dense",
    "FusionSettings": "toolgym.tools.search.hybrid",
    "HybridIndex": "toolgym.tools.search.hybrid",
    "RETRIEVERS": "toolgym.tools.search.retriever",
    "RetrieverSettings": "toolgym.tools.search.retriever",
    "SearchIndex": "toolgym.tools.search.index",
    "open_retriever": "toolgym.tools.search.retriever",
    "MAX_K": "toolgym.tools.search.index",
    "Hit": "toolgym.tools.search.index",
    "Index": "toolgym.tools.search.index",
    "UnknownDocument": "toolgym.tools.search.index",
    "build_index": "toolgym.tools.search.index_build",
    "cache_dir": "toolgym.tools.search.index",
    "load_index": "toolgym.tools.search.index",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
