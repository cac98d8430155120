"""The default search backend's BM25: Anserini's analysis and Lucene's scoring arithmetic, reproduced.

Why our own: the default search backend must answer in a fresh process in well under a second, with
no server, no JVM and no JIT warm-up, yet rank exactly like the Lucene BM25 that retrieval papers
report. So these modules copy Anserini's *behaviour* (not its code):

* analysis as in Anserini's ``DefaultEnglishAnalyzer`` (:func:`analyze`): word segmentation as
  Lucene's ``StandardTokenizer`` does it (UAX #29 word boundaries, written as regular expressions over
  Python's character classes with the corrections listed at ``_WORD``), the English possessive filter,
  lower-casing character by character as Java does, Lucene's 33 English stop words, then the Porter
  stemmer as Lucene has it (:mod:`toolgym.tools.porter`). Checked against Lucene on every document
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

Where the rest lives: :mod:`toolgym.tools.bm25_build` writes the postings (in parallel, in bounded
memory), :mod:`toolgym.tools.bm25_search` answers queries through the C kernel
``toolgym.tools._bm25kernel`` (block-max MaxScore; ``tools/_bm25kernel.c`` explains it).
"""

from __future__ import annotations

import functools
import math
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from toolgym.tools.porter import porter_stem

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

# Word segmentation, as Lucene's StandardTokenizer does it (UAX #29 word boundaries; only segments
# holding letters, digits, ideographs or emoji become tokens). Python's \w is the starting point: it
# holds letters (with Katakana, Hangul, Thai...), decimal digits and '_'. Corrections:
# * combining marks and format characters extend the word they follow (rule WB4); \w excludes them;
# * connector punctuation beyond '_', and U+202F NARROW NO-BREAK SPACE, are ExtendNumLet: they join
#   whatever they touch (WB13a/b);
# * "other numbers" (superscripts, vulgar fractions, circled digits: category No) are in \w but are
#   no word characters for UAX #29: they are removed before matching;
# * MidLetter / MidNumLet / Single_Quote join two letters (WB6/7), MidNum / MidNumLet / Single_Quote
#   two digits (WB11/12); Hebrew letters also join across '"' (WB7b/c) and keep a following "'" (WB7a);
# * Han and Hiragana are one token per character; emoji (Extended_Pictographic, with their
#   modifiers and ZWJ sequences) are tokens of their own.
_EXTEND = "".join(
    f"\\u{lo:04x}-\\u{hi:04x}"
    for lo, hi in (  # categories Mn, Mc, Me and Cf of the BMP, but U+200B and U+FEFF (not in \w)
        (0x00AD, 0x00AD),
        (0x0300, 0x036F),
        (0x0483, 0x0489),
        (0x0591, 0x05BD),
        (0x05BF, 0x05BF),
        (0x05C1, 0x05C2),
        (0x05C4, 0x05C5),
        (0x05C7, 0x05C7),
        (0x0600, 0x0605),
        (0x0610, 0x061A),
        (0x061C, 0x061C),
        (0x064B, 0x065F),
        (0x0670, 0x0670),
        (0x06D6, 0x06DD),
        (0x06DF, 0x06E4),
        (0x06E7, 0x06E8),
        (0x06EA, 0x06ED),
        (0x070F, 0x070F),
        (0x0711, 0x0711),
        (0x0730, 0x074A),
        (0x07A6, 0x07B0),
        (0x07EB, 0x07F3),
        (0x07FD, 0x07FD),
        (0x0816, 0x0819),
        (0x081B, 0x0823),
        (0x0825, 0x0827),
        (0x0829, 0x082D),
        (0x0859, 0x085B),
        (0x0890, 0x0891),
        (0x0898, 0x089F),
        (0x08CA, 0x0903),
        (0x093A, 0x093C),
        (0x093E, 0x094F),
        (0x0951, 0x0957),
        (0x0962, 0x0963),
        (0x0981, 0x0983),
        (0x09BC, 0x09BC),
        (0x09BE, 0x09C4),
        (0x09C7, 0x09C8),
        (0x09CB, 0x09CD),
        (0x09D7, 0x09D7),
        (0x09E2, 0x09E3),
        (0x09FE, 0x09FE),
        (0x0A01, 0x0A03),
        (0x0A3C, 0x0A3C),
        (0x0A3E, 0x0A42),
        (0x0A47, 0x0A48),
        (0x0A4B, 0x0A4D),
        (0x0A51, 0x0A51),
        (0x0A70, 0x0A71),
        (0x0A75, 0x0A75),
        (0x0A81, 0x0A83),
        (0x0ABC, 0x0ABC),
        (0x0ABE, 0x0AC5),
        (0x0AC7, 0x0AC9),
        (0x0ACB, 0x0ACD),
        (0x0AE2, 0x0AE3),
        (0x0AFA, 0x0AFF),
        (0x0B01, 0x0B03),
        (0x0B3C, 0x0B3C),
        (0x0B3E, 0x0B44),
        (0x0B47, 0x0B48),
        (0x0B4B, 0x0B4D),
        (0x0B55, 0x0B57),
        (0x0B62, 0x0B63),
        (0x0B82, 0x0B82),
        (0x0BBE, 0x0BC2),
        (0x0BC6, 0x0BC8),
        (0x0BCA, 0x0BCD),
        (0x0BD7, 0x0BD7),
        (0x0C00, 0x0C04),
        (0x0C3C, 0x0C3C),
        (0x0C3E, 0x0C44),
        (0x0C46, 0x0C48),
        (0x0C4A, 0x0C4D),
        (0x0C55, 0x0C56),
        (0x0C62, 0x0C63),
        (0x0C81, 0x0C83),
        (0x0CBC, 0x0CBC),
        (0x0CBE, 0x0CC4),
        (0x0CC6, 0x0CC8),
        (0x0CCA, 0x0CCD),
        (0x0CD5, 0x0CD6),
        (0x0CE2, 0x0CE3),
        (0x0D00, 0x0D03),
        (0x0D3B, 0x0D3C),
        (0x0D3E, 0x0D44),
        (0x0D46, 0x0D48),
        (0x0D4A, 0x0D4D),
        (0x0D57, 0x0D57),
        (0x0D62, 0x0D63),
        (0x0D81, 0x0D83),
        (0x0DCA, 0x0DCA),
        (0x0DCF, 0x0DD4),
        (0x0DD6, 0x0DD6),
        (0x0DD8, 0x0DDF),
        (0x0DF2, 0x0DF3),
        (0x0E31, 0x0E31),
        (0x0E34, 0x0E3A),
        (0x0E47, 0x0E4E),
        (0x0EB1, 0x0EB1),
        (0x0EB4, 0x0EBC),
        (0x0EC8, 0x0ECD),
        (0x0F18, 0x0F19),
        (0x0F35, 0x0F35),
        (0x0F37, 0x0F37),
        (0x0F39, 0x0F39),
        (0x0F3E, 0x0F3F),
        (0x0F71, 0x0F84),
        (0x0F86, 0x0F87),
        (0x0F8D, 0x0F97),
        (0x0F99, 0x0FBC),
        (0x0FC6, 0x0FC6),
        (0x102B, 0x103E),
        (0x1056, 0x1059),
        (0x105E, 0x1060),
        (0x1062, 0x1064),
        (0x1067, 0x106D),
        (0x1071, 0x1074),
        (0x1082, 0x108D),
        (0x108F, 0x108F),
        (0x109A, 0x109D),
        (0x135D, 0x135F),
        (0x1712, 0x1715),
        (0x1732, 0x1734),
        (0x1752, 0x1753),
        (0x1772, 0x1773),
        (0x17B4, 0x17D3),
        (0x17DD, 0x17DD),
        (0x180B, 0x180F),
        (0x1885, 0x1886),
        (0x18A9, 0x18A9),
        (0x1920, 0x192B),
        (0x1930, 0x193B),
        (0x1A17, 0x1A1B),
        (0x1A55, 0x1A5E),
        (0x1A60, 0x1A7C),
        (0x1A7F, 0x1A7F),
        (0x1AB0, 0x1ACE),
        (0x1B00, 0x1B04),
        (0x1B34, 0x1B44),
        (0x1B6B, 0x1B73),
        (0x1B80, 0x1B82),
        (0x1BA1, 0x1BAD),
        (0x1BE6, 0x1BF3),
        (0x1C24, 0x1C37),
        (0x1CD0, 0x1CD2),
        (0x1CD4, 0x1CE8),
        (0x1CED, 0x1CED),
        (0x1CF4, 0x1CF4),
        (0x1CF7, 0x1CF9),
        (0x1DC0, 0x1DFF),
        (0x200C, 0x200F),
        (0x202A, 0x202E),
        (0x2060, 0x2064),
        (0x2066, 0x206F),
        (0x20D0, 0x20F0),
        (0x2CEF, 0x2CF1),
        (0x2D7F, 0x2D7F),
        (0x2DE0, 0x2DFF),
        (0x302A, 0x302F),
        (0x3099, 0x309A),
        (0xA66F, 0xA672),
        (0xA674, 0xA67D),
        (0xA69E, 0xA69F),
        (0xA6F0, 0xA6F1),
        (0xA802, 0xA802),
        (0xA806, 0xA806),
        (0xA80B, 0xA80B),
        (0xA823, 0xA827),
        (0xA82C, 0xA82C),
        (0xA880, 0xA881),
        (0xA8B4, 0xA8C5),
        (0xA8E0, 0xA8F1),
        (0xA8FF, 0xA8FF),
        (0xA926, 0xA92D),
        (0xA947, 0xA953),
        (0xA980, 0xA983),
        (0xA9B3, 0xA9C0),
        (0xA9E5, 0xA9E5),
        (0xAA29, 0xAA36),
        (0xAA43, 0xAA43),
        (0xAA4C, 0xAA4D),
        (0xAA7B, 0xAA7D),
        (0xAAB0, 0xAAB0),
        (0xAAB2, 0xAAB4),
        (0xAAB7, 0xAAB8),
        (0xAABE, 0xAABF),
        (0xAAC1, 0xAAC1),
        (0xAAEB, 0xAAEF),
        (0xAAF5, 0xAAF6),
        (0xABE3, 0xABEA),
        (0xABEC, 0xABED),
        (0xFB1E, 0xFB1E),
        (0xFE00, 0xFE0F),
        (0xFE20, 0xFE2F),
        (0xFFF9, 0xFFFB),
    )
)
_JOIN_ANY = "\\u202f\\u203f\\u2040\\u2054\\ufe33\\ufe34\\ufe4d-\\ufe4f\\uff3f"  # ExtendNumLet but '_'
_W = f"[\\w{_EXTEND}{_JOIN_ANY}]"
# A token holds a letter or a digit: connector punctuation alone is none.
_START = f"[_{_JOIN_ANY}]*[^\\W_]"
_MID_LETTER = (
    ":.'\\u00b7\\u0387\\u055f\\u05f4\\u2018\\u2019\\u2024\\u2027\\ufe13\\ufe52\\ufe55\\uff07\\uff0e\\uff1a"
)
_MID_NUM = (
    ",;.'\\u037e\\u0589\\u060c\\u060d\\u066c\\u07f8\\u2018\\u2019\\u2024\\u2044"
    "\\ufe10\\ufe14\\ufe50\\ufe52\\ufe54\\uff07\\uff0c\\uff0e\\uff1b"
)
_HEBREW = "\\u05d0-\\u05ea\\u05ef-\\u05f2\\ufb1d\\ufb1f-\\ufb28\\ufb2a-\\ufb4f"
_LETTER = "[^\\W\\d_]"
_WORD = (
    rf"{_START}{_W}*(?:(?:(?<={_LETTER})[{_MID_LETTER}](?={_LETTER})|(?<=\d)[{_MID_NUM}](?=\d)"
    rf'|(?<=[{_HEBREW}])"(?=[{_HEBREW}]))\w{_W}*)*(?:(?<=[{_HEBREW}])\')?'
)
_PICTOGRAPHIC_RANGES = (
    (0x00A9, 0x00A9),
    (0x00AE, 0x00AE),
    (0x203C, 0x203C),
    (0x2049, 0x2049),
    (0x2122, 0x2122),
    (0x2139, 0x2139),
    (0x2194, 0x2199),
    (0x21A9, 0x21AA),
    (0x231A, 0x231B),
    (0x2328, 0x2328),
    (0x2388, 0x2388),
    (0x23CF, 0x23CF),
    (0x23E9, 0x23F3),
    (0x23F8, 0x23FA),
    (0x24C2, 0x24C2),
    (0x25AA, 0x25AB),
    (0x25B6, 0x25B6),
    (0x25C0, 0x25C0),
    (0x25FB, 0x25FE),
    (0x2600, 0x2605),
    (0x2607, 0x2612),
    (0x2614, 0x2685),
    (0x2690, 0x2705),
    (0x2708, 0x2712),
    (0x2714, 0x2714),
    (0x2716, 0x2716),
    (0x271D, 0x271D),
    (0x2721, 0x2721),
    (0x2728, 0x2728),
    (0x2733, 0x2734),
    (0x2744, 0x2744),
    (0x2747, 0x2747),
    (0x274C, 0x274C),
    (0x274E, 0x274E),
    (0x2753, 0x2755),
    (0x2757, 0x2757),
    (0x2763, 0x2767),
    (0x2795, 0x2797),
    (0x27A1, 0x27A1),
    (0x27B0, 0x27B0),
    (0x27BF, 0x27BF),
    (0x2934, 0x2935),
    (0x2B05, 0x2B07),
    (0x2B1B, 0x2B1C),
    (0x2B50, 0x2B50),
    (0x2B55, 0x2B55),
    (0x3030, 0x3030),
    (0x303D, 0x303D),
    (0x3297, 0x3297),
    (0x3299, 0x3299),
    (0x1F000, 0x1F0FF),
    (0x1F10D, 0x1F10F),
    (0x1F12F, 0x1F12F),
    (0x1F16C, 0x1F171),
    (0x1F17E, 0x1F17F),
    (0x1F18E, 0x1F18E),
    (0x1F191, 0x1F19A),
    (0x1F1AD, 0x1F1E5),
    (0x1F201, 0x1F20F),
    (0x1F21A, 0x1F21A),
    (0x1F22F, 0x1F22F),
    (0x1F232, 0x1F23A),
    (0x1F23C, 0x1F23F),
    (0x1F249, 0x1F3FA),
    (0x1F400, 0x1F53D),
    (0x1F546, 0x1F64F),
    (0x1F680, 0x1F6FF),
    (0x1F774, 0x1F77F),
    (0x1F7D5, 0x1F7FF),
    (0x1F80C, 0x1F80F),
    (0x1F848, 0x1F84F),
    (0x1F85A, 0x1F85F),
    (0x1F888, 0x1F88F),
    (0x1F8AE, 0x1F8FF),
    (0x1F90C, 0x1F93A),
    (0x1F93C, 0x1F945),
    (0x1F947, 0x1FAFF),
    (0x1FC00, 0x1FFFD),
)


