"""A control retriever: documents unrelated to the query (``retriever = "random"``).

Whether an agent learned to *use* its search tool is a claim with a control: the same run with a tool
that returns nothing useful. :class:`RandomIndex` answers every search with ``k`` documents of the
collection drawn uniformly at random, without replacement, so a result has the collection's own
length distribution and the same count as a real search's; the draw is seeded by the query's text, so
one query gets one answer every time (runs and their resumes repeat), and different queries get
different documents. Opening a document works as with the real index it wraps (the same collection).
A gold document appears among ``k`` results with probability ``k / len(collection)``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Any

from toolgym.tools.search.index import Hit, Index

__all__ = ["RandomIndex"]


class RandomIndex:
    """``k`` random documents of ``base``'s collection for any query (module docstring)."""

    def __init__(self, base: Index) -> None:
        self.base = base

    @property
    def backend(self) -> str:
        return "random"

    @property
    def provenance(self) -> dict[str, Any]:
        """The control's name and the collection it draws from (for run manifests: a run on it never
        compares with a run on a real retriever unless asked)."""
        return {"retriever": "random", "collection": self.base.provenance}

    def __len__(self) -> int:
        return len(self.base)

    def __repr__(self) -> str:
        return f"RandomIndex({self.base!r})"

    def search(self, query: str, k: int = 10) -> list[Hit]:
        """``k`` documents drawn at random (seeded by ``query``); errors as :meth:`Index.search`'s."""
        Index._check(query, k)
        seed = int.from_bytes(hashlib.sha256(query.encode("utf-8", "surrogatepass")).digest()[:8], "big")
        positions = random.Random(seed).sample(range(len(self.base)), min(k, len(self.base)))
        return [Hit(self.base.doc_id_at(p), 0.0) for p in positions]

    def search_batch(self, queries: Sequence[str], k: int = 10, threads: int = 1) -> list[list[Hit]]:
        return [self.search(q, k) for q in queries]

    def get(self, doc_id: str) -> dict[str, str]:
        return self.base.get(doc_id)

    def close(self) -> None:
        self.base.close()
