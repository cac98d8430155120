"""The paper store behind ``toolgym/ArxivRefs-v0``: one import point for its parts.

Each idea lives in its own module; every name is re-exported here, so
``from toolgym.tools.papers import X`` keeps working:

- :mod:`toolgym.tools.paper_corpus`: the corpus input format (JSONL of unarXive / S2ORC-like
  records) and reading it into :class:`SourcePaper` values, with errors naming ``file:line``.
- :mod:`toolgym.tools.paper_ids`: normalised arXiv ids, DOIs, OpenAlex ids and titles.
- :mod:`toolgym.tools.paper_refs`: parsing raw bibliography strings into title, authors, year.
- :mod:`toolgym.tools.paper_markers`: the ``{{cite:…}}`` / ``{{formula:…}}`` markers in body text.
- :mod:`toolgym.tools.paper_records`: collection records (searchable papers that are not query
  papers: id, title, abstract, authors, date, venue, ids), read as given.
- :mod:`toolgym.tools.paper_collection`: the de-duplicated collection (merge rules, stable ids).
- :mod:`toolgym.tools.paper_copies`: near-duplicate detection (records that copy a paper's text).

``DEFAULT_CORPUS``, ``MARKER`` and ``ParsedReference`` stay importable here too (``X as X`` imports),
though outside ``__all__`` as before.
"""

from __future__ import annotations

from toolgym.tools.paper_collection import Collection, PaperRecord, build_collection
from toolgym.tools.paper_copies import near_duplicates, shingles
from toolgym.tools.paper_corpus import DEFAULT_CORPUS as DEFAULT_CORPUS
from toolgym.tools.paper_corpus import (
    BibEntry,
    Paragraph,
    SourcePaper,
    default_corpus_path,
    load_papers,
)
from toolgym.tools.paper_ids import (
    normalise_arxiv_id,
    normalise_doi,
    normalise_openalex_id,
    normalise_title,
)
from toolgym.tools.paper_markers import MARKER as MARKER
from toolgym.tools.paper_markers import iter_citations, render_markers
from toolgym.tools.paper_records import CollectionRecord, load_records, parse_date
from toolgym.tools.paper_refs import ParsedReference as ParsedReference
from toolgym.tools.paper_refs import parse_reference

__all__ = [
    "BibEntry",
    "Collection",
    "CollectionRecord",
    "Paragraph",
    "PaperRecord",
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
    "parse_date",
    "parse_reference",
    "render_markers",
    "shingles",
]