def _char_class(ranges: tuple[tuple[int, int], ...]) -> str:
    return "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in ranges)


def _emoji(ranges: tuple[tuple[int, int], ...]) -> str:
    pictographic = _char_class(ranges)
    modifiers = "\\ufe0f\\U0001f3fb-\\U0001f3ff"
    return rf"[{pictographic}][{modifiers}]*(?:\u200d[{pictographic}][{modifiers}]*)*|[\U0001f1e6-\U0001f1ff]{{1,2}}"


#: ASCII text needs none of the corrections above: the fast path.
_TOKEN = re.compile(r"_*[^\W_]\w*(?:(?:(?<=[a-zA-Z])[:.'](?=[a-zA-Z])|(?<=\d)[,;.'](?=\d))\w+)*", re.ASCII)
_OTHER_NUMBER_RANGES = (
    (0x00B2, 0x00B3),
    (0x00B9, 0x00B9),
    (0x00BC, 0x00BE),
    (0x09F4, 0x09F9),
    (0x0B72, 0x0B77),
    (0x0BF0, 0x0BF2),
    (0x0C78, 0x0C7E),
    (0x0D58, 0x0D5E),
    (0x0D70, 0x0D78),
    (0x0F2A, 0x0F33),
    (0x1369, 0x137C),
    (0x17F0, 0x17F9),
    (0x19DA, 0x19DA),
    (0x2070, 0x2070),
    (0x2074, 0x2079),
    (0x2080, 0x2089),
    (0x2150, 0x215F),
    (0x2189, 0x2189),
    (0x2460, 0x249B),
    (0x24EA, 0x24FF),
    (0x2776, 0x2793),
    (0x2CFD, 0x2CFD),
    (0x3192, 0x3195),
    (0x3220, 0x3229),
    (0x3248, 0x324F),
    (0x3251, 0x325F),
    (0x3280, 0x3289),
    (0x32B1, 0x32BF),
    (0xA830, 0xA835),
    (0x10107, 0x10133),
    (0x10175, 0x10178),
    (0x1018A, 0x1018B),
    (0x102E1, 0x102FB),
    (0x10320, 0x10323),
    (0x10858, 0x1085F),
    (0x10879, 0x1087F),
    (0x108A7, 0x108AF),
    (0x108FB, 0x108FF),
    (0x10916, 0x1091B),
    (0x109BC, 0x109BD),
    (0x109C0, 0x109CF),
    (0x109D2, 0x109FF),
    (0x10A40, 0x10A48),
    (0x10A7D, 0x10A7E),
    (0x10A9D, 0x10A9F),
    (0x10AEB, 0x10AEF),
    (0x10B58, 0x10B5F),
    (0x10B78, 0x10B7F),
    (0x10BA9, 0x10BAF),
    (0x10CFA, 0x10CFF),
    (0x10E60, 0x10E7E),
    (0x10F1D, 0x10F26),
    (0x10F51, 0x10F54),
    (0x10FC5, 0x10FCB),
    (0x11052, 0x11065),
    (0x111E1, 0x111F4),
    (0x1173A, 0x1173B),
    (0x118EA, 0x118F2),
    (0x11C5A, 0x11C6C),
    (0x11FC0, 0x11FD4),
    (0x16B5B, 0x16B61),
    (0x16E80, 0x16E96),
    (0x1D2E0, 0x1D2F3),
    (0x1D360, 0x1D378),
    (0x1E8C7, 0x1E8CF),
    (0x1EC71, 0x1ECAB),
    (0x1ECAD, 0x1ECAF),
    (0x1ECB1, 0x1ECB4),
    (0x1ED01, 0x1ED2D),
    (0x1ED2F, 0x1ED3D),
    (0x1F100, 0x1F10C),
)
_IDEOGRAPH = re.compile(r"[\u3040-\u309f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_POSSESSIVE = ("'s", "'S", "\u2019s", "\u2019S", "\uff07s", "\uff07S")


# Character classes with ranges beyond U+FFFF make every character's test a walk over the ranges,
# so text within the Basic Multilingual Plane (nearly all of it) gets patterns without them. They are
# compiled on first use (tens of milliseconds), so an ASCII-only process never pays for them.
_BMP = 0xFFFF


@functools.cache
def _unicode_patterns(astral: bool) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """(token pattern, other-number pattern) for text within the BMP or beyond it."""
    pictographic = _PICTOGRAPHIC_RANGES if astral else tuple(r for r in _PICTOGRAPHIC_RANGES if r[1] <= _BMP)
    numbers = _OTHER_NUMBER_RANGES if astral else tuple(r for r in _OTHER_NUMBER_RANGES if r[1] <= _BMP)
    return re.compile(f"{_WORD}|{_emoji(pictographic)}"), re.compile(f"[{_char_class(numbers)}]")


def tokenize(text: str) -> list[str]:
    """Split ``text`` into the words Lucene's StandardTokenizer emits (case kept).

    Args:
        text: Any string.

    Returns:
        The tokens in order.
    """
    if text.isascii():
        return _TOKEN.findall(text)
    # Java lower-cases İ to i (one character); Han and Hiragana are single-character tokens.
    text = _IDEOGRAPH.sub(r" \g<0> ", text).replace("\u0130", "i")
    token, other_number = _unicode_patterns(max(text) > "\uffff")
    return token.findall(other_number.sub(" ", text))


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
