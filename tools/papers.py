"""The paper store behind ``toolgym/ArxivRefs-v0``: reading a full-text corpus and building a collection.

Input format (one JSON object per line, ``.jsonl`` or ``.jsonl.gz``; unarXive, S2ORC-like):

    ``paper_id``     str, required: the paper's id (an arXiv id such as ``2212.11867`` when it has one).
    ``body_text``    list, required: paragraphs ``{"text": str, "section": str | null, "cite_spans": [...]}``.
                     Citations are ``{{cite:<ref_id>}}`` markers inside ``text`` (unarXive). A paragraph
                     without markers may give ``cite_spans`` with ``start``/``end``/``ref_id`` instead
                     (S2ORC); the spans are turned into markers when read.
    ``bib_entries``  object, required: ``{ref_id: {"bib_entry_raw": str, "ids": {"arxiv_id", "doi",
                     "open_alex_id"}}}``; every id is optional. A ``title`` field may also be given.
    ``metadata``     object, optional: ``title``, ``authors`` (one string, comma separated), ``doi``,
                     ``versions[0].created`` (RFC 2822 date) or ``update_date`` (``YYYY-MM-DD``).
    ``abstract``     optional: a string or ``{"text": str}``.
    ``ref_entries``  optional: ``{id: {"type": "formula" | "figure" | "table", "latex": str}}``, used to
                     render ``{{formula:<id>}}`` markers.
    ``split``        optional: ``"train"`` or ``"test"``, the paper's split as a query paper (see
                     :mod:`toolgym.splits`); absent or ``null``: the environment's hash rule decides.

A malformed record raises :class:`~toolgym.errors.ConfigError` naming ``file:line`` and the field.

Collection (:func:`build_collection`): every full paper plus every bibliography entry, de-duplicated
across papers in this order: shared arXiv id (versions and ``arXiv:`` prefixes ignored), then DOI, then
OpenAlex id, then normalised title (lower-case words, at least 3 of them). A later rule never merges two
groups whose ids of an earlier kind disagree (two different arXiv ids stay two papers, even with one
title). Each entry gets a stable collection id: the first 10 hex digits of the SHA-1 of its strongest key
(``arxiv:…``, ``doi:…``, ``openalex:…``, ``title:…``, or for an entry with none of them its source
paper and ref id), so ids do not depend on file order.

Bibliography-only entries keep their raw strings privately (``raw_refs``) and are *shown* only as
parsed fields (title, authors, year, ids, and the rest of the string as ``details``), never as the
citing paper's string verbatim.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import re
import unicodedata
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from importlib import resources
from pathlib import Path
from typing import Any

from toolgym.data import json_error
from toolgym.errors import ConfigError
from toolgym.splits import record_split

__all__ = [
    "BibEntry",
    "Collection",
    "Paragraph",
    "PaperRecord",
    "SourcePaper",
    "build_collection",
    "default_corpus_path",
    "iter_citations",
    "load_papers",
    "near_duplicates",
    "normalise_arxiv_id",
    "normalise_doi",
    "normalise_openalex_id",
    "normalise_title",
    "parse_reference",
    "render_markers",
    "shingles",
]

logger = logging.getLogger(__name__)

#: The default corpus shipped in the package (unarXive sample, CC BY-SA 4.0; see its ATTRIBUTION.md).
DEFAULT_CORPUS = "unarxive_arXiv_src_2212_086.jsonl.gz"

MARKER = re.compile(r"\{\{(\w+):([^{}]*)\}\}")
_NEW_ARXIV = re.compile(r"(?<![\d.])(\d{4}\.\d{4,5})(?:v\d+)?(?![\d])")
_OLD_ARXIV = re.compile(r"\b([a-z][a-z\-]*(?:\.[A-Z]{2})?/\d{7})(?:v\d+)?\b", re.IGNORECASE)
_DOI = re.compile(r"\b(10\.\d{4,9}/[^\s\]\[,;\"“”]+)", re.IGNORECASE)
_YEAR = re.compile(r"(?<!\d)((?:19|20)\d{2})[a-z]?(?!\d)")
_CITE_CMD = re.compile(r"\\cite\w*\s*(?:\[[^\]]*\]\s*)*\{[^}]*\}")


def default_corpus_path() -> Path:
    """The packaged unarXive sample (found through package resources, so it works from a wheel)."""
    ref = resources.files("toolgym.envs") / "data" / "citations" / DEFAULT_CORPUS
    path = Path(str(ref))
    if not path.is_file():
        raise ConfigError(
            f"the packaged corpus {DEFAULT_CORPUS} is missing; reinstall toolgym (expected at {path})"
        )
    return path


# --------------------------------------------------------------------------------------------- ids


def normalise_arxiv_id(value: str | None) -> str | None:
    """``arXiv:2104.06921v2`` -> ``2104.06921``; ``hep-ph/0511200`` stays; anything else -> None."""
    if not value:
        return None
    text = str(value).strip()
    text = re.sub(r"^(?:https?://arxiv\.org/(?:abs|pdf)/|arxiv:)", "", text, flags=re.IGNORECASE)
    match = _NEW_ARXIV.fullmatch(text) or re.fullmatch(r"(\d{4}\.\d{4,5})(?:v\d+)?", text)
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
    text = unicodedata.normalize("NFKD", value)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    words = re.findall(r"[a-z0-9]+", text)
    return " ".join(words) if len(words) >= 3 else None


# ------------------------------------------------------------------------------------- references


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
    clean = _DOI.sub(" ", text)
    clean = _NEW_ARXIV.sub(" ", clean)
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


# ------------------------------------------------------------------------------------------ input


@dataclass(frozen=True)
class Paragraph:
    """One body paragraph; citations are ``{{cite:<ref_id>}}`` markers in ``text``."""

    section: str
    text: str


@dataclass(frozen=True)
class BibEntry:
    """One bibliography entry of a source paper, with its ids normalised."""

    ref_id: str
    raw: str
    arxiv_id: str | None = None
    doi: str | None = None
    openalex_id: str | None = None
    title: str | None = None


@dataclass(frozen=True)
class SourcePaper:
    """A full-text paper read from the corpus (``where`` is ``file:line`` for error messages).

    ``split`` is the record's own ``"train"``/``"test"`` label, or ``None`` when it gives none.
    """

    paper_id: str
    title: str
    authors: tuple[str, ...]
    date: tuple[int, int, int] | None
    abstract: str
    paragraphs: tuple[Paragraph, ...]
    bib: Mapping[str, BibEntry]
    formulas: Mapping[str, tuple[str, str]]
    doi: str | None
    where: str
    split: str | None = None


def _date_from_metadata(meta: Mapping[str, Any]) -> tuple[int, int, int] | None:
    versions = meta.get("versions")
    if (
        isinstance(versions, list)
        and versions
        and isinstance(versions[0], dict)
        and versions[0].get("created")
    ):
        try:
            dt = parsedate_to_datetime(str(versions[0]["created"]))
            return (dt.year, dt.month, dt.day)
        except (TypeError, ValueError):
            pass
    for key in ("update_date", "date"):
        value = meta.get(key)
        if isinstance(value, str) and (m := re.fullmatch(r"(\d{4})-(\d{2})-(\d{2})", value.strip())):
            return (int(m.group(1)), int(m.group(2)), int(m.group(3)))
    return None


def _spans_to_markers(text: str, spans: Sequence[Any], where: str) -> str:
    """S2ORC style: insert ``{{cite:ref_id}}`` markers for ``cite_spans`` given as offsets."""
    ordered = []
    for span in spans:
        if not isinstance(span, dict) or not isinstance(span.get("ref_id"), str):
            raise ConfigError(f"{where}: each cite_span needs a string 'ref_id', got {span!r}")
        start, end = span.get("start"), span.get("end")
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= len(text)):
            raise ConfigError(
                f"{where}: cite_span offsets must be ints with 0 <= start <= end <= {len(text)}, got {start!r}..{end!r}"
            )
        ordered.append((start, end, span["ref_id"]))
    for start, end, ref_id in sorted(ordered, reverse=True):
        text = text[:start] + "{{cite:" + ref_id + "}}" + text[end:]
    return text


def _parse_record(record: Any, where: str) -> SourcePaper:
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object per line, got {type(record).__name__}")
    for key, kind in (("paper_id", str), ("body_text", list), ("bib_entries", dict)):
        if key not in record:
            raise ConfigError(
                f"{where}: record lacks {key!r} (each line needs paper_id, body_text, bib_entries)"
            )
        if not isinstance(record[key], kind):
            raise ConfigError(f"{where}: {key!r} must be a {kind.__name__}, got {type(record[key]).__name__}")
    meta = record.get("metadata") or {}
    if not isinstance(meta, dict):
        raise ConfigError(f"{where}: 'metadata' must be an object, got {type(meta).__name__}")
    paragraphs = []
    for i, para in enumerate(record["body_text"]):
        if not isinstance(para, dict) or not isinstance(para.get("text"), str):
            raise ConfigError(f"{where}: body_text[{i}] must be an object with a string 'text'")
        text = para["text"]
        spans = para.get("cite_spans") or []
        if not isinstance(spans, list):
            raise ConfigError(f"{where}: body_text[{i}].cite_spans must be a list")
        if spans and "{{cite:" not in text:
            text = _spans_to_markers(text, spans, f"{where}: body_text[{i}]")
        paragraphs.append(Paragraph(section=str(para.get("section") or ""), text=text))
    bib = {}
    for ref_id, entry in record["bib_entries"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("bib_entry_raw", ""), str):
            raise ConfigError(
                f"{where}: bib_entries[{ref_id!r}] must be an object with a string 'bib_entry_raw'"
            )
        ids = entry.get("ids") or {}
        if not isinstance(ids, dict):
            raise ConfigError(f"{where}: bib_entries[{ref_id!r}].ids must be an object")
        raw = entry.get("bib_entry_raw", "") or ""
        arxiv = normalise_arxiv_id(ids.get("arxiv_id"))
        for found in entry.get("contained_arXiv_ids") or []:
            arxiv = arxiv or normalise_arxiv_id(found.get("id") if isinstance(found, dict) else found)
        if arxiv is None and (m := re.search(r"arxiv:\s*(\S+?)(?=[\s\]\[,;]|$)", raw, flags=re.IGNORECASE)):
            arxiv = normalise_arxiv_id(m.group(1))
        doi = normalise_doi(ids.get("doi"))
        if doi is None and (m := _DOI.search(raw)):
            doi = normalise_doi(m.group(1))
        bib[ref_id] = BibEntry(
            ref_id=ref_id,
            raw=raw,
            arxiv_id=arxiv,
            doi=doi,
            openalex_id=normalise_openalex_id(ids.get("open_alex_id")),
            title=entry.get("title") if isinstance(entry.get("title"), str) else None,
        )
    abstract = record.get("abstract") or ""
    if isinstance(abstract, dict):
        abstract = abstract.get("text") or ""
    if not isinstance(abstract, str):
        raise ConfigError(f"{where}: 'abstract' must be a string or an object with 'text'")
    formulas = {}
    for ref_id, entry in (record.get("ref_entries") or {}).items():
        if isinstance(entry, dict):
            formulas[ref_id] = (str(entry.get("type") or ""), str(entry.get("latex") or ""))
    authors = meta.get("authors") or record.get("authors") or ""
    if isinstance(authors, str):
        authors = tuple(a.strip() for a in re.split(r",|\band\b", authors.replace("\n", " ")) if a.strip())
    elif isinstance(authors, list):
        authors = tuple(str(a) for a in authors)
    else:
        raise ConfigError(f"{where}: 'authors' must be a string or a list of strings")
    title = re.sub(r"\s+", " ", str(meta.get("title") or record.get("title") or "")).strip()
    return SourcePaper(
        paper_id=record["paper_id"],
        title=title,
        authors=authors,
        date=_date_from_metadata(meta) or _date_from_metadata(record),
        abstract=re.sub(r"\s+", " ", abstract).strip(),
        paragraphs=tuple(paragraphs),
        bib=bib,
        formulas=formulas,
        doi=normalise_doi(meta.get("doi") or record.get("doi")),
        where=where,
        split=record_split(record.get("split"), where),
    )


def load_papers(path: str | Path | None = None) -> list[SourcePaper]:
    """Read a corpus file (default: the packaged unarXive sample); errors name ``file:line``."""
    path = Path(path) if path is not None else default_corpus_path()
    if not path.is_file():
        raise ConfigError(
            f"{path}: no such corpus file (expected JSONL, see toolgym.tools.papers for the format)"
        )
    opener = gzip.open if path.suffix == ".gz" else open
    papers: list[SourcePaper] = []
    seen: dict[str, str] = {}
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{where}: not valid JSON ({json_error(exc)})") from None
                paper = _parse_record(record, where)
                if paper.paper_id in seen:
                    raise ConfigError(
                        f"{where}: paper_id {paper.paper_id!r} already used at {seen[paper.paper_id]}"
                    )
                seen[paper.paper_id] = where
                papers.append(paper)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except (OSError, EOFError) as exc:
        raise ConfigError(f"{path}: cannot read ({exc})") from None
    if not papers:
        raise ConfigError(f"{path}: no records")
    return papers


# ------------------------------------------------------------------------------------- rendering


def render_markers(
    text: str, formulas: Mapping[str, tuple[str, str]], *, cite: str = "", max_formula_chars: int = 60
) -> str:
    """Readable text: formulas as ``$latex$`` (long ones as ``[FORMULA]``), figures/tables as tags.

    ``cite`` replaces citation markers (empty: removed). ``\\cite`` commands that leak into formula
    LaTeX are removed, so cite keys never reach the agent.
    """

    def one(match: re.Match[str]) -> str:
        kind, ref = match.group(1), match.group(2)
        if kind == "cite":
            return cite
        if kind == "formula":
            raw = _CITE_CMD.sub("", formulas.get(ref, ("", ""))[1])
            latex = re.sub(r"\s+", " ", raw).strip()
            if re.search(r"(?:^|\s)[A-Za-z]{3,}\s+[A-Za-z]{2,}(?:\s|$)", raw) and "\\" not in raw:
                # unarXive artefact: the "formula" is the prose between two formulas; show it as text.
                return f" {latex} "
            return f"${latex}$" if latex and len(latex) <= max_formula_chars else "[FORMULA]"
        return f"[{kind.upper()}]"

    return re.sub(r"[ \t]+", " ", MARKER.sub(one, text)).strip()


def shingles(text: str, n: int = 8) -> set[int]:
    """Hashed word n-grams, for near-duplicate detection (markers dropped, case folded)."""
    words = re.findall(r"\w+", MARKER.sub(" ", text).lower())
    return {hash(" ".join(words[i : i + n])) for i in range(max(0, len(words) - n + 1))}


# ------------------------------------------------------------------------------------ collection


@dataclass(frozen=True)
class PaperRecord:
    """One entry of the collection (a full paper, a bibliography entry, or both merged).

    ``date`` is ``(year, month, day)`` with 0 for an unknown month/day; ``raw_refs`` are the raw
    bibliography strings merged here (kept for matching, never shown to the agent).
    """

    id: str
    title: str | None
    authors: tuple[str, ...]
    year: int | None
    date: tuple[int, int, int] | None
    abstract: str
    text: str
    details: str
    arxiv_ids: tuple[str, ...]
    dois: tuple[str, ...]
    openalex_ids: tuple[str, ...]
    full_paper: str | None
    sources: tuple[str, ...]
    raw_refs: tuple[str, ...] = field(repr=False, default=())

    def index_doc(self) -> dict[str, str]:
        """The ``{"id", "title", "text"}`` document for the search index."""
        parts = [", ".join(self.authors), str(self.year or ""), self.details, self.abstract, self.text]
        return {"id": self.id, "title": self.title or "", "text": "\n".join(p for p in parts if p)}

    def display_title(self) -> str:
        if self.title:
            return self.title
        return "(title unknown) " + (self.details[:80] + ("…" if len(self.details) > 80 else ""))


@dataclass(frozen=True)
class Collection:
    """The de-duplicated collection plus the links from source papers and their references to it."""

    records: Mapping[str, PaperRecord]
    papers: tuple[SourcePaper, ...]
    paper_ids: Mapping[str, str]
    ref_ids: Mapping[tuple[str, str], str]
    aliases: Mapping[str, str]

    def resolve(self, value: str) -> str | None:
        """The collection id for a collection id, arXiv id (any version/prefix), DOI or OpenAlex id."""
        value = str(value).strip()
        if value in self.records:
            return value
        for key in (
            f"arxiv:{normalise_arxiv_id(value)}",
            f"doi:{normalise_doi(value)}",
            f"openalex:{normalise_openalex_id(value)}",
        ):
            if key in self.aliases:
                return self.aliases[key]
        return None

    def counts(self) -> dict[str, int]:
        full = sum(1 for r in self.records.values() if r.full_paper)
        bib_total = sum(len(p.bib) for p in self.papers)
        return {
            "papers": len(self.papers),
            "bib_entries": bib_total,
            "records": len(self.records),
            "full_text_records": full,
            "reference_only_records": len(self.records) - full,
            "merged_away": len(self.papers) + bib_total - len(self.records),
        }


class _UnionFind:
    """Union-find whose groups remember their ids, so merges across conflicting ids are refused."""

    def __init__(self, keys: Sequence[dict[str, set[str]]]) -> None:
        self.parent = list(range(len(keys)))
        self.keys = [{kind: set(values) for kind, values in k.items()} for k in keys]

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, a: int, b: int, guard: Sequence[str]) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        for kind in guard:
            ka, kb = self.keys[ra].get(kind, set()), self.keys[rb].get(kind, set())
            if ka and kb and not ka & kb:
                return
        self.parent[rb] = ra
        for kind, values in self.keys[rb].items():
            self.keys[ra].setdefault(kind, set()).update(values)


_KINDS = ("arxiv", "doi", "openalex", "title")


def _arxiv_date(arxiv_id: str) -> tuple[int, int, int] | None:
    m = re.fullmatch(r"(\d{2})(\d{2})\.\d{4,5}", arxiv_id) or re.search(r"/(\d{2})(\d{2})\d{3}$", arxiv_id)
    if not m:
        return None
    yy, mm = int(m.group(1)), int(m.group(2))
    return (1900 + yy if yy >= 91 else 2000 + yy, mm, 0) if 1 <= mm <= 12 else None


def build_collection(papers: Sequence[SourcePaper]) -> Collection:
    """De-duplicate full papers and bibliography entries into one collection (rules: module docstring)."""
    items: list[
        tuple[str, Any]
    ] = []  # ("paper", SourcePaper) | ("bib", (SourcePaper, BibEntry, ParsedReference))
    keys: list[dict[str, set[str]]] = []
    for paper in papers:
        k: dict[str, set[str]] = {}
        if aid := normalise_arxiv_id(paper.paper_id):
            k["arxiv"] = {aid}
        if paper.doi:
            k["doi"] = {paper.doi}
        if t := normalise_title(paper.title):
            k["title"] = {t}
        items.append(("paper", paper))
        keys.append(k)
    for paper in papers:
        for entry in paper.bib.values():
            parsed = parse_reference(entry.raw)
            k = {}
            for kind, value in (
                ("arxiv", entry.arxiv_id),
                ("doi", entry.doi),
                ("openalex", entry.openalex_id),
            ):
                if value:
                    k[kind] = {value}
            if t := normalise_title(entry.title or parsed.title):
                k["title"] = {t}
            items.append(("bib", (paper, entry, parsed)))
            keys.append(k)
    uf = _UnionFind(keys)
    for depth, kind in enumerate(_KINDS):
        first: dict[str, int] = {}
        for i, k in enumerate(keys):
            for value in sorted(k.get(kind, ())):
                if value in first:
                    uf.union(first[value], i, _KINDS[:depth])
                else:
                    first[value] = i
    groups: dict[int, list[int]] = {}
    for i in range(len(items)):
        groups.setdefault(uf.find(i), []).append(i)

    records: dict[str, PaperRecord] = {}
    paper_ids: dict[str, str] = {}
    ref_ids: dict[tuple[str, str], str] = {}
    aliases: dict[str, str] = {}
    for members in groups.values():
        record = _merge([items[i] for i in members], [keys[i] for i in members])
        if record.id in records:
            raise ConfigError(f"collection id collision for {record.id}; report this corpus as a bug")
        records[record.id] = record
        for i in members:
            kind, payload = items[i]
            if kind == "paper":
                paper_ids[payload.paper_id] = record.id
            else:
                ref_ids[(payload[0].paper_id, payload[1].ref_id)] = record.id
        for value in record.arxiv_ids:
            aliases[f"arxiv:{value}"] = record.id
        for value in record.dois:
            aliases[f"doi:{value}"] = record.id
        for value in record.openalex_ids:
            aliases[f"openalex:{value}"] = record.id
    ordered = dict(sorted(records.items()))
    return Collection(
        records=ordered, papers=tuple(papers), paper_ids=paper_ids, ref_ids=ref_ids, aliases=aliases
    )


def _merge(members: list[tuple[str, Any]], keys: list[dict[str, set[str]]]) -> PaperRecord:
    merged: dict[str, set[str]] = {}
    for k in keys:
        for kind, values in k.items():
            merged.setdefault(kind, set()).update(values)
    full = sorted((p for kind, p in members if kind == "paper"), key=lambda p: p.paper_id)
    bibs = sorted((b for kind, b in members if kind == "bib"), key=lambda b: (b[0].paper_id, b[1].ref_id))
    for kind in ("arxiv", "doi", "openalex", "title"):
        if merged.get(kind):
            strongest = f"{kind}:{sorted(merged[kind])[0]}"
            break
    else:
        source = full[0].paper_id if full else f"{bibs[0][0].paper_id}#{bibs[0][1].ref_id}"
        strongest = f"source:{source}"
    cid = hashlib.sha1(strongest.encode()).hexdigest()[:10]
    arxiv_ids = tuple(sorted(merged.get("arxiv", ())))
    dates = [_arxiv_date(a) for a in arxiv_ids]
    if full:
        paper = full[0]
        formulas = paper.formulas
        body = "\n".join(render_markers(p.text, formulas) for p in paper.paragraphs)
        title: str | None = paper.title or None
        authors = paper.authors
        date = paper.date or next((d for d in dates if d), None)
        abstract, details = paper.abstract, ""
        year = date[0] if date else None
    else:
        parsed = [b[2] for b in bibs]
        titled = [p for p in parsed if p.title]
        best = max(titled, key=lambda p: (len(p.authors) > 0, len(p.title or "")), default=parsed[0])
        title = best.title or next((b[1].title for b in bibs if b[1].title), None)
        authors = best.authors or next((p.authors for p in parsed if p.authors), ())
        years = [p.year for p in parsed if p.year]
        arxiv_date = next((d for d in dates if d), None)
        date = arxiv_date or ((min(years), 0, 0) if years else None)
        year = date[0] if date else None
        details = best.details
        if not best.authors and not best.title:
            # Nothing recognised: show only the first half, so the citing paper's string never appears whole.
            details = details[: max(20, len(details) // 2)] + "…"
        abstract, body = "", ""
    return PaperRecord(
        id=cid,
        title=title,
        authors=tuple(authors),
        year=year,
        date=date,
        abstract=abstract,
        text=body,
        details=details,
        arxiv_ids=arxiv_ids,
        dois=tuple(sorted(merged.get("doi", ()))),
        openalex_ids=tuple(sorted(merged.get("openalex", ()))),
        full_paper=full[0].paper_id if full else None,
        sources=tuple(
            [f"paper:{p.paper_id}" for p in full] + [f"bib:{b[0].paper_id}#{b[1].ref_id}" for b in bibs]
        ),
        raw_refs=tuple(b[1].raw for b in bibs),
    )


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


def iter_citations(text: str) -> Iterator[tuple[int, int, str]]:
    """``(start, end, ref_id)`` of each citation marker in ``text``."""
    for match in MARKER.finditer(text):
        if match.group(1) == "cite":
            yield match.start(), match.end(), match.group(2)
