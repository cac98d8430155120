"""Near-duplicate detection: which records of the collection copy a source paper's text.

The ArxivRefs environment bans these records from the query paper's tools (anti-leak): a re-upload
of the paper under another id, or a document that copies one of its sections, would hand the agent
the answer.
"""

from __future__ import annotations

import re

from toolgym.tools.paper_collection import Collection
from toolgym.tools.paper_markers import MARKER

__all__ = ["near_duplicates", "shingles"]


def shingles(text: str, n: int = 8) -> set[int]:
    """Hashed word n-grams, for near-duplicate detection (markers dropped, case folded)."""
    words = re.findall(r"\w+", MARKER.sub(" ", text).lower())
    return {hash(" ".join(words[i : i + n])) for i in range(max(0, len(words) - n + 1))}


def near_duplicates(collection: Collection, *, threshold: float = 0.3, n: int = 8) -> dict[str, set[str]]:
    """For each source paper, the collection ids (other than its own) whose text copies its text.

    Score: shared word ``n``-grams over the smaller of the two n-gram sets, so a document that copies
    only one section of the query is caught as well as a full re-upload under another id. Only
    records with text (full papers) can copy; n-grams are computed once per record.
    """
    docs = {
        r.id: shingles(r.abstract + "\n" + r.text, n)
        for r in collection.records.values()
        if r.text or r.abstract
    }
    out: dict[str, set[str]] = {}
    for source in collection.papers:
        own = collection.paper_ids[source.paper_id]
        query = shingles(source.abstract + "\n" + "\n".join(p.text for p in source.paragraphs), n)
        out[source.paper_id] = {
            cid
            for cid, doc in docs.items()
            if cid != own and doc and query and len(doc & query) / min(len(doc), len(query)) >= threshold
        }
    return out
