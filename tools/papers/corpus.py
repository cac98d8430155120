"""Reading a full-text paper corpus (the input of ``toolgym/ArxivRefs-v0``) into :class:`SourcePaper` values.

Input format (one JSON object per line, ``.jsonl`` or ``.jsonl.gz``; unarXive, S2ORC-like):

    ``paper_id``     str, required: the paper's id (an arXiv id such as ``2212.11867`` when it has one).
    ``body_text``    list, required: paragraphs ``{"text": str, "section": str | null, "cite_spans": [...]}``.
                     Citations are ``{{cite:<ref_id>}}`` markers inside ``text`` (unarXive). A paragraph
                     without markers may give ``cite_spans`` with ``start``/``end``/``ref_id`` instead
                     (S2ORC); the spans are turned into markers when read.
    ``bib_entries``  object, required: ``{ref_id: {"bib_entry_raw": str, "ids": {"arxiv_id", "doi",
                     "open_alex_id"}}}``; every id is optional. A ``title`` field may also be given.
    ``metadata``     object, optional: ``title``, ``authors`` (one string, comma separated), ``doi``,
                     ``versions[0].created`` (RFC 2822 date) or ``update_date`` (``YYYY-MM-DD``,
                     ``YYYY-MM`` or ``YYYY``: 0 stands for the unknown month/day).
    ``abstract``     optional: a string or ``{"text": str}``.
    ``ref_entries``  optional: ``{id: {"type": "formula" | "figure" | "table", "latex": str}}``, used to
                     render ``{{formula:<id>}}`` markers.
    ``split``        optional: ``"train"`` or ``"test"``, the paper's split as a query paper (see
                     :mod:`toolgym.splits`); absent or ``null``: the environment's hash rule decides.

A malformed record raises :class:`~toolgym.errors.ConfigError` naming ``file:line`` and the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from importlib import resources
from pathlib import Path
from typing import Any

from toolgym.data import UniqueIds, iter_jsonl
from toolgym.errors import ConfigError
from toolgym.splits import record_split
from toolgym.tools.papers.ids import DOI_IN_TEXT, normalise_arxiv_id, normalise_doi, normalise_openalex_id

__all__ = [
    "DEFAULT_CORPUS",
    "BibEntry",
    "Paragraph",
    "SourcePaper",
    "default_corpus_path",
    "load_papers",
]

#: The default corpus shipped in the package (unarXive sample, CC BY-SA 4.0; see its ATTRIBUTION.md).
DEFAULT_CORPUS = "unarxive_arXiv_src_2212_086.jsonl.gz"


def default_corpus_path() -> Path:
    """The packaged unarXive sample (found through package resources, so it works from a wheel)."""
    ref = resources.files("toolgym.envs") / "data" / "citations" / DEFAULT_CORPUS
    path = Path(str(ref))
    if not path.is_file():
        raise ConfigError(
            f"the packaged corpus {DEFAULT_CORPUS} is missing; reinstall toolgym (expected at {path})"
        )
    return path


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
        if isinstance(value, str) and (
            m := re.fullmatch(r"(\d{4})(?:-(\d{2})(?:-(\d{2}))?)?", value.strip())
        ):
            return (int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 0))
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
        if doi is None and (m := DOI_IN_TEXT.search(raw)):
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
            f"{path}: no such corpus file (expected JSONL, see toolgym.tools.papers.corpus for the format)"
        )
    papers: list[SourcePaper] = []
    ids = UniqueIds(path, "paper")
    for lineno, record in iter_jsonl(path, what="corpus file"):
        paper = _parse_record(record, f"{path}:{lineno}")
        ids.add(paper.paper_id, lineno)
        papers.append(paper)
    if not papers:
        raise ConfigError(f"{path}: no records")
    return papers
