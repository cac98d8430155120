"""The de-duplicated paper collection: every full paper and every bibliography entry, merged.

:func:`build_collection` de-duplicates full papers and bibliography entries across papers in this
order: shared arXiv id (versions and ``arXiv:`` prefixes ignored), then DOI, then OpenAlex id, then
normalised title (lower-case words, at least 3 of them). A later rule never merges two groups whose
ids of an earlier kind disagree (two different arXiv ids stay two papers, even with one title). Each
entry gets a stable collection id: the first 10 hex digits of the SHA-1 of its strongest key
(``arxiv:…``, ``doi:…``, ``openalex:…``, ``title:…``, or for an entry with none of them its source
paper and ref id), so ids do not depend on file order.

Bibliography-only entries keep their raw strings privately (``raw_refs``) and are *shown* only as
parsed fields (title, authors, year, ids, and the rest of the string as ``details``), never as the
citing paper's string verbatim.

Collection records (:mod:`toolgym.tools.papers.records`, papers that are searchable but not query
papers) join the same rules: a bibliography entry links to a record by a shared id, then by
normalised title. A record's given fields (title, authors, date, abstract, venue) are what its merged
entry shows, never a parse of a citing string; a full paper's own fields still come first. Its own
``id`` (when it has no arXiv id, DOI, OpenAlex id or title key, ``record:<id>``) keys the stable
collection id, and ``read_paper`` accepts it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from toolgym.errors import ConfigError
from toolgym.tools.papers.corpus import SourcePaper
from toolgym.tools.papers.ids import normalise_arxiv_id, normalise_doi, normalise_openalex_id, normalise_title
from toolgym.tools.papers.markers import render_markers
from toolgym.tools.papers.records import CollectionRecord
from toolgym.tools.papers.refs import parse_reference

__all__ = ["Collection", "PaperRecord", "UnionFind", "build_collection"]


@dataclass(frozen=True)
class PaperRecord:
    """One entry of the collection (a full paper, a bibliography entry, or both merged).

    ``date`` is ``(year, month, day)`` with 0 for an unknown month/day; ``raw_refs`` are the raw
    bibliography strings merged here (kept for matching, never shown to the agent). ``venue``,
    ``record_ids`` and ``other_ids`` come from collection records, as given.
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
    venue: str = ""
    record_ids: tuple[str, ...] = ()
    other_ids: tuple[tuple[str, str], ...] = ()

    def index_doc(self) -> dict[str, str]:
        """The ``{"id", "title", "text"}`` document for the search index."""
        parts = [
            ", ".join(self.authors),
            str(self.year or ""),
            self.venue,
            self.details,
            self.abstract,
            self.text,
        ]
        return {"id": self.id, "title": self.title or "", "text": "\n".join(p for p in parts if p)}

    def display_title(self) -> str:
        if self.title:
            return self.title
        return "(title unknown) " + (self.details[:80] + ("…" if len(self.details) > 80 else ""))


@dataclass(frozen=True)
class Collection:
    """The de-duplicated collection plus the links from source papers and their references to it.

    ``given`` counts the collection records read from a collection file; ``given_linked`` how many of
    them a bibliography entry links to, and ``bib_linked`` how many bibliography entries link to one.
    ``full_text_records`` is the number of records holding a full paper when known up front (a stored
    collection, :mod:`toolgym.tools.papers.store`, whose records are read on access); ``None``: counted.
    """

    records: Mapping[str, PaperRecord]
    papers: tuple[SourcePaper, ...]
    paper_ids: Mapping[str, str]
    ref_ids: Mapping[tuple[str, str], str]
    aliases: Mapping[str, str]
    given: int = 0
    given_linked: int = 0
    bib_linked: int = 0
    full_text_records: int | None = None

    def resolve(self, value: str) -> str | None:
        """The collection id for a collection id, arXiv id (any version/prefix), DOI, OpenAlex id or record id."""
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
        return self.aliases.get(f"record:{value}")

    def counts(self) -> dict[str, int]:
        full = self.full_text_records
        if full is None:
            full = sum(1 for r in self.records.values() if r.full_paper)
        bib_total = sum(len(p.bib) for p in self.papers)
        counts = {
            "papers": len(self.papers),
            "bib_entries": bib_total,
            "records": len(self.records),
            "full_text_records": full,
            "reference_only_records": len(self.records) - full,
            "merged_away": len(self.papers) + bib_total + self.given - len(self.records),
        }
        if self.given:
            counts |= {
                "collection_records": self.given,
                "collection_records_linked": self.given_linked,
                "bib_entries_linked_to_collection": self.bib_linked,
            }
        return counts


