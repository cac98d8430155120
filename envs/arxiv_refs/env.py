"""``ArxivRefsEnv``: the environment, its shared collection and index, and its three tools."""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from toolgym.core import FunctionTool, Task, Tool
from toolgym.env import ToolEnv
from toolgym.envs.arxiv_refs.cache import CacheSettings, cache_key, load_or_build
from toolgym.envs.arxiv_refs.data import (
    DEFAULT_FALLBACK,
    DEFAULT_MAX_TURNS,
    DEFAULT_SECTIONS,
    ContextRule,
)
from toolgym.envs.arxiv_refs.verifier import CitationF1Verifier
from toolgym.errors import ConfigError, ToolCallError
from toolgym.splits import check_split, select_split
from toolgym.tool_use import ToolUse, search_measures
from toolgym.tools.papers.collection import Collection, PaperRecord
from toolgym.tools.papers.corpus import default_corpus_path
from toolgym.tools.search.index import cache_dir
from toolgym.tools.search.retriever import RetrieverSettings, open_retriever

__all__ = ["EXCERPT_CHARS", "MAX_K", "ArxivRefsEnv"]

MAX_K = 20
EXCERPT_CHARS = 1_500


@dataclass
class _Shared:
    collection: Collection
    tasks: list[Task]
    stats: dict[str, int]
    banned: Mapping[str, AbstractSet[str]]
    index: Any
    lock: threading.Lock = field(default_factory=threading.Lock)


_SHARED: dict[tuple[str, Any], _Shared] = {}
_SHARED_LOCK = threading.Lock()


def _shared(
    corpus: Path,
    collection_path: Path | None,
    backend: str,
    rule: ContextRule,
    date_filter: bool,
    threshold: float,
    unlinked: str = "mark",
) -> _Shared:
    """One environment's data per configuration and cache directory per process, from its on-disk cache
    (:mod:`toolgym.envs.arxiv_refs.cache`: built there on first use, keyed by the inputs' content). A
    process that moves ``TOOLGYM_CACHE`` gets the data of the new place, never an index whose files
    lived in the old one (and may be gone)."""
    settings = CacheSettings(rule, date_filter, threshold, unlinked, backend)
    root = str(cache_dir())
    key = (root, cache_key(corpus, collection_path, settings))
    with _SHARED_LOCK:
        if key in _SHARED:
            return _SHARED[key]
        derived = load_or_build(corpus, collection_path, settings)  # its key: the files as read now
        if (root, derived.key) not in _SHARED:
            shared = _Shared(derived.collection, derived.tasks, derived.stats, derived.banned, derived.index)
            _SHARED[(root, derived.key)] = shared
        return _SHARED[(root, derived.key)]


_RETRIEVERS: dict[tuple[int, RetrieverSettings], Any] = {}


def _retriever(shared: _Shared, settings: RetrieverSettings) -> Any:
    """The search index of a dense or hybrid retriever over ``shared``'s collection (one per process)."""
    key = (id(shared), settings)
    with _SHARED_LOCK:
        if key not in _RETRIEVERS:
            records = shared.collection.records
            _RETRIEVERS[key] = open_retriever(lambda: (r.index_doc() for r in records.values()), settings)
        return _RETRIEVERS[key]


#: How search_papers' description names its ranking, per retriever (v0's bm25 text is unchanged).
_RANKING = {
    "bm25": "BM25",
    "dense": "dense retrieval",
    "hybrid": "BM25 and dense retrieval fused",
    "random": "BM25",  # a control the model is not told about: the prompt stays the real retriever's
}


# ----------------------------------------------------------------------------- environment


#: A paper id as a search result line starts with it (:func:`_render_hit`).
_SHOWN_ID = re.compile(r"^\[([^\]\n]+)\]", re.MULTILINE)


def _render_hit(record: PaperRecord) -> str:
    authors = ", ".join(record.authors[:3]) + (" et al." if len(record.authors) > 3 else "")
    return (
        f"[{record.id}] {record.display_title()} — {authors or 'authors unknown'} ({record.year or 'n.d.'})"
    )


