"""``toolgym/ArxivRefs-v0``: reconstruct the references of a paper's related-work section.

The agent sees a paper's related-work context with every citation replaced by ``[CITATION n]`` and
searches a fixed collection of papers to find what was cited. Tools: ``search_papers(query, k)``,
``read_paper(paper_id)`` and ``submit(paper_ids)`` (terminal). Reward: F1 of the submitted ids against
the gold collection ids (precision and recall logged; duplicates and unknown ids count against
precision and are logged as ``answer/duplicates`` and ``answer/unknown_ids``).

The parts, one module each (the package re-exports their public names):

- :mod:`toolgym.envs.arxiv_refs.env`: the environment, its shared collection and index, its tools.
- :mod:`toolgym.envs.arxiv_refs.data`: the context rule and task building (placeholders, gold ids,
  citations the collection cannot answer).
- :mod:`toolgym.envs.arxiv_refs.derive`: all of it from the two input files, and
  :mod:`toolgym.envs.arxiv_refs.cache`: the result stored by content hash, opened memory-mapped.
- :mod:`toolgym.envs.arxiv_refs.leakage`: the ids banned per task (the query paper, its copies, later
  papers) and the train/test split by query-paper group.
- :mod:`toolgym.envs.arxiv_refs.verifier`: the F1 verifier.
- :mod:`toolgym.envs.arxiv_refs.baseline`: the scripted BM25 baseline (``baseline_rule``).
- :mod:`toolgym.envs.arxiv_refs.audit`: its exploits for ``toolgym audit-env``.
- :mod:`toolgym.tools.papers`: the corpus format, the de-duplicated collection, near-duplicates.

Anti-leak on one shared index: ``search_papers`` over-fetches ``k`` plus the number of the task's
banned ids (at most the index's largest ``k``, :data:`toolgym.tools.search.index.MAX_K`) from the shared
index and drops banned hits, so it returns ``k`` allowed results without a per-task index;
``read_paper`` answers a banned id exactly like an unknown one. Bibliography-only records are shown
as parsed fields, never as the citing string; collection records (``collection=``) as given.

Decisions: collection ids are 10 hex digits (stable, copyable by a small model); the collection,
tasks and index are built once per configuration and cached on disk, and shared by the
environments of a process.
"""

from __future__ import annotations

from toolgym.envs.arxiv_refs.audit import audit_accepted, audit_exploits
from toolgym.envs.arxiv_refs.baseline import (
    MAX_QUERY_WORDS,
    BaselineResult,
    BM25BaselineRule,
    baseline_rule,
    bm25_baseline,
    placeholder_queries,
    reference_rule,
)
from toolgym.envs.arxiv_refs.data import (
    CONTEXT_END,
    CONTEXT_START,
    DEFAULT_FALLBACK,
    DEFAULT_MAX_TURNS,
    DEFAULT_SECTIONS,
    PROMPT,
    UNLINKED_MARK,
    UNLINKED_MODES,
    UNLINKED_NOTE,
    ContextRule,
    build_tasks,
)
from toolgym.envs.arxiv_refs.env import EXCERPT_CHARS, MAX_K, ArxivRefsEnv
from toolgym.envs.arxiv_refs.leakage import SPLIT_NAMESPACE, TEST_FRACTION, split_groups
from toolgym.envs.arxiv_refs.verifier import CitationF1Verifier
from toolgym.tools.papers.corpus import default_corpus_path, load_papers

__all__ = [
    "CONTEXT_END",
    "CONTEXT_START",
    "DEFAULT_FALLBACK",
    "DEFAULT_MAX_TURNS",
    "DEFAULT_SECTIONS",
    "EXCERPT_CHARS",
    "MAX_K",
    "MAX_QUERY_WORDS",
    "PROMPT",
    "SPLIT_NAMESPACE",
    "TEST_FRACTION",
    "UNLINKED_MARK",
    "UNLINKED_MODES",
    "UNLINKED_NOTE",
    "ArxivRefsEnv",
    "BM25BaselineRule",
    "BaselineResult",
    "CitationF1Verifier",
    "ContextRule",
    "audit_accepted",
    "audit_exploits",
    "baseline_rule",
    "bm25_baseline",
    "build_tasks",
    "default_corpus_path",
    "load_papers",
    "placeholder_queries",
    "reference_rule",
    "split_groups",
]
