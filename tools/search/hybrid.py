"""Hybrid retrieval: a BM25 index and a dense index of one corpus, their rankings fused.

Lexical and dense retrieval fail differently (BM25 misses paraphrases, a small encoder misses rare
names and numbers), so fusing their rankings often beats both. Two rules (:class:`FusionSettings`):

* ``rrf`` — reciprocal-rank fusion (Cormack, Clarke and Büttcher, SIGIR 2009): a document's score is
  the sum over the two rankings of ``1 / (k + rank)`` (ranks from 1; absent from a ranking: nothing).
  Uses ranks only, so the two scores' scales never matter; ``k`` (default 60, the paper's) damps the
  weight of the very top ranks.
* ``weighted`` — ``weight * bm25' + (1 - weight) * dense'``, each score min-max normalised over its own
  candidate list (best 1, worst 0; a list of one scores 1), absent documents 0.

Each side contributes its top ``depth`` (at least the ``k`` asked for). Ties are broken by the better
of the two ranks, then by id, so the fused order is deterministic. Hybrid needs no files of its own:
:class:`HybridIndex` holds the two indexes, each built and cached by :mod:`toolgym.tools.search.index`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from toolgym.errors import ConfigError, check_choice
from toolgym.tools.search.index import MAX_K, Hit, Index, SearchIndex

__all__ = ["FUSIONS", "FusionSettings", "HybridIndex", "fuse"]

FUSIONS = ("rrf", "weighted")


@dataclass(frozen=True)
class FusionSettings:
    """How a hybrid index fuses its two rankings (see the module docstring).

    Attributes:
        method: ``"rrf"`` (reciprocal-rank fusion) or ``"weighted"`` (normalised score sum).
        k: RRF's rank constant (> 0).
        weight: BM25's weight in the weighted sum, in [0, 1] (dense gets ``1 - weight``).
        depth: Candidates taken from each side (at least the ``k`` a search asks for; at most MAX_K).
    """

    method: str = "rrf"
    k: float = 60.0
    weight: float = 0.5
    depth: int = 100

    def __post_init__(self) -> None:
        check_choice("fusion method", self.method, FUSIONS)
        if not self.k > 0:
            raise ConfigError(f"the RRF constant k must be > 0, got {self.k!r}")
        if not 0.0 <= self.weight <= 1.0:
            raise ConfigError(f"weight must be in [0, 1], got {self.weight!r}")
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or not 1 <= self.depth <= MAX_K:
            raise ConfigError(f"depth must be an integer from 1 to {MAX_K}, got {self.depth!r}")


def _normalised(hits: Sequence[Hit]) -> dict[str, float]:
    if not hits:
        return {}
    scores = [h.score for h in hits]
    top, bottom = max(scores), min(scores)
    span = top - bottom
    return {h.doc_id: (h.score - bottom) / span if span > 0 else 1.0 for h in hits}


def fuse(lexical: Sequence[Hit], dense: Sequence[Hit], settings: FusionSettings) -> list[Hit]:
    """The fused ranking of two best-first hit lists (every candidate, best first)."""
    ranks: dict[str, list[int]] = {}
    for hits in (lexical, dense):
        for rank, hit in enumerate(hits, 1):
            ranks.setdefault(hit.doc_id, []).append(rank)
    if settings.method == "rrf":
        scores: dict[str, float] = {}
        for hits in (lexical, dense):
            for rank, hit in enumerate(hits, 1):
                scores[hit.doc_id] = scores.get(hit.doc_id, 0.0) + 1.0 / (settings.k + rank)
    else:
        lex, den = _normalised(lexical), _normalised(dense)
        scores = {
            doc: settings.weight * lex.get(doc, 0.0) + (1.0 - settings.weight) * den.get(doc, 0.0)
            for doc in ranks
        }
    order = sorted(scores, key=lambda doc: (-scores[doc], min(ranks[doc]), doc))
    return [Hit(doc, scores[doc]) for doc in order]


class HybridIndex:
    """A :class:`~toolgym.tools.search.index.SearchIndex` fusing a BM25 index and a dense index.

    Args:
        lexical: A BM25 index (backend ``default`` or ``pyserini``).
        dense: A dense index of the same corpus.
        fusion: The fusion rule.

    Raises:
        ConfigError: the two indexes hold different corpora, or are not a BM25 and a dense index.
    """

    def __init__(self, lexical: Any, dense: Any, fusion: FusionSettings | None = None) -> None:
        if lexical.backend == "dense" or dense.backend != "dense":
            raise ConfigError(
                f"a hybrid index fuses a BM25 index and a dense one, got {lexical.backend!r} and {dense.backend!r}"
            )
        a, b = lexical.provenance["corpus_sha256"], dense.provenance["corpus_sha256"]
        if a != b:
            raise ConfigError(
                f"the BM25 index ({lexical.path}) and the dense index ({dense.path}) hold different corpora "
                f"(sha256 {a[:12]} vs {b[:12]}); build both from the same documents"
            )
        self.lexical: SearchIndex = lexical
        self.dense: SearchIndex = dense
        self.fusion = fusion if fusion is not None else FusionSettings()

    @property
    def backend(self) -> str:
        return "hybrid"

    @property
    def provenance(self) -> dict[str, Any]:
        """Both indexes' provenance and the fusion rule (for run manifests)."""
        return {
            "retriever": "hybrid",
            "fusion": asdict(self.fusion),
            "lexical": self.lexical.provenance,
            "dense": self.dense.provenance,
        }

    def __len__(self) -> int:
        return len(self.lexical)

    def __repr__(self) -> str:
        return f"HybridIndex({self.lexical!r}, {self.dense!r}, {self.fusion})"

    def _depth(self, k: int) -> int:
        return min(MAX_K, max(k, self.fusion.depth))

    def search(self, query: str, k: int = 10) -> list[Hit]:
        """The ``k`` best documents by the fused ranking (errors as :meth:`Index.search`'s)."""
        Index._check(query, k)
        depth = self._depth(k)
        found = fuse(self.lexical.search(query, depth), self.dense.search(query, depth), self.fusion)
        return found[:k]

    def search_batch(self, queries: Sequence[str], k: int = 10, threads: int = 1) -> list[list[Hit]]:
        """:meth:`search` for many queries; results in query order."""
        for query in queries:
            Index._check(query, k)
        depth = self._depth(k)
        lexical = self.lexical.search_batch(queries, depth, threads)
        dense = self.dense.search_batch(queries, depth, threads)
        return [fuse(a, b, self.fusion)[:k] for a, b in zip(lexical, dense, strict=True)]

    def get(self, doc_id: str) -> dict[str, str]:
        """The stored document (both indexes hold the same ones)."""
        return self.lexical.get(doc_id)

    def close(self) -> None:
        """Close both indexes."""
        self.lexical.close()
        self.dense.close()
