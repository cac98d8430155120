"""Near-duplicate detection: which records of the collection copy a source paper's text.

The ArxivRefs environment bans these records from the query paper's tools (anti-leak): a re-upload
of the paper under another id, or a document that copies one of its sections, would hand the agent
the answer.
"""

from __future__ import annotations

import re

import numpy as np

from toolgym.tools.papers.collection import Collection
from toolgym.tools.papers.markers import MARKER

__all__ = ["near_duplicates", "shingles"]


_WORD = re.compile(r"\w+")
_ASCII_WORD = re.compile(r"\w+", re.ASCII)  # the same words on ASCII text, found faster


def _words(text: str) -> list[str]:
    text = (MARKER.sub(" ", text) if "{{" in text else text).lower()
    return (_ASCII_WORD if text.isascii() else _WORD).findall(text)


def shingles(text: str, n: int = 8) -> set[int]:
    """Hashed word n-grams, for near-duplicate detection (markers dropped, case folded)."""
    return _grams(_words(text), n)


def _grams(words: list[str], n: int) -> set[int]:
    return {hash(" ".join(words[i : i + n])) for i in range(max(0, len(words) - n + 1))}


#: Records whose n-grams are hashed in one numpy batch (bounds the prefilter's memory).
_BATCH = 4096


def _window_keys(word_hashes: np.ndarray, n: int) -> np.ndarray:
    """A 64-bit key per window of ``n`` consecutive word hashes (equal windows give equal keys)."""
    m = len(word_hashes) - n + 1
    if m <= 0:
        return np.zeros(0, dtype=np.uint64)
    keys = np.zeros(m, dtype=np.uint64)
    for j in range(n):
        keys = keys * np.uint64(1_000_003) + word_hashes[j : j + m]  # NOTE: wraps mod 2**64 on purpose
    return keys


def _keys(words: list[str], n: int) -> np.ndarray:
    return _window_keys(np.array([hash(w) for w in words], dtype=np.int64).view(np.uint64), n)


def _candidates(texts: list[list[str]], query_keys: np.ndarray, n: int) -> list[int]:
    """Indexes of ``texts`` (word lists) with an n-gram whose key is in ``query_keys`` (sorted)."""
    hashes: list[int] = []
    for words in texts:
        hashes.extend(map(hash, words))
    if len(hashes) < n or not len(query_keys):
        return []
    keys = _window_keys(np.array(hashes, dtype=np.int64).view(np.uint64), n)
    owners = np.repeat(np.arange(len(texts)), [len(words) for words in texts])
    inside = owners[: len(keys)] == owners[n - 1 :]  # a window must not straddle two records
    at = np.minimum(np.searchsorted(query_keys, keys), len(query_keys) - 1)
    hit = inside & (query_keys[at] == keys)
    return np.unique(owners[: len(keys)][hit]).tolist()


def near_duplicates(collection: Collection, *, threshold: float = 0.3, n: int = 8) -> dict[str, set[str]]:
    """For each source paper, the collection ids (other than its own) whose text copies its text.

    Score: shared word ``n``-grams over the smaller of the two n-gram sets, so a document that copies
    only one section of the query is caught as well as a full re-upload under another id. Only
    records with text (full papers, or collection records with an abstract) can copy.

    Sub-quadratic, and exact. Candidates first: every record's n-grams get a 64-bit key in one numpy
    pass per batch of records, and only records sharing at least one key with some source paper
    (``np.searchsorted`` in the sorted keys of all source papers) are scored. A record without a shared
    n-gram scores 0, so this drops no pair above the threshold. The candidates are then scored
    exactly (n-gram sets, an inverted index n-gram -> source papers), so the result equals
    the all-pairs comparison. MinHash/LSH was not chosen: it estimates the overlap and may miss a
    copy (or a copied section, whose Jaccard similarity to a whole paper is small), which would
    weaken the anti-leak rule; an exact prefilter keeps it unchanged at linear cost.
    """
    query_words = [
        _words(source.abstract + "\n" + "\n".join(p.text for p in source.paragraphs))
        for source in collection.papers
    ]
    queries = [_grams(words, n) for words in query_words]
    query_keys = np.unique(
        np.concatenate([np.zeros(0, dtype=np.uint64), *(_keys(words, n) for words in query_words)])
    )
    postings: dict[int, list[int]] = {}
    for i, query in enumerate(queries):
        for gram in query:
            postings.setdefault(gram, []).append(i)
    owns = [collection.paper_ids[p.paper_id] for p in collection.papers]
    out: dict[str, set[str]] = {p.paper_id: set() for p in collection.papers}
    with_text = [r for r in collection.records.values() if r.text or r.abstract]
    for at in range(0, len(with_text), _BATCH):
        batch = with_text[at : at + _BATCH]
        words = [_words(r.abstract + "\n" + r.text) for r in batch]
        for j in _candidates(words, query_keys, n):
            record, doc = batch[j], _grams(words[j], n)
            shared: dict[int, int] = {}
            for gram in doc:
                for i in postings.get(gram, ()):
                    shared[i] = shared.get(i, 0) + 1
            for i, count in shared.items():
                if owns[i] != record.id and count / min(len(doc), len(queries[i])) >= threshold:
                    out[collection.papers[i].paper_id].add(record.id)
    return out