class UnionFind:
    """Union-find whose groups remember their ids, so merges across conflicting ids are refused.

    ``keys[i]`` holds item ``i``'s ids by kind; :meth:`union` refuses to merge two groups that both
    have ids of a ``guard`` kind and share none of them. With empty keys (or an empty guard) it is a
    plain union-find, as the ArxivRefs split grouping uses it.
    """

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


def build_collection(
    papers: Sequence[SourcePaper], given_records: Sequence[CollectionRecord] = ()
) -> Collection:
    """De-duplicate full papers, bibliography entries and collection records (rules: module docstring).

    Linear in the number of items: each rule is one pass over a dict of keys (union-find).
    """
    # ("paper", SourcePaper) | ("bib", (SourcePaper, BibEntry, ParsedReference)) | ("record", CollectionRecord)
    items: list[tuple[str, Any]] = []
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
    for given in given_records:
        k = {}
        for kind, value in (("arxiv", given.arxiv_id), ("doi", given.doi), ("openalex", given.openalex_id)):
            if value:
                k[kind] = {value}
        if t := normalise_title(given.title):
            k["title"] = {t}
        items.append(("record", given))
        keys.append(k)
    uf = UnionFind(keys)
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
    given_linked = bib_linked = 0
    for members in groups.values():
        record = _merge([items[i] for i in members], [keys[i] for i in members])
        if record.id in records:
            raise ConfigError(f"collection id collision for {record.id}; report this corpus as a bug")
        records[record.id] = record
        for i in members:
            kind, payload = items[i]
            if kind == "paper":
                paper_ids[payload.paper_id] = record.id
            elif kind == "bib":
                ref_ids[(payload[0].paper_id, payload[1].ref_id)] = record.id
        if record.record_ids and len(record.raw_refs):
            given_linked += len(record.record_ids)
            bib_linked += len(record.raw_refs)
        for value in record.record_ids:
            aliases[f"record:{value}"] = record.id
        for value in record.arxiv_ids:
            aliases[f"arxiv:{value}"] = record.id
        for value in record.dois:
            aliases[f"doi:{value}"] = record.id
        for value in record.openalex_ids:
            aliases[f"openalex:{value}"] = record.id
    ordered = dict(sorted(records.items()))
    return Collection(
        records=ordered,
        papers=tuple(papers),
        paper_ids=paper_ids,
        ref_ids=ref_ids,
        aliases=aliases,
        given=len(given_records),
        given_linked=given_linked,
        bib_linked=bib_linked,
    )


def _merge(members: list[tuple[str, Any]], keys: list[dict[str, set[str]]]) -> PaperRecord:
    merged: dict[str, set[str]] = {}
    for k in keys:
        for kind, values in k.items():
            merged.setdefault(kind, set()).update(values)
    full = sorted((p for kind, p in members if kind == "paper"), key=lambda p: p.paper_id)
    bibs = sorted((b for kind, b in members if kind == "bib"), key=lambda b: (b[0].paper_id, b[1].ref_id))
    given: list[CollectionRecord] = sorted(
        (r for kind, r in members if kind == "record"), key=lambda r: r.record_id
    )
    for kind in ("arxiv", "doi", "openalex", "title"):
        if merged.get(kind):
            strongest = f"{kind}:{sorted(merged[kind])[0]}"
            break
    else:
        if given and not full:
            strongest = f"record:{given[0].record_id}"
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
    elif given:
        # Shown as given: the record's own fields, never a parse of a citing string.
        first = given[0]
        title, authors, abstract, details, body = first.title, first.authors, first.abstract, "", ""
        date = first.date or next((d for d in dates if d), None)
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
        venue=next((r.venue for r in given if r.venue), ""),
        record_ids=tuple(r.record_id for r in given),
        other_ids=tuple(sorted({pair for r in given for pair in r.other_ids})),
    )
