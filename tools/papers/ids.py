"""Paper identifiers, normalised so that the many spellings of one paper's id compare equal.

arXiv ids lose their version and their ``arXiv:``/URL prefixes, DOIs their resolver prefix and case,
OpenAlex ids their URL; titles become accent-free lower-case words. The collection de-duplicates on
these forms (:mod:`toolgym.tools.papers.collection`) and resolves a submitted id through them.
"""

from __future__ import annotations

import re
import unicodedata

__all__ = [
    "ARXIV_ID_IN_TEXT",
    "DOI_IN_TEXT",
    "normalise_arxiv_id",
    "normalise_doi",
    "normalise_openalex_id",
    "normalise_title",
]

#: A new-style arXiv id (``2104.06921``, version suffix allowed) inside running text.
ARXIV_ID_IN_TEXT = re.compile(r"(?<![\d.])(\d{4}\.\d{4,5})(?:v\d+)?(?![\d])")
#: A DOI inside running text (it ends at whitespace, a bracket, comma, semicolon or quote).
DOI_IN_TEXT = re.compile(r"\b(10\.\d{4,9}/[^\s\]\[,;\"“”]+)", re.IGNORECASE)


def normalise_arxiv_id(value: str | None) -> str | None:
    """``arXiv:2104.06921v2`` -> ``2104.06921``; ``hep-ph/0511200`` stays; anything else -> None."""
    if not value:
        return None
    text = str(value).strip()
    text = re.sub(r"^(?:https?://arxiv\.org/(?:abs|pdf)/|arxiv:)", "", text, flags=re.IGNORECASE)
    match = ARXIV_ID_IN_TEXT.fullmatch(text) or re.fullmatch(r"(\d{4}\.\d{4,5})(?:v\d+)?", text)
    if match:
        return match.group(1)
    match = re.fullmatch(r"([a-z][a-z\-]*(?:\.[a-z]{2})?/\d{7})(?:v\d+)?", text, flags=re.IGNORECASE)
    return match.group(1).lower() if match else None


def normalise_doi(value: str | None) -> str | None:
    """Lower-case DOI without resolver prefix or trailing punctuation; None if it is not a DOI."""
    if not value:
        return None
    text = re.sub(r"^(?:https?://(?:dx\.)?doi\.org/|doi:\s*)", "", str(value).strip(), flags=re.IGNORECASE)
    text = text.rstrip(".,;)]}").lower()
    return text if re.fullmatch(r"10\.\d{4,9}/\S+", text) else None


def normalise_openalex_id(value: str | None) -> str | None:
    """``https://openalex.org/W4225968159`` -> ``W4225968159``; None if it is not a work id."""
    if not value:
        return None
    match = re.search(r"\b(W\d+)\s*$", str(value).strip(), flags=re.IGNORECASE)
    return match.group(1).upper() if match else None


def normalise_title(value: str | None) -> str | None:
    """Accent-free lower-case words joined by spaces; None when fewer than 3 words (too weak to match)."""
    if not value:
        return None
    if value.isascii():  # the common case: nothing to decompose
        text = value.lower()
    else:
        text = unicodedata.normalize("NFKD", value)
        text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    words = re.findall(r"[a-z0-9]+", text)
    return " ".join(words) if len(words) >= 3 else None
