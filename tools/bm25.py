"""An in-process BM25 ranker that reproduces Lucene/Anserini's ranking with numpy alone.

Why our own: the default search backend must answer in a fresh process within a second or two, with
no server, no JVM and no JIT warm-up, yet rank like the Lucene BM25 that retrieval papers report. So
this module copies Anserini's *behaviour* (not its code):

* analysis as in Anserini's ``DefaultEnglishAnalyzer``: Unicode word segmentation (approximated by a
  regular expression for letters, digits and the in-word punctuation of UAX #29), the English
  possessive filter, lower-casing, Lucene's 33 English stop words, then the Porter stemmer (PyStemmer's
  ``porter``, the published algorithm; Lucene keeps words of one or two letters unstemmed, so do we);
* Lucene's BM25 (k1 = 0.9, b = 0.4, idf = ln(1 + (N - df + 0.5) / (df + 0.5)), no (k1 + 1) factor),
  with the document length read back through Lucene's lossy one-byte norm (``SmallFloat.intToByte4``),
  which moves long documents into coarse length buckets and so changes scores measurably;
* repeated query terms count as a boost (Anserini's bag-of-words query), scores are rounded to four
  decimals and ties broken by document id, as Anserini's searcher does.

Every term's postings are stored as a CSR matrix with the BM25 weight of each (term, document) pair
precomputed as float32, so answering a query is a gather, one ``np.bincount`` and one
``np.argpartition``. The arrays are plain ``.npy`` files opened with memory mapping, so loading costs
milliseconds and several processes share the pages.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "ENGLISH_STOP_WORDS",
    "BM25Settings",
    "NumpyBM25",
    "analyze",
    "build_bm25",
    "lucene_length",
]

#: Lucene's ``EnglishAnalyzer.ENGLISH_STOP_WORDS_SET`` (the list Anserini's default analyzer uses).
ENGLISH_STOP_WORDS = frozenset(
    [
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "but",
        "by",
        "for",
        "if",
        "in",
        "into",
        "is",
        "it",
        "no",
        "not",
        "of",
        "on",
        "or",
        "such",
        "that",
        "the",
        "their",
        "then",
        "there",
        "these",
        "they",
        "this",
        "to",
        "was",
        "will",
        "with",
    ]
)

# Letters/digits joined by the in-word punctuation of UAX #29: '.', apostrophes and ':' between letters;
# '.', ',', ';' and apostrophes between digits; '_' joins anything (it is part of \w).
# Combining marks and format characters (e.g. the word joiner U+2060) extend the word they follow
# (UAX #29 rule WB4), but Python's \w excludes them; Han and Hiragana are one token per character.
_EXTEND = "".join(
    f"\\u{lo:04x}-\\u{hi:04x}"
    for lo, hi in (
        (0x0300, 0x036F),
        (0x0483, 0x0489),
        (0x0591, 0x05C7),
        (0x0610, 0x061A),
        (0x064B, 0x065F),
        (0x0900, 0x0903),
        (0x093A, 0x094F),
        (0x0951, 0x0957),
        (0x0962, 0x0963),
        (0x0981, 0x0983),
        (0x09BC, 0x09D7),
        (0x0A01, 0x0A03),
        (0x0A3C, 0x0A51),
        (0x0A81, 0x0A83),
        (0x0ABC, 0x0ACD),
        (0x0B01, 0x0B03),
        (0x0B3C, 0x0B57),
        (0x0B82, 0x0B82),
        (0x0BBE, 0x0BCD),
        (0x0C00, 0x0C04),
        (0x0C3E, 0x0C56),
        (0x0C81, 0x0C83),
        (0x0CBC, 0x0CD6),
        (0x0D00, 0x0D03),
        (0x0D3E, 0x0D4D),
        (0x0E31, 0x0E31),
        (0x0E34, 0x0E3A),
        (0x0E47, 0x0E4E),
        (0x102B, 0x103E),
        (0x1056, 0x1059),
        (0x200B, 0x200F),
        (0x2060, 0x2064),
        (0x20D0, 0x20FF),
        (0xFE00, 0xFE0F),
        (0xFE20, 0xFE2F),
    )
)
_W = f"[\\w{_EXTEND}]"
_TOKEN = re.compile(rf"\w{_W}*(?:(?:(?<=[^\W\d_])[.'\u2019:](?=[^\W\d_])|(?<=\d)[.,;'\u2019](?=\d))\w{_W}*)*")
_IDEOGRAPH = re.compile(r"[\u3040-\u309f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_POSSESSIVE = ("'s", "'S", "\u2019s", "\u2019S", "\uff07s", "\uff07S")

FILES = ("bm25_indptr.npy", "bm25_docs.npy", "bm25_weights.npy", "bm25_vocab.json")


@dataclass(frozen=True)
class BM25Settings:
    """Ranking parameters; part of the cache key, so changing one rebuilds the index."""

    k1: float = 0.9
    """Term-frequency saturation (Anserini's default)."""
    b: float = 0.4
    """Length normalisation strength (Anserini's default)."""
    lucene_norms: bool = True
    """Quantise document lengths through Lucene's one-byte norm, as Lucene does."""


def _measure(stem: str) -> int:
    """Porter's m: the number of vowel-consonant sequences in ``stem`` (y after a consonant is a vowel)."""
    m, prev_vowel = 0, False
    for i, ch in enumerate(stem):
        vowel = ch in "aeiou" or (ch == "y" and i > 0 and not prev_vowel)
        if prev_vowel and not vowel:
            m += 1
        prev_vowel = vowel
    return m


class _Stemmer:
    """Porter stemming with a per-process cache (queries repeat the same few thousand words)."""

    def __init__(self) -> None:
        import Stemmer  # PyStemmer: C extension, imports in about a millisecond

        self._stem = Stemmer.Stemmer("porter").stemWord
        self._cache: dict[str, str] = {}

    def _lucene_departures(self, stem: str) -> str:
        # Porter's reference code, which Lucene copies, departs from the published algorithm in step 2:
        # (m>0) BLI -> BLE (instead of ABLI -> ABLE) and (m>0) LOGI -> LOG. The Snowball stemmer
        # follows the paper, so redo those two cases: "possibly" -> possibl, "biology" stays biologi.
        if stem.endswith("bli") and _measure(stem[:-3]) > 0:
            return self._stem(stem[:-1] + "e")
        if stem.endswith("logi") and _measure(stem[:-4]) > 0:
            return stem[:-1]
        return stem

    def __call__(self, word: str) -> str:
        stem = self._cache.get(word)
        if stem is None:
            # Lucene's PorterStemmer leaves words of one or two characters alone.
            stem = word if len(word) <= 2 else self._lucene_departures(self._stem(word))
            if len(self._cache) < 1_000_000:
                self._cache[word] = stem
        return stem


_STEMMER: _Stemmer | None = None


def analyze(text: str) -> list[str]:
    """Turn text into index terms the way Anserini's default English analyzer does.

    Args:
        text: Any string; documents and queries go through the same function.

    Returns:
        The stemmed, lower-cased terms in order, stop words removed.
    """
    global _STEMMER
    if _STEMMER is None:
        _STEMMER = _Stemmer()
    stem = _STEMMER
    terms = []
    if not text.isascii():
        text = _IDEOGRAPH.sub(r" \g<0> ", text).replace("\u0130", "i")  # Java lower-cases İ to i
    for token in _TOKEN.findall(text):
        if token.endswith(_POSSESSIVE):
            token = token[:-2]
        word = token.lower()
        if word and word not in ENGLISH_STOP_WORDS:
            terms.append(stem(word))
    return terms


def _long_to_int4(value: int) -> int:
    bits = value.bit_length()
    if bits < 4:
        return value
    shift = bits - 4
    return ((value >> shift) & 0x07) | ((shift + 1) << 3)


def _int4_to_long(value: int) -> int:
    bits, shift = value & 0x07, (value >> 3) - 1
    return bits if shift == -1 else (bits | 0x08) << shift


_FREE_VALUES = 255 - _long_to_int4(2**31 - 1)
_LENGTH_TABLE = np.array(
    [i if i < _FREE_VALUES else _FREE_VALUES + _int4_to_long(i - _FREE_VALUES) for i in range(256)],
    dtype=np.float64,
)


def lucene_length(lengths: np.ndarray) -> np.ndarray:
    """Round document lengths the way Lucene's one-byte norm does (exact below 24, ~3 bits above).

    Args:
        lengths: Non-negative integer token counts.

    Returns:
        The lengths Lucene's BM25 sees after ``SmallFloat.intToByte4`` / ``byte4ToInt``.
    """
    codes = np.empty(len(lengths), dtype=np.int64)
    small = lengths < _FREE_VALUES
    codes[small] = lengths[small]
    big = np.flatnonzero(~small)
    codes[big] = [_FREE_VALUES + _long_to_int4(int(n) - _FREE_VALUES) for n in lengths[big]]
    return _LENGTH_TABLE[codes]


def build_bm25(
    contents: Iterable[str],
    out: Path,
    settings: BM25Settings,
    *,
    advance: Callable[[int], None] | None = None,
) -> list[str]:
    """Analyse every document and write the postings with precomputed BM25 weights under ``out``.

    Args:
        contents: One string per document, in internal-id order (title + newline + text).
        out: An existing directory; the files in ``FILES`` are written there.
        settings: BM25 parameters.
        advance: Called with 1 after each document (drives the progress bar).

    Returns:
        The names of the files written, relative to ``out``.
    """
    vocab: dict[str, int] = {}
    term_ids: list[int] = []
    lengths: list[int] = []
    for text in contents:
        terms = analyze(text)
        for term in terms:
            tid = vocab.get(term)
            if tid is None:
                tid = vocab[term] = len(vocab)
            term_ids.append(tid)
        lengths.append(len(terms))
        if advance is not None:
            advance(1)
    n_docs = len(lengths)
    doc_len = np.asarray(lengths, dtype=np.int64)
    tids = np.asarray(term_ids, dtype=np.int64)
    docs_of_tokens = np.repeat(np.arange(n_docs, dtype=np.int64), doc_len)
    # One key per (term, doc) occurrence; unique() sorts them by term, then doc: that is the CSR order.
    keys, tf = np.unique(tids * max(n_docs, 1) + docs_of_tokens, return_counts=True)
    post_terms, post_docs = np.divmod(keys, max(n_docs, 1))
    df = np.bincount(post_terms, minlength=len(vocab))
    indptr = np.zeros(len(vocab) + 1, dtype=np.int64)
    np.cumsum(df, out=indptr[1:])

    n_with_field = int(np.count_nonzero(doc_len))
    avgdl = float(doc_len.sum()) / n_with_field if n_with_field else 1.0
    seen_len = lucene_length(doc_len) if settings.lucene_norms else doc_len.astype(np.float64)
    norm = settings.k1 * ((1.0 - settings.b) + settings.b * seen_len / avgdl)
    idf = np.log1p((n_with_field - df + 0.5) / (df + 0.5))
    tf = tf.astype(np.float64)
    weights = (idf[post_terms] * tf / (tf + norm[post_docs])).astype(np.float32)

    np.save(out / FILES[0], indptr)
    np.save(out / FILES[1], post_docs.astype(np.int32))
    np.save(out / FILES[2], weights)
    terms_in_order = sorted(vocab, key=vocab.__getitem__)
    (out / FILES[3]).write_text(json.dumps(terms_in_order, ensure_ascii=False), encoding="utf-8")
    return list(FILES)


class NumpyBM25:
    """Answers queries from the files :func:`build_bm25` wrote; read-only and thread-safe."""

    def __init__(self, path: Path, n_docs: int) -> None:
        # Plain ndarray views over the memory maps: slicing np.memmap objects costs several times more.
        self._indptr = np.asarray(np.load(path / FILES[0], mmap_mode="r"))
        self._docs = np.asarray(np.load(path / FILES[1], mmap_mode="r"))
        self._weights = np.asarray(np.load(path / FILES[2], mmap_mode="r"))
        terms = json.loads((path / FILES[3]).read_text(encoding="utf-8"))
        self._vocab = {term: i for i, term in enumerate(terms)}
        self._n_docs = n_docs
        self._local = threading.local()
        self._path = path
        self._pool: ProcessPoolExecutor | None = None
        self._pool_size = 0
        self._pool_lock = threading.Lock()

    def _scores(self) -> np.ndarray:
        # One zeroed accumulator per thread, restored to zero after each query: no O(N) work per query.
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = np.zeros(self._n_docs, dtype=np.float64)
        return buf

    def top_k(self, query: str, k: int) -> list[tuple[int, float]]:
        """Return the best (internal doc id, score) pairs, best first, ties not yet broken.

        A few more than ``k`` come back so the caller can break ties at the cut by document id.
        """
        counts: dict[int, int] = {}
        for term in analyze(query):
            tid = self._vocab.get(term)
            if tid is not None:
                counts[tid] = counts.get(tid, 0) + 1
        if not counts:
            return []
        scores = self._scores()
        parts = []
        for tid, boost in counts.items():
            start, end = self._indptr[tid], self._indptr[tid + 1]
            docs = self._docs[start:end]
            weights = self._weights[start:end]
            # NOTE: a term's postings hold each document once, so this fancy-index add is exact.
            scores[docs] += weights * boost if boost > 1 else weights
            parts.append(docs)
        candidates = parts[0] if len(parts) == 1 else np.concatenate(parts)
        values = scores[candidates]
        scores[candidates] = 0.0
        # A document occurs at most once per term, so the best (k + 8) * terms entries hold at least
        # k + 8 distinct documents: enough to cut at k after Anserini-style rounding and tie-breaking.
        want = min(len(values), (k + 8) * len(parts))
        if want < len(values):
            top = np.argpartition(values, len(values) - want)[len(values) - want :]
            candidates, values = candidates[top], values[top]
        docs, first = np.unique(candidates, return_index=True)
        values = values[first]
        if len(docs) > k + 8:
            keep = np.argpartition(values, len(values) - k - 8)[len(values) - k - 8 :]
            docs, values = docs[keep], values[keep]
        return list(zip(docs.tolist(), values.tolist(), strict=True))

    def top_k_batch(self, queries: Sequence[str], k: int, threads: int = 1) -> list[list[tuple[int, float]]]:
        """:meth:`top_k` over many queries, on ``threads`` worker processes when that pays off.

        Why processes: numpy's fancy indexing holds the GIL, so threads cannot run two queries at
        once. The workers (started once per index, by a fork server so a running JVM or thread pool in
        this process is never forked) memory-map the same files, so they cost no extra copy.
        """
        if threads <= 1 or len(queries) < 8 * threads:
            return [self.top_k(q, k) for q in queries]
        pool = self._workers(threads)
        size = max(1, len(queries) // (4 * threads))
        chunks = [list(queries[i : i + size]) for i in range(0, len(queries), size)]
        results: list[list[tuple[int, float]]] = []
        for part in pool.map(_search_chunk, chunks, [k] * len(chunks)):
            results.extend(part)
        return results

    def _workers(self, threads: int) -> ProcessPoolExecutor:
        with self._pool_lock:
            if self._pool is None or self._pool_size != threads:
                if self._pool is not None:
                    self._pool.shutdown()
                import multiprocessing

                self._pool = ProcessPoolExecutor(
                    max_workers=threads,
                    mp_context=multiprocessing.get_context("forkserver"),
                    initializer=_start_worker,
                    initargs=(str(self._path), self._n_docs),
                )
                self._pool_size = threads
            return self._pool

    def close(self) -> None:
        """Stop the worker processes, if any were started (idempotent)."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None


_WORKER: NumpyBM25 | None = None


def _start_worker(path: str, n_docs: int) -> None:
    global _WORKER
    _WORKER = NumpyBM25(Path(path), n_docs)


def _search_chunk(queries: list[str], k: int) -> list[list[tuple[int, float]]]:
    assert _WORKER is not None, "worker not initialised"
    return [_WORKER.top_k(q, k) for q in queries]


def idf(n_docs: int, df: int) -> float:
    """Lucene's BM25 idf; exposed for tests that check scores by hand."""
    return math.log1p((n_docs - df + 0.5) / (df + 0.5))
