"""The paper store behind ``toolgym/ArxivRefs-v0``: a fixed collection of papers and their references.

Each idea lives in its own module, and the package re-exports the public names:

- :mod:`toolgym.tools.papers.corpus`: the corpus input format (JSONL of unarXive / S2ORC-like
  records) and reading it into :class:`SourcePaper` values, with errors naming ``file:line``.
- :mod:`toolgym.tools.papers.ids`: normalised arXiv ids, DOIs, OpenAlex ids and titles.
- :mod:`toolgym.tools.papers.refs`: parsing raw bibliography strings into title, authors, year.
- :mod:`toolgym.tools.papers.markers`: the ``{{cite:…}}`` / ``{{formula:…}}`` markers in body text.
- :mod:`toolgym.tools.papers.records`: collection records (searchable papers that are not query
  papers: id, title, abstract, authors, date, venue, ids), read as given.
- :mod:`toolgym.tools.papers.collection`: the de-duplicated collection (merge rules, stable ids).
- :mod:`toolgym.tools.papers.copies`: near-duplicate detection (records that copy a paper's text).
- :mod:`toolgym.tools.papers.store`: a collection on disk, opened memory-mapped (records decoded on
  access), so a process that finds one stored skips building it.

``DEFAULT_CORPUS``, ``MARKER`` and ``ParsedReference`` are importable here too, outside ``__all__``.
"""

from __future__ import annotations

from toolgym.tools.papers.collection import Collection, PaperRecord, build_collection
from toolgym.tools.papers.copies import near_duplicates, shingles
from toolgym.tools.papers.corpus import DEFAULT_CORPUS as DEFAULT_CORPUS
from toolgym.tools.papers.corpus import (
    BibEntry,
    Paragraph,
    SourcePaper,
    default_corpus_path,
    load_papers,
)
from toolgym.tools.papers.ids import (
    normalise_arxiv_id,
    normalise_doi,
    normalise_openalex_id,
    normalise_title,
)
from toolgym.tools.papers.markers import MARKER as MARKER
from toolgym.tools.papers.markers import iter_citations, render_markers
from toolgym.tools.papers.records import CollectionRecord, load_records, parse_date
from toolgym.tools.papers.refs import ParsedReference as ParsedReference
from toolgym.tools.papers.refs import parse_reference
from toolgym.tools.papers.store import RecordStore, open_collection, write_collection

__all__ = [
    "BibEntry",
    "Collection",
    "CollectionRecord",
    "Paragraph",
    "PaperRecord",
    "RecordStore",
    "SourcePaper",
    "build_collection",
    "default_corpus_path",
    "iter_citations",
    "load_papers",
    "load_records",
    "near_duplicates",
    "normalise_arxiv_id",
    "normalise_doi",
    "normalise_openalex_id",
    "normalise_title",
    "open_collection",
    "parse_date",
    "parse_reference",
    "render_markers",
    "shingles",
    "write_collection",
]
