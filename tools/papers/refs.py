"""Parsing a raw bibliography string into title, authors, year and the rest (``details``).

Bibliography-only records of the collection are shown to the agent as these parsed fields, never as
the citing paper's string verbatim (:mod:`toolgym.tools.papers.collection`); the parsed title also
feeds the title rule of de-duplication.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from toolgym.tools.papers.ids import ARXIV_ID_IN_TEXT, DOI_IN_TEXT

__all__ = ["ParsedReference", "parse_reference"]

_YEAR = re.compile(r"(?<!\d)((?:19|20)\d{2})[a-z]?(?!\d)")


@dataclass(frozen=True)
class ParsedReference:
    """Fields recovered from a raw reference string; ``None``/empty when not recognised."""

    title: str | None
    authors: tuple[str, ...]
    year: int | None
    details: str


_INITIAL = re.compile(r"(?:\b|(?<=-))[A-Z][a-z]?$")


def _split_sentences(text: str) -> list[str]:
    """Split on '. ' but not after an initial ('J. Smith') or common abbreviations."""
    parts, start = [], 0
    for match in re.finditer(r"\.\s+", text):
        head = text[start : match.start()]
        last = head.rsplit(" ", 1)[-1]
        if (
            _INITIAL.search(last)
            and len(last.split("-")[-1]) <= 2
            or last.lower() in {"al", "et", "vol", "no", "pp", "eds", "ed"}
        ):
            continue
        parts.append(text[start : match.start()].strip())
        start = match.end()
    parts.append(text[start:].strip().rstrip("."))
    return [p for p in parts if p]


def _split_authors(text: str) -> tuple[str, ...]:
    text = re.sub(r"\bet al\.?", "", text)
    pieces = re.split(
        r";|,\s*(?:and|&)\s+|\s+(?:and|&)\s+|,\s*(?=[A-Z][a-z]?[.\s-])|,\s*(?=[A-Z][\w’'\-]+\s)", text
    )
    out = []
    for piece in pieces:
        piece = piece.strip(" ,.")
        if piece and len(piece) <= 60:
            out.append(piece)
    return tuple(out)


def _looks_like_authors(text: str) -> bool:
    if not text or len(text) > 400 or re.search(r"\d{3}", text):
        return False
    if re.search(r"\b[A-Z]\.", text) or "," in text or " and " in text:
        return True
    words = text.split()
    return 2 <= len(words) <= 4 and all(w[:1].isupper() for w in words)


def parse_reference(raw: str) -> ParsedReference:
    """Best-effort split of a raw reference into title, authors, year and the rest (``details``).

    Recognises quoted titles (``“Title,”``), ``Authors. Title. Venue`` and ``Authors. Year. Title.``
    layouts; other layouts (physics ``Authors, Journal Vol, Page (Year)``) keep ``title=None``.
    """
    text = re.sub(r"\s+", " ", raw.replace("~", " ")).strip()
    clean = DOI_IN_TEXT.sub(" ", text)
    clean = ARXIV_ID_IN_TEXT.sub(" ", clean)
    years = [int(y) for y in _YEAR.findall(clean)]
    year = years[-1] if years else None
    title: str | None = None
    authors: tuple[str, ...] = ()
    rest = text
    quoted = re.search(r"[“\"]\s*(.+?)\s*[,.]?\s*[”\"]", text)
    if quoted and len(quoted.group(1).split()) >= 2:
        title = quoted.group(1).strip(" ,.")
        head = text[: quoted.start()].strip(" ,.")
        if _looks_like_authors(head):
            authors = _split_authors(head)
        rest = (head if not authors else "") + " " + text[quoted.end() :]
    else:
        parts = _split_sentences(text)
        if len(parts) >= 2 and _looks_like_authors(parts[0]):
            candidate_idx = 1
            head = parts[0]
            year_only = re.fullmatch(r"\(?((?:19|20)\d{2})[a-z]?\)?", parts[1])
            if year_only and len(parts) >= 3:
                candidate_idx = 2
            elif m := re.search(r"\(?((?:19|20)\d{2})[a-z]?\)?$", head):
                head = head[: m.start()].strip(" ,.")
            candidate = parts[candidate_idx]
            if len(candidate.split()) >= 3 and not re.match(r"^(?:In |Phys|J\.|Proc)", candidate):
                title = candidate.strip(" ,.")
                authors = _split_authors(head)
                rest = ". ".join(parts[candidate_idx + 1 :])
    if title is not None and (
        len(re.findall(r"[A-Za-z]{2,}", title)) < 3 or _NAME.fullmatch(title.split(",")[0].strip())
    ):
        title, authors, rest = None, (), text
    if not authors:
        authors, rest = _author_prefix(rest)
    rest = re.sub(r"\s+", " ", rest).strip(" ,.")
    return ParsedReference(title=title, authors=authors, year=year, details=rest)


_NAME = re.compile(
    r"(?:(?:[A-Z][a-z]?\.[\s-]?)+\s*[A-Z][\w’'\-]+(?:\s[A-Z][\w’'\-]+)?"
    r"|[A-Z][\w’'\-]+(?:\s[A-Z][\w’'\-]+)?,?\s+(?:[A-Z]\.[\s-]?)+"
    r"|[A-Z][a-z]+\s[A-Z][\w’'\-]+)(?:\set al\.?)?"
)


def _author_prefix(text: str) -> tuple[tuple[str, ...], str]:
    """Leading ``A. Name, B. Name, and C. Name,`` (or ``Name A. B.,``) run of a physics-style reference."""
    authors: list[str] = []
    pos = 0
    pattern = re.compile(
        r"\s*(?:and\s+|&\s+)?(" + _NAME.pattern + r")\s*(?:\([^)]{1,20}\))?\s*(?:,|;|\band\b|&)\s*"
    )
    while match := pattern.match(text, pos):
        authors.append(match.group(1).strip(" ,"))
        pos = match.end()
    if not authors:
        return (), text
    return tuple(authors), text[pos:]
