"""A collection on disk: written once, then opened memory-mapped by every later process.

Why: building a :class:`~toolgym.tools.papers.collection.Collection` from its input files parses every
record and merges them (tens of seconds at 100k records, single-threaded). Its stored form opens in
O(1): records stay on disk and each is decoded when it is first asked for, ids and aliases are
looked up in memory-mapped hash tables (:mod:`toolgym.tools.search.string_table`). Only the source
papers (the query papers, a few per hundred thousand records) are read whole.

Files (:func:`write_collection` lists them; the caller owns the directory and checks its files,
see :mod:`toolgym.envs.arxiv_refs.cache`)::

    records.bin, records_offsets.npy   each record as one JSON array (the fields of PaperRecord in
                                       order), back to back; record i is bytes [off[i], off[i+1])
    record_ids.*                       the collection ids by position, and position by id
    aliases.*, alias_targets.npy       alias keys ("arxiv:…", "doi:…", "openalex:…", "record:…") and
                                       the position of the record each names
    papers.json                        the source papers, their collection ids, their references'
                                       ids and the collection's counts

A stored collection equals the one written: the same records (field for field), papers, links and
counts (tests compare them). Its files are read-only once written; a record whose bytes changed
after opening is a :class:`~toolgym.errors.BackendError` naming the directory, never a wrong record.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator, Mapping, ValuesView
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from toolgym.errors import BackendError
from toolgym.tools.papers.collection import Collection, PaperRecord
from toolgym.tools.papers.corpus import BibEntry, Paragraph, SourcePaper
from toolgym.tools.search.string_table import StringTable, string_table_files, write_string_table

__all__ = ["STORE_FILES", "AliasMap", "RecordStore", "open_collection", "write_collection"]

_RECORDS, _OFFSETS, _PAPERS, _TARGETS = (
    "records.bin",
    "records_offsets.npy",
    "papers.json",
    "alias_targets.npy",
)
#: Every file a stored collection consists of.
STORE_FILES = (
    _RECORDS,
    _OFFSETS,
    *string_table_files("record_ids"),
    *string_table_files("aliases"),
    _TARGETS,
    _PAPERS,
)
_FIELDS = tuple(f.name for f in fields(PaperRecord))


def _tuples(value: Any) -> Any:
    """JSON lists back to the tuples the frozen records hold (nested ones too)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _encode_record(record: PaperRecord) -> bytes:
    # ASCII JSON: lone surrogates in the input survive the round trip exactly.
    return json.dumps([getattr(record, name) for name in _FIELDS], separators=(",", ":")).encode("ascii")


def _encode_paper(paper: SourcePaper) -> dict[str, Any]:
    return {
        "paper_id": paper.paper_id,
        "title": paper.title,
        "authors": list(paper.authors),
        "date": list(paper.date) if paper.date else None,
        "abstract": paper.abstract,
        "paragraphs": [[p.section, p.text] for p in paper.paragraphs],
        "bib": {k: [b.raw, b.arxiv_id, b.doi, b.openalex_id, b.title] for k, b in paper.bib.items()},
        "formulas": {k: list(v) for k, v in paper.formulas.items()},
        "doi": paper.doi,
        "where": paper.where,
        "split": paper.split,
    }


def _decode_paper(data: dict[str, Any]) -> SourcePaper:
    return SourcePaper(
        paper_id=data["paper_id"],
        title=data["title"],
        authors=tuple(data["authors"]),
        date=(data["date"][0], data["date"][1], data["date"][2]) if data["date"] else None,
        abstract=data["abstract"],
        paragraphs=tuple(Paragraph(section, text) for section, text in data["paragraphs"]),
        bib={
            k: BibEntry(k, raw, arxiv, doi, oa, title)
            for k, (raw, arxiv, doi, oa, title) in data["bib"].items()
        },
        formulas={k: (kind, latex) for k, (kind, latex) in data["formulas"].items()},
        doi=data["doi"],
        where=data["where"],
        split=data["split"],
    )


def write_collection(collection: Collection, out: Path) -> list[str]:
    """Write ``collection`` under the existing directory ``out``; returns the file names written.

    Records are stored in the collection's own order (by id), so positions are stable for one input.
    """
    ids = list(collection.records)
    position = {cid: i for i, cid in enumerate(ids)}
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    full_text = 0
    with open(out / _RECORDS, "wb") as fh:
        for i, record in enumerate(collection.records.values()):
            data = _encode_record(record)
            fh.write(data)
            offsets[i + 1] = offsets[i] + len(data)
            full_text += bool(record.full_paper)
    np.save(out / _OFFSETS, offsets)
    write_string_table(ids, out, "record_ids")
    write_string_table(list(collection.aliases), out, "aliases")
    targets = np.fromiter((position[c] for c in collection.aliases.values()), dtype=np.int64)
    np.save(out / _TARGETS, targets)
    meta = {
        "papers": [_encode_paper(p) for p in collection.papers],
        "paper_ids": dict(collection.paper_ids),
        "ref_ids": [[paper, ref, cid] for (paper, ref), cid in collection.ref_ids.items()],
        "given": collection.given,
        "given_linked": collection.given_linked,
        "bib_linked": collection.bib_linked,
        "full_text_records": full_text,
    }
    (out / _PAPERS).write_text(json.dumps(meta), encoding="utf-8")
    return list(STORE_FILES)


