"""Collection records: papers of the searchable collection that are not full-text query papers.

``toolgym/ArxivRefs-v0`` takes them as ``collection="records.jsonl"`` (``.jsonl`` or ``.jsonl.gz``), one
JSON object per line:

    ``id``            str, required: the record's id in your data (unique in the file; also accepted
                      by ``read_paper``).
    ``title``         str, required (non-empty).
    ``abstract``      str, optional.
    ``authors``       list of str, optional (a list: names are never split by us).
    ``year``          int, optional; or ``date``: ``"YYYY"``, ``"YYYY-MM"`` or ``"YYYY-MM-DD"`` (when both
                      are given they must agree).
    ``venue``         str, optional.
    ``arxiv_id``, ``doi``, ``open_alex_id``: optional ids, also accepted inside an ``ids`` object
                      together with any others (``{"ids": {"doi": ..., "pmid": ...}}``); unknown ids are
                      kept and shown, the three known kinds link records to bibliography entries.

Given fields are shown as given, never re-parsed. A malformed line raises
:class:`~toolgym.errors.ConfigError` naming ``file:line`` and the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolgym.data import UniqueIds, iter_jsonl
from toolgym.errors import ConfigError
from toolgym.tools.papers.ids import normalise_arxiv_id, normalise_doi, normalise_openalex_id

__all__ = ["CollectionRecord", "load_records", "parse_date"]

_DATE = re.compile(r"(\d{4})(?:-(\d{2})(?:-(\d{2}))?)?")
_KNOWN_IDS = ("arxiv_id", "doi", "open_alex_id")


@dataclass(frozen=True)
class CollectionRecord:
    """One collection record as given (``date`` is ``(year, month, day)``, 0 for unknown parts).

    ``arxiv_id``/``doi``/``openalex_id`` are normalised for linking; ``other_ids`` keeps every other
    id as given; ``where`` is ``file:line``.
    """

    record_id: str
    title: str
    abstract: str
    authors: tuple[str, ...]
    date: tuple[int, int, int] | None
    venue: str
    arxiv_id: str | None
    doi: str | None
    openalex_id: str | None
    other_ids: tuple[tuple[str, str], ...]
    where: str


def parse_date(value: Any, where: str, field: str = "date") -> tuple[int, int, int]:
    """``"2021"``, ``"2021-05"``, ``"2021-05-17"`` (or an int year) -> ``(year, month, day)``, 0 = unknown.

    Raises:
        ConfigError: any other form, or an impossible month/day, naming ``where`` and the field.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        text = str(value)
    elif isinstance(value, str):
        text = value.strip()
    else:
        raise ConfigError(f"{where}: {field!r} must be a string or an integer year, got {value!r}")
    m = _DATE.fullmatch(text)
    if not m:
        raise ConfigError(
            f"{where}: unknown {field} format {value!r} (use YYYY, YYYY-MM or YYYY-MM-DD, e.g. 2021-05-17)"
        )
    year, month, day = int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 0)
    if (m.group(2) and not 1 <= month <= 12) or (m.group(3) and not 1 <= day <= 31) or year < 1000:
        raise ConfigError(f"{where}: {field} {value!r} is not a valid date (month 1-12, day 1-31)")
    return (year, month, day)


def _text(record: Mapping[str, Any], key: str, where: str) -> str:
    value = record.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
    return " ".join(value.split())


def _ids(record: Mapping[str, Any], where: str) -> dict[str, str]:
    ids = record.get("ids") or {}
    if not isinstance(ids, dict):
        raise ConfigError(f'{where}: \'ids\' must be an object such as {{"doi": "10.1/x"}}')
    out: dict[str, str] = {}
    for source in (ids, {k: record[k] for k in _KNOWN_IDS if record.get(k) is not None}):
        for kind, value in source.items():
            if value is None or value == "":
                continue
            if not isinstance(value, str | int) or isinstance(value, bool):
                raise ConfigError(f"{where}: id {kind!r} must be a string, got {value!r}")
            if kind in out and out[kind] != str(value):
                raise ConfigError(f"{where}: {kind!r} given twice with different values")
            out[str(kind)] = str(value)
    return out


def _parse(record: Any, where: str) -> CollectionRecord:
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object per line, got {type(record).__name__}")
    rid = record.get("id")
    if isinstance(rid, int) and not isinstance(rid, bool):
        rid = str(rid)
    if not isinstance(rid, str) or not rid.strip():
        raise ConfigError(
            f"{where}: collection record lacks 'id' (a non-empty string; each line needs id, title)"
        )
    title = _text(record, "title", where)
    if not title:
        raise ConfigError(f"{where}: collection record {rid!r} lacks 'title' (each line needs id, title)")
    authors = record.get("authors") or []
    if not isinstance(authors, list) or not all(isinstance(a, str) for a in authors):
        raise ConfigError(f"{where}: 'authors' must be a list of strings, e.g. [\"Ada Lovelace\"]")
    date = parse_date(record["date"], where) if record.get("date") not in (None, "") else None
    if record.get("year") not in (None, ""):
        year = parse_date(record["year"], where, "year")
        if year[1:] != (0, 0):
            raise ConfigError(f"{where}: 'year' must be a year only, got {record['year']!r} (use 'date')")
        if date is not None and date[0] != year[0]:
            raise ConfigError(f"{where}: 'year' {year[0]} disagrees with 'date' {record['date']!r}")
        date = date or year
    ids = _ids(record, where)
    arxiv = normalise_arxiv_id(ids.get("arxiv_id"))
    doi = normalise_doi(ids.get("doi"))
    openalex = normalise_openalex_id(ids.get("open_alex_id"))
    for kind, parsed, what in (
        ("arxiv_id", arxiv, "an arXiv id (2104.06921 or hep-ph/0511200)"),
        ("doi", doi, "a DOI (10.<registrant>/<suffix>)"),
        ("open_alex_id", openalex, "an OpenAlex work id (W…)"),
    ):
        if ids.get(kind) is not None and parsed is None:
            raise ConfigError(f"{where}: {kind} {ids[kind]!r} is not {what}")
    return CollectionRecord(
        record_id=rid.strip(),
        title=title,
        abstract=_text(record, "abstract", where),
        authors=tuple(a.strip() for a in authors if a.strip()),
        date=date,
        venue=_text(record, "venue", where),
        arxiv_id=arxiv,
        doi=doi,
        openalex_id=openalex,
        other_ids=tuple(sorted((k, v) for k, v in ids.items() if k not in _KNOWN_IDS)),
        where=where,
    )


def load_records(path: str | Path) -> list[CollectionRecord]:
    """Read a collection file (format: module docstring); errors name ``file:line``.

    Raises:
        ConfigError: a missing or unreadable file, a line that is not JSON or not a valid record,
            a duplicate ``id`` (naming both lines), or a file without records.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"{path}: no such collection file (JSONL, one record per line; see environments.md)"
        )
    records: list[CollectionRecord] = []
    ids = UniqueIds(path)
    for lineno, raw in iter_jsonl(path, what="collection file"):
        record = _parse(raw, f"{path}:{lineno}")
        ids.add(record.record_id, lineno)
        records.append(record)
    if not records:
        raise ConfigError(f"{path}: no records in the collection file")
    return records