def _render_paper(record: PaperRecord) -> str:
    lines = [f"id: {record.id}", f"title: {record.title or '(unknown)'}"]
    lines.append(f"authors: {'; '.join(record.authors) if record.authors else '(unknown)'}")
    lines.append(f"year: {record.year or '(unknown)'}")
    if record.arxiv_ids:
        lines.append(f"arXiv: {', '.join(record.arxiv_ids)}")
    if record.dois:
        lines.append(f"DOI: {', '.join(record.dois)}")
    if record.openalex_ids:
        lines.append(f"OpenAlex: {', '.join(record.openalex_ids)}")
    lines += [f"{kind}: {value}" for kind, value in record.other_ids]
    if record.venue:
        lines.append(f"venue: {record.venue}")
    if record.details:
        lines.append(f"reference details: {record.details}")
    if record.abstract:
        lines.append(f"abstract: {record.abstract}")
    if record.text:
        excerpt = record.text[:EXCERPT_CHARS] + ("…" if len(record.text) > EXCERPT_CHARS else "")
        lines.append(f"text excerpt: {excerpt}")
    return "\n".join(lines)


class ArxivRefsEnv(ToolEnv):
    """Citation reconstruction over a fixed paper collection (see the module docstring).

    Args:
        corpus: a JSONL(.gz) corpus in the format of :mod:`toolgym.tools.papers.corpus`; default: the
            packaged unarXive sample (49 papers).
        collection: optional JSONL(.gz) of collection records (papers to search that are not query
            papers: id, title, abstract, authors, year/date, venue, ids), format of
            :mod:`toolgym.tools.papers.records`; linked to bibliography entries by id, then title.
        backend: search backend for :func:`toolgym.tools.search.index_build.build_index`.
        retriever: ``"bm25"`` (default), ``"dense"`` or ``"hybrid"`` (see
            :mod:`toolgym.tools.search.retriever`); encoder, query_prefix, passage_prefix: the dense
            encoder's directory (default: the shipped all-MiniLM-L6-v2) and prefixes.
        sections, fallback_sections, max_context_chars: the context rule (:class:`ContextRule`).
        date_filter: hide records dated after the query paper.
        near_duplicate_threshold: n-gram overlap at which a record counts as a copy of the query.
        unlinked: how a citation without a record in the collection is shown: ``"mark"`` (default:
            ``[CITATION n: not in the collection]``, with a line above the context saying what it
            means), ``"omit"`` (left out of the context) or ``"plain"`` (an ordinary placeholder); never
            gold (see :mod:`toolgym.envs.arxiv_refs.data`).
        max_turns: assistant turns before truncation.
        split: ``"train"``, ``"test"`` or ``"all"`` (default: every task);
            by query paper, see :mod:`toolgym.envs.arxiv_refs.leakage`. The collection and index are the same
            in every split.

    Everything derived from ``corpus`` and ``collection`` is cached on disk by content hash and
    shared by the environments of a process (:mod:`toolgym.envs.arxiv_refs.cache`).
    """

    description = (
        "Reconstruct a paper's related-work citations with search_papers/read_paper over a fixed collection."
    )

    def __init__(
        self,
        corpus: str | Path | None = None,
        *,
        collection: str | Path | None = None,
        backend: str = "default",
        retriever: str = "bm25",
        encoder: str | Path | None = None,
        query_prefix: str | None = None,
        passage_prefix: str | None = None,
        sections: str = DEFAULT_SECTIONS,
        fallback_sections: str = DEFAULT_FALLBACK,
        max_context_chars: int = 6_000,
        date_filter: bool = True,
        near_duplicate_threshold: float = 0.3,
        unlinked: str = "mark",
        max_turns: int = DEFAULT_MAX_TURNS,
        split: str = "all",
        render_mode: str | None = None,
    ) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        check_split(split)
        if not 0.0 < near_duplicate_threshold <= 1.0:
            raise ConfigError(f"near_duplicate_threshold must be in (0, 1], got {near_duplicate_threshold}")
        rule = ContextRule(sections, fallback_sections, max_context_chars)
        path = Path(corpus) if corpus is not None else default_corpus_path()
        if not path.is_file():
            raise ConfigError(
                f"{path}: no such corpus file (JSONL in the unarXive format, see environments.md)"
            )
        records = Path(collection) if collection is not None else None
        if records is not None and not records.is_file():
            raise ConfigError(
                f"{records}: no such collection file (JSONL, one record per line; see environments.md)"
            )
        self._shared = _shared(path, records, backend, rule, date_filter, near_duplicate_threshold, unlinked)
        self.collection = self._shared.collection
        self.retriever = RetrieverSettings.from_args(
            retriever, backend, encoder, query_prefix, passage_prefix
        )
        self._index = self._shared.index if retriever == "bm25" else _retriever(self._shared, self.retriever)
        self.selection = select_split(self._shared.tasks, split)
        self.split = split
        self.tasks = list(self.selection.tasks)
        self.verifier: CitationF1Verifier = CitationF1Verifier(self.collection)

    @property
    def stats(self) -> dict[str, int]:
        """Collection counts and citation-linking counts of this configuration."""
        return {**self.collection.counts(), **self._shared.stats, "tasks": len(self.tasks)}

    def provenance(self) -> dict[str, Any]:
        """The collection's search index and how many ids the leak rules ban (for run manifests)."""
        return {"index": self._index.provenance, "banned": sum(map(len, self._shared.banned.values()))}

    def _choose_task(self, options: dict[str, Any]) -> Task:
        self.selection.check_options(options)  # a task id of the other split: say so
        return super()._choose_task(options)

    def banned_for(self, task: Task) -> AbstractSet[str]:
        """Collection ids the tools of ``task`` never return."""
        return self._shared.banned[task.metadata["paper_id"]]

    def search(self, task: Task, query: str, k: int) -> list[PaperRecord]:
        """The ``k`` best allowed records for ``query`` (over-fetch by the number of banned ids, then drop them)."""
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
            raise ToolCallError(f"k must be an integer from 1 to {MAX_K}, got {k!r}")
        from toolgym.tools.search.index import MAX_K as INDEX_MAX_K

        banned = self.banned_for(task)
        # NOTE: k + |banned| hits always hold k allowed ones; the index answers at most INDEX_MAX_K, so a
        # task with more banned ids than that gets fewer than k only if nearly all its top hits are banned.
        fetch = min(k + len(banned), len(self.collection.records), INDEX_MAX_K)
        with self._shared.lock:
            hits = self._index.search(query, fetch)
        allowed = [h.doc_id for h in hits if h.doc_id not in banned][:k]
        return [self.collection.records[cid] for cid in allowed]

    def read(self, task: Task, paper_id: str) -> PaperRecord:
        cid = self.collection.resolve(paper_id)
        if cid is None or cid in self.banned_for(task):
            raise ToolCallError(
                f"no paper {paper_id!r} in the collection; use an id from search_papers results"
            )
        return self.collection.records[cid]

    def tool_use_metrics(self, task: Task, calls: Sequence[ToolUse], answer: Any) -> dict[str, float]:
        """The shared search measures (no question to compare queries with: the task is a whole text),
        papers read (``use/opened``), whether a search showed a gold paper (``use/answer_shown``) and the
        share of the submitted ids a search had shown (``use/answer_in_results``)."""
        out = search_measures(calls, search="search_papers", opened=("read_paper",))
        resolve = self.collection.resolve
        shown = {
            resolve(pid) for c in calls if c.name == "search_papers" for pid in _SHOWN_ID.findall(c.output)
        } - {None}
        gold = {resolve(str(g)) for g in task.reference or ()} - {None}
        out["use/answer_shown"] = float(bool(gold & shown))
        if isinstance(answer, list | tuple) and answer:
            given = [resolve(str(a)) for a in answer]
            out["use/answer_in_results"] = sum(g in shown for g in given if g is not None) / len(given)
        return out

    async def episode_tools(self, task: Task) -> Sequence[Tool]:
        def search_papers(query: str, k: int = 5) -> str:
            """Search the paper collection (BM25 over titles, authors, reference details and text).
            Returns lines '[paper_id] title — authors (year)', best first.

            Args:
                query: words to search for
                k: number of results
            """
            records = self.search(task, query, k)
            if not records:
                return "No papers match this query."
            return "\n".join(_render_hit(r) for r in records)

        def read_paper(paper_id: str) -> str:
            """Read one paper of the collection: title, authors, year, ids, and abstract or text excerpt.

            Args:
                paper_id: an id from search_papers
            """
            return _render_paper(self.read(task, paper_id))

        def submit(paper_ids: list[str]) -> str:
            """Submit the ids of all papers cited in the text; this ends the episode.

            Args:
                paper_ids: cited paper ids
            """
            return " ".join(paper_ids)  # a terminal tool's function is its signature: never run

        # NOTE: v0's search_papers schema states k's range and not its default (the prompt is part of
        # the environment's version).
        k_range = {"k": {"minimum": 1, "maximum": MAX_K}}
        search_tool = FunctionTool.from_function(search_papers, constraints=k_range, show_defaults=False)
        ranking = _RANKING[self.retriever.retriever]
        search_tool = replace(
            search_tool, description=search_tool.description.replace("(BM25 over", f"({ranking} over")
        )
        return [
            search_tool,
            FunctionTool.from_function(read_paper),
            FunctionTool.from_function(submit, terminal=True),
        ]
