"""The default search backend's BM25: Anserini's analysis and Lucene's scoring arithmetic, reproduced.

Why our own: the default search backend must answer in a fresh process in well under a second, with
no server, no JVM and no JIT warm-up, yet rank exactly like the Lucene BM25 that retrieval papers
report. So these modules copy Anserini's *behaviour* (not its code):

* analysis as in Anserini's ``DefaultEnglishAnalyzer`` (:func:`analyze`): word segmentation as
  Lucene's ``StandardTokenizer`` does it (UAX #29 word boundaries, written as regular expressions over
  Python's character classes, :mod:`toolgym.tools.search.bm25_tokenize`), the English possessive filter,
  lower-casing character by character as Java does, Lucene's 33 English stop words, then the Porter
  stemmer as Lucene has it (:mod:`toolgym.tools.search.porter`). Checked against Lucene on every document
  of both shipped corpora (identical terms). Known differences remain only in scripts written
  without spaces, which Lucene keeps as whole runs apart from other letters (Thai, Lao, Myanmar,
  Khmer; Katakana next to Latin letters), in characters newer than Lucene's Unicode tables, and in a
  few symbols UAX #29 counts as letters (modifier arrowheads, Armenian marks);
* Lucene's BM25 (k1 = 0.9, b = 0.4, no (k1 + 1) factor) *in Lucene's precision*: idf =
  ``(float) ln(1 + (N - df + 0.5) / (df + 0.5))`` (:func:`lucene_idf`), the average length in float,
  each document's length read back through Lucene's lossy one-byte norm (``SmallFloat.intToByte4``,
  :func:`lucene_length`) into a float ``1 / (k1 * (1 - b + b * length / avgdl))``
  (:func:`lucene_norm_inverse`), a term's score ``weight - weight / (1 + tf * normInverse)`` in float
  with ``weight = boost * idf``, a document's score the double sum of its terms' float scores cast to
  float. Every step is the same IEEE operation Lucene performs, so scores are bit-identical;
* Anserini's bag-of-words query (a repeated query term is one clause with the count as its boost) and
  its order: score first, ties by external document id; displayed scores rounded to four decimals
  with ties nudged apart by 1e-6 (:func:`anserini_display`).

Where the rest lives: :mod:`toolgym.tools.search.bm25_build` writes the postings (in bounded memory, analysed
in parallel by :mod:`toolgym.tools.search.bm25_workers`), :mod:`toolgym.tools.search.bm25_search` answers queries through the C kernel
``toolgym.tools.search._bm25kernel`` (block-max MaxScore; ``tools/search/_bm25kernel.c`` explains it).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from toolgym.tools.search.bm25_tokenize import tokenize
from toolgym.tools.search.porter import porter_stem

__all__ = [
    "ENGLISH_STOP_WORDS",
    "BM25Settings",
    "analyze",
    "anserini_display",
    "lucene_avgdl",
    "lucene_idf",
    "lucene_length",
    "lucene_norm_cache",
    "lucene_norm_codes",
    "lucene_norm_inverse",
    "lucene_term_scores",
    "tokenize",
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

_POSSESSIVE = ("'s", "'S", "\u2019s", "\u2019S", "\uff07s", "\uff07S")


@dataclass(frozen=True)
class BM25Settings:
    """Ranking parameters; part of the cache key, so changing one rebuilds the index."""

    k1: float = 0.9
    """Term-frequency saturation (Anserini's default)."""
    b: float = 0.4
    """Length normalisation strength (Anserini's default)."""
    lucene_norms: bool = True
    """Quantise document lengths through Lucene's one-byte norm, as Lucene does."""


_MISSING = object()
#: raw token -> its index term, or None for a token that yields none (a stop word); per process.
_TERMS: dict[str, str | None] = {}


def _term(token: str) -> str | None:
    raw = token
    if token.endswith(_POSSESSIVE):
        token = token[:-2]
    # Lucene lower-cases character by character: a capital sigma is always σ, never word-final ς.
    word = token.lower() if token.isascii() else token.replace("\u03a3", "\u03c3").lower()
    term = porter_stem(word) if word and word not in ENGLISH_STOP_WORDS else None
    if len(_TERMS) < 2_000_000:
        _TERMS[raw] = term
    return term


def analyze(text: str) -> list[str]:
    """Turn text into index terms the way Anserini's default English analyzer does.

    Args:
        text: Any string; documents and queries go through the same function.

    Returns:
        The stemmed, lower-cased terms in order, stop words removed.
    """
    # NOTE: a token's term depends on the token alone, so it is computed once per distinct token.
    terms: list[str] = []
    known = _TERMS.get
    for token in tokenize(text):
        term = known(token, _MISSING)
        if term is _MISSING:
            term = _term(token)
        if isinstance(term, str):
            terms.append(term)
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


def lucene_norm_codes(lengths: np.ndarray) -> np.ndarray:
    """Lucene's one-byte norm code (``SmallFloat.intToByte4``) of each document length.

    Args:
        lengths: Non-negative integer token counts.

    Returns:
        uint8 codes; :data:`LENGTH_TABLE` decodes them.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    codes = np.empty(len(lengths), dtype=np.uint8)
    small = lengths < _FREE_VALUES
    codes[small] = lengths[small]
    big = np.flatnonzero(~small)
    if len(big):
        # intToByte4 per distinct length: a long document collection has few distinct long lengths.
        values, inverse = np.unique(lengths[big], return_inverse=True)
        coded = np.array([_FREE_VALUES + _long_to_int4(int(n) - _FREE_VALUES) for n in values], np.uint8)
        codes[big] = coded[inverse]
    return codes


def lucene_length(lengths: np.ndarray) -> np.ndarray:
    """Round document lengths the way Lucene's one-byte norm does (exact below 24, ~3 bits above).

    Args:
        lengths: Non-negative integer token counts.

    Returns:
        The lengths Lucene's BM25 sees after ``SmallFloat.intToByte4`` / ``byte4ToInt``.
    """
    return _LENGTH_TABLE[lucene_norm_codes(lengths)]


def lucene_avgdl(total_terms: int, doc_count: int) -> np.float32:
    """Lucene's average field length: ``(float) (sumTotalTermFreq / (double) docCount)``."""
    return np.float32(total_terms / doc_count if doc_count else 1.0)


def lucene_idf(doc_count: int, df: np.ndarray) -> np.ndarray:
    """Lucene's BM25 idf per term, ``(float) Math.log(1 + (docCount - df + 0.5) / (df + 0.5))``.

    Args:
        doc_count: Documents with at least one term (Lucene's ``docCount``).
        df: Document frequency of each term.

    Returns:
        float32 idf values.
    """
    df = np.asarray(df, dtype=np.int64)
    return np.log(1.0 + ((doc_count - df) + 0.5) / (df + 0.5)).astype(np.float32)


def lucene_norm_cache(avgdl: np.float32, settings: BM25Settings) -> np.ndarray:
    """BM25Similarity's cache: ``1 / (k1 * ((1 - b) + b * LENGTH_TABLE[code] / avgdl))`` per norm code.

    Args:
        avgdl: :func:`lucene_avgdl` of the collection.
        settings: k1 and b.

    Returns:
        float32 [256]: the factor a term frequency is multiplied by, per one-byte norm code, each
        entry computed in float exactly as Lucene computes it.
    """
    k1, b, one = np.float32(settings.k1), np.float32(settings.b), np.float32(1.0)
    table = _LENGTH_TABLE.astype(np.float32)
    return (one / (k1 * ((one - b) + b * table / avgdl))).astype(np.float32)


def lucene_norm_inverse(lengths: np.ndarray, avgdl: np.float32, settings: BM25Settings) -> np.ndarray:
    """Each document's normInverse: :func:`lucene_norm_cache` at its norm code (or, without Lucene's
    norms, the same formula at its exact length).

    Args:
        lengths: Token counts per document.
        avgdl: :func:`lucene_avgdl` of the collection.
        settings: k1, b, and whether lengths go through the one-byte norm.

    Returns:
        float32 per document.
    """
    if settings.lucene_norms:
        return lucene_norm_cache(avgdl, settings)[lucene_norm_codes(lengths)]
    k1, b, one = np.float32(settings.k1), np.float32(settings.b), np.float32(1.0)
    seen = np.asarray(lengths).astype(np.float32)
    return (one / (k1 * ((one - b) + b * seen / avgdl))).astype(np.float32)


def lucene_term_scores(weight: np.ndarray, tf: np.ndarray, norm_inverse: np.ndarray) -> np.ndarray:
    """Lucene's float score of each (term, document) pair: ``weight - weight / (1 + tf * normInverse)``.

    All three arrays are float32 (``weight = boost * idf``); the result is float32, operation for
    operation what ``BM25Scorer.score`` computes.
    """
    return weight - weight / (np.float32(1.0) + tf.astype(np.float32) * norm_inverse)


def anserini_display(scores: Sequence[float]) -> list[float]:
    """The scores Anserini shows for a ranked list (its ``ScoreTiesAdjusterReranker``).

    Each float score is rounded to four decimals in double (``(float) (Math.round(score * 1e4) /
    1e4)``); a score within 1e-4 of the previous one is then lowered by 1e-6 per tie, in float, so
    the shown scores keep the ranked order.
    """
    # array("f") rounds each double to the nearest float, as Java's (float) cast does.
    shown = array("f", [math.floor(score * 1e4 + 0.5) / 1e4 for score in scores])
    # Ties are rare; the check is loose (1.01e-4) so that every pair Java's float comparison could call
    # a tie is redone exactly, in float32.
    if any(a - b <= 1.01e-4 for a, b in zip(shown, shown[1:], strict=False)):
        values = np.asarray(shown, dtype=np.float32)
        dup = 0
        for i in range(1, len(values)):
            if values[i - 1] - values[i] > np.float32(1e-4):
                dup = 0
            else:
                dup += 1
                values[i] = values[i] - np.float32(1e-6) * np.float32(dup)
        return [float(x) for x in values]
    return shown.tolist()