class RecordStore(Mapping[str, PaperRecord]):
    """The records of a stored collection by collection id, decoded on access (read-only, thread-safe).

    Raises:
        OSError, ValueError: a file is missing or does not hold a store (on opening).
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self.ids = StringTable(path, "record_ids")
        self._offsets = np.load(path / _OFFSETS, mmap_mode="r")
        if len(self._offsets) != len(self.ids) + 1:
            raise ValueError(f"{path / _OFFSETS}: {len(self._offsets)} offsets for {len(self.ids)} records")
        self._blob: mmap.mmap | bytes = b""
        if int(self._offsets[-1]):
            with open(path / _RECORDS, "rb") as fh:
                self._blob = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        if len(self._blob) != int(self._offsets[-1]):
            raise ValueError(
                f"{path / _RECORDS}: {len(self._blob)} bytes, the offsets say {int(self._offsets[-1])}"
            )

    def position(self, cid: object) -> int:
        """The position of collection id ``cid``, or -1 when the collection does not hold it."""
        return self.ids.find(cid) if isinstance(cid, str) else -1

    def at(self, position: int) -> PaperRecord:
        """The record at ``position`` (0 <= position < len).

        Raises:
            BackendError: its bytes are not the record written (the file changed after opening).
        """
        start, end = int(self._offsets[position]), int(self._offsets[position + 1])
        try:
            values = json.loads(self._blob[start:end])
            record = PaperRecord(**{name: _tuples(v) for name, v in zip(_FIELDS, values, strict=True)})
        except (ValueError, TypeError) as exc:
            raise BackendError(
                f"the stored collection at {self._path} is corrupt: record {position} cannot be read ({exc}); "
                f"its files changed after it was opened. Fix: delete {self._path} (it is rebuilt from the input files)"
            ) from None
        return record

    def __getitem__(self, cid: str) -> PaperRecord:
        position = self.position(cid)
        if position < 0:
            raise KeyError(cid)
        return self.at(position)

    def __contains__(self, cid: object) -> bool:
        return self.position(cid) >= 0

    def __iter__(self) -> Iterator[str]:
        return (self.ids.get(i) for i in range(len(self.ids)))

    def __len__(self) -> int:
        return len(self.ids)

    def values(self) -> ValuesView[PaperRecord]:
        return _Values(self)


class _Values(ValuesView[PaperRecord]):
    """Records in position order, each decoded once (no id look-up per record)."""

    def __init__(self, store: RecordStore) -> None:
        super().__init__(store)
        self._store = store

    def __iter__(self) -> Iterator[PaperRecord]:
        return (self._store.at(i) for i in range(len(self._store)))


class AliasMap(Mapping[str, str]):
    """Alias key -> collection id of a stored collection (memory-mapped; read-only, thread-safe)."""

    def __init__(self, path: Path, records: RecordStore) -> None:
        self._keys = StringTable(path, "aliases")
        self._targets = np.load(path / _TARGETS, mmap_mode="r")
        self._records = records
        if len(self._targets) != len(self._keys):
            raise ValueError(f"{path / _TARGETS}: {len(self._targets)} targets for {len(self._keys)} aliases")
        if len(self._targets) and not 0 <= int(self._targets.min()) <= int(self._targets.max()) < len(
            records
        ):
            raise ValueError(f"{path / _TARGETS}: a target outside the {len(records)} records")

    def __getitem__(self, key: str) -> str:
        position = self._keys.find(key) if isinstance(key, str) else -1
        if position < 0:
            raise KeyError(key)
        return self._records.ids.get(int(self._targets[position]))

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._keys.find(key) >= 0

    def __iter__(self) -> Iterator[str]:
        return (self._keys.get(i) for i in range(len(self._keys)))

    def __len__(self) -> int:
        return len(self._keys)


def open_collection(path: Path) -> Collection:
    """The collection stored under ``path`` by :func:`write_collection` (records read on access).

    Raises:
        OSError, ValueError, KeyError, TypeError: a file is missing or malformed (the caller checks
            sizes and checksums first and rebuilds on any of these).
    """
    records = RecordStore(path)
    aliases = AliasMap(path, records)
    meta = json.loads((path / _PAPERS).read_text(encoding="utf-8"))
    return Collection(
        records=records,
        papers=tuple(_decode_paper(p) for p in meta["papers"]),
        paper_ids=dict(meta["paper_ids"]),
        ref_ids={(paper, ref): cid for paper, ref, cid in meta["ref_ids"]},
        aliases=aliases,
        given=int(meta["given"]),
        given_linked=int(meta["given_linked"]),
        bib_linked=int(meta["bib_linked"]),
        full_text_records=int(meta["full_text_records"]),
    )
