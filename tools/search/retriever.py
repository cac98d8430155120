"""Retrievers, as environments choose them: ``bm25``, ``dense`` or ``hybrid`` over one corpus.

:class:`RetrieverSettings` is the whole choice (a frozen, hashable value, so a process can share one
index per setting); :func:`open_retriever` builds or reuses the indexes it needs through
:func:`~toolgym.tools.search.index_build.build_index` (same cache, same content-hash rules) and returns a
:class:`~toolgym.tools.search.index.SearchIndex`:

* ``bm25`` — one BM25 index (backend ``default`` or ``pyserini``); what the environments have always used.
* ``dense`` — one dense index (:mod:`toolgym.tools.search.dense`).
* ``hybrid`` — both, fused (:class:`~toolgym.tools.search.hybrid.HybridIndex`); each index is cached on
  its own, so a hybrid retriever over a corpus already indexed both ways builds nothing.

The returned index's ``provenance`` says which retriever answered, with the encoder's hash and
settings, so run manifests of two retrievers differ and ``toolgym compare`` refuses to pair them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolgym.errors import ConfigError, did_you_mean
from toolgym.tools.search.dense import DenseSettings
from toolgym.tools.search.hybrid import FusionSettings, HybridIndex
from toolgym.tools.search.index import SearchIndex
from toolgym.tools.search.index_build import build_command, build_index

__all__ = ["RETRIEVERS", "RetrieverSettings", "open_retriever", "retriever_command"]

RETRIEVERS = ("bm25", "dense", "hybrid", "random")


@dataclass(frozen=True)
class RetrieverSettings:
    """Which retriever answers searches, and how.

    Attributes:
        retriever: ``"bm25"``, ``"dense"``, ``"hybrid"``, or ``"random"``: a control that answers every
            query with random documents of the collection (:mod:`toolgym.tools.search.random_index`).
        backend: The BM25 backend (``"default"`` or ``"pyserini"``) of ``bm25`` and ``hybrid``.
        dense: The dense index's settings (encoder, prefixes, dtype, HNSW) of ``dense`` and ``hybrid``.
        fusion: How ``hybrid`` fuses the two rankings.
    """

    retriever: str = "bm25"
    backend: str = "default"
    dense: DenseSettings = field(default_factory=DenseSettings)
    fusion: FusionSettings = field(default_factory=FusionSettings)

    def __post_init__(self) -> None:
        if self.retriever not in RETRIEVERS:
            raise ConfigError(
                f"unknown retriever {self.retriever!r}; expected one of {', '.join(RETRIEVERS)}."
                + did_you_mean(str(self.retriever), RETRIEVERS)
            )
        if self.backend == "dense":
            raise ConfigError("backend names the BM25 engine (default or pyserini); use retriever='dense'")

    @classmethod
    def from_args(
        cls,
        retriever: str = "bm25",
        backend: str = "default",
        encoder: str | Path | None = None,
        query_prefix: str | None = None,
        passage_prefix: str | None = None,
    ) -> RetrieverSettings:
        """Settings from an environment's flat constructor arguments (what ``--env-arg`` can pass)."""
        if retriever == "bm25" and (
            encoder is not None or query_prefix is not None or passage_prefix is not None
        ):
            raise ConfigError(
                "encoder, query_prefix and passage_prefix apply to retriever='dense' or 'hybrid', "
                "not to 'bm25'"
            )
        dense = DenseSettings(
            encoder=str(encoder) if encoder is not None else None,
            query_prefix=query_prefix,
            passage_prefix=passage_prefix,
        )
        return cls(retriever=retriever, backend=backend, dense=dense)


def open_retriever(docs: Callable[[], Iterable[dict[str, Any]]], settings: RetrieverSettings) -> SearchIndex:
    """Build (or reuse from the cache) what ``settings`` needs over the documents ``docs()`` yields.

    ``docs`` is called once per index (twice for ``hybrid``), so it may return a generator.

    Raises:
        ConfigError, MissingDependencyError: as :func:`~toolgym.tools.search.index_build.build_index`.
    """
    if settings.retriever == "bm25":
        return build_index(docs(), backend=settings.backend)
    if settings.retriever == "random":
        from toolgym.tools.search.random_index import RandomIndex

        return RandomIndex(build_index(docs(), backend=settings.backend))
    dense = build_index(docs(), backend="dense", dense=settings.dense)
    if settings.retriever == "dense":
        return dense
    return HybridIndex(build_index(docs(), backend=settings.backend), dense, settings.fusion)


def retriever_command(corpus: Path, settings: RetrieverSettings, out: Path | None) -> list[Path]:
    """Body of ``toolgym index build``: the index directories a retriever needs over a JSONL corpus.

    ``hybrid`` builds two indexes: with ``out``, as ``out/bm25`` and ``out/dense``.
    """
    paths = []
    if settings.retriever in ("bm25", "hybrid", "random"):  # random draws from a BM25 index's collection
        target = out / "bm25" if out is not None and settings.retriever == "hybrid" else out
        paths.append(build_command(corpus, settings.backend, target))
    if settings.retriever in ("dense", "hybrid"):
        target = out / "dense" if out is not None and settings.retriever == "hybrid" else out
        paths.append(build_command(corpus, "dense", target, settings.dense))
    return paths
