"""``toolgym/ArxivRefs-v0``: reconstruct the references of a paper's related-work section.

The agent sees a paper's related-work context with every citation replaced by ``[CITATION n]`` and
searches a fixed collection of papers to find what was cited. Tools: ``search_papers(query, k)``,
``read_paper(paper_id)`` and ``submit(paper_ids)`` (terminal). Reward: F1 of the submitted ids against
the gold collection ids (precision and recall logged; duplicates and unknown ids count against
precision and are logged as ``answer/duplicates`` and ``answer/unknown_ids``).

Context rule (configurable): paragraphs whose section name matches ``sections`` (related work,
background, prior/previous work, literature, state of the art), in document order; when none match or
they hold no citation, the ``fallback_sections`` (introduction, motivation); paragraphs are kept up to
``max_context_chars`` (at least one). A paper with no citation in its context gives no task.
Placeholders are numbered by first appearance of each distinct reference, so a reference cited twice
keeps its number. Formulas render as ``$latex$`` (long ones as ``[FORMULA]``), figures and tables as
``[FIGURE]``/``[TABLE]``.

Anti-leak (per task, on one shared index): the query paper's collection id (which every version, id
form and citing bibliography entry of it was merged into) is banned; so are records whose text copies
the query's (:func:`toolgym.tools.papers.near_duplicates`) and, with ``date_filter``, records dated
after the query paper (compared at the precision both dates know). ``search_papers`` over-fetches
``k`` plus the number of banned ids from the shared index and drops banned hits, so it still returns
``k`` allowed results without a per-task index; ``read_paper`` answers a banned id exactly like an
unknown one. Bibliography-only records are shown as parsed fields, never as the citing string.

Splits (``split="train" | "test" | "all"``, default ``"all"``, the behaviour before splits existed):
by query paper. Query papers are grouped when they are one collection record (versions of a paper)
or when one copies the other's text (the near-duplicate rule above), so a paper and its copy never
straddle the line; a group goes to ``test`` by the hash rule of :mod:`toolgym.splits` (namespace
``ArxivRefs``, key ``paper:<smallest collection id of the group>``, test fraction
:data:`TEST_FRACTION`), unless a corpus record carries its own ``"split"``. The collection and index
stay whole in every split: they are the world the agent searches, not the tasks. Default data: 27
train / 13 test tasks (49 groups of one paper each: no two sample papers copy each other).

Decisions: collection ids are 10 hex digits (stable, copyable by a small model); the collection,
tasks and index are built once per configuration per process.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolgym.core import Completion, FunctionTool, Message, SamplingParams, Score, Task, Tool
from toolgym.env import ToolEnv
from toolgym.errors import ConfigError, ToolCallError
from toolgym.parsing import format_tool_call
from toolgym.splits import SplitItem, assign_splits, check_split, label_tasks, select_split
from toolgym.tools.papers import (
    Collection,
    PaperRecord,
    SourcePaper,
    build_collection,
    default_corpus_path,
    iter_citations,
    load_papers,
    near_duplicates,
    render_markers,
)

__all__ = [
    "DEFAULT_FALLBACK",
    "DEFAULT_SECTIONS",
    "ArxivRefsEnv",
    "BM25BaselinePolicy",
    "BM25BaselineRule",
    "BaselineResult",
    "CitationF1Verifier",
    "ContextRule",
    "bm25_baseline",
    "build_tasks",
    "placeholder_queries",
    "split_groups",
]

DEFAULT_SECTIONS = (
    r"related\s+works?|background|prior\s+work|previous\s+work|literature|state\s+of\s+the\s+art"
)
DEFAULT_FALLBACK = r"introduction|motivation"
DEFAULT_MAX_TURNS = 16
MAX_K = 20
EXCERPT_CHARS = 1_500
#: Share of query-paper groups the hash rule puts in the test split (the same as SearchQA's; on the 40
#: default tasks it gives 27 train / 13 test: enough test tasks to report a mean on).
TEST_FRACTION = 0.25
#: Namespace of the split hash (see :mod:`toolgym.splits`).
SPLIT_NAMESPACE = "ArxivRefs"
#: Longest baseline query (words): keeps each search call short enough for a small token budget.
MAX_QUERY_WORDS = 32
CONTEXT_START, CONTEXT_END = "<<<CONTEXT", "CONTEXT>>>"
PROMPT = (
    'Below is the {where} of the paper "{title}". Every citation was replaced by a placeholder '
    "[CITATION n]; the same number means the same reference.\n"
    "Find the cited papers in the collection with search_papers and read_paper, then call submit with "
    "the list of their paper ids (all placeholders at once).\n"
    f"{CONTEXT_START}\n{{context}}\n{CONTEXT_END}"
)


# ----------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class ContextRule:
    """Which paragraphs form a task's context (regexes match section names, case-insensitively)."""

    sections: str = DEFAULT_SECTIONS
    fallback_sections: str = DEFAULT_FALLBACK
    max_context_chars: int = 6_000

    def __post_init__(self) -> None:
        for name in ("sections", "fallback_sections"):
            try:
                re.compile(getattr(self, name))
            except re.error as exc:
                raise ConfigError(
                    f"{name} must be a regular expression, got {getattr(self, name)!r} ({exc})"
                ) from None
        if self.max_context_chars < 1:
            raise ConfigError(f"max_context_chars must be >= 1, got {self.max_context_chars}")


def _context(paper: SourcePaper, rule: ContextRule) -> tuple[str, list[str]]:
    """(``where`` label, raw paragraphs) of the context, or ("", []) when the paper has none."""
    for label, pattern in (
        ("related-work context", rule.sections),
        ("introduction (fallback)", rule.fallback_sections),
    ):
        chosen = [p for p in paper.paragraphs if re.search(pattern, p.section, re.IGNORECASE)]
        if any(True for p in chosen for _ in iter_citations(p.text)):
            kept, size = [], 0
            for p in chosen:
                if kept and size + len(p.text) > rule.max_context_chars:
                    break
                kept.append(p.text)
                size += len(p.text)
            return label, kept
    return "", []


def build_tasks(
    collection: Collection, rule: ContextRule, banned: dict[str, set[str]]
) -> tuple[list[Task], dict[str, int]]:
    """One task per paper with a cited context; returns the tasks and linking statistics.

    Gold = collection ids of the references cited in the shown context that the task's tools can
    reach; cited references banned for the task (dated later than the paper) are listed in
    ``metadata["gold_unreachable"]`` instead. A marker whose ref id has no bibliography entry is
    still a placeholder but links to nothing (counted as ``markers_unlinked``).
    """
    tasks, stats = [], {"markers": 0, "markers_linked": 0, "markers_unlinked": 0, "gold_unreachable": 0}
    for paper in collection.papers:
        where, paragraphs = _context(paper, rule)
        if not paragraphs:
            continue
        numbers: dict[str, int] = {}
        gold: dict[str, None] = {}
        rendered = []
        for text in paragraphs:
            pieces, pos = [], 0
            for start, end, ref_id in iter_citations(text):
                stats["markers"] += 1
                cid = collection.ref_ids.get((paper.paper_id, ref_id))
                if cid is None:
                    stats["markers_unlinked"] += 1
                else:
                    stats["markers_linked"] += 1
                    gold[cid] = None
                number = numbers.setdefault(ref_id, len(numbers) + 1)
                pieces += [text[pos:start], f"[CITATION {number}]"]
                pos = end
            pieces.append(text[pos:])
            rendered.append(render_markers("".join(pieces), paper.formulas))
        ban = banned[paper.paper_id]
        reachable = sorted(c for c in gold if c not in ban)
        unreachable = sorted(c for c in gold if c in ban)
        stats["gold_unreachable"] += len(unreachable)
        if not reachable:
            continue
        prompt = PROMPT.format(
            where=where, title=paper.title or paper.paper_id, context="\n\n".join(rendered)
        )
        meta = {
            "paper_id": paper.paper_id,
            "title": paper.title,
            "context": where,
            "placeholders": len(numbers),
            "gold_unreachable": unreachable,
        }
        tasks.append(Task(id=f"arxiv-{paper.paper_id}", prompt=prompt, reference=reachable, metadata=meta))
    return tasks, stats


def _later(date: tuple[int, int, int] | None, limit: tuple[int, int, int] | None) -> bool:
    """True when ``date`` is after ``limit`` at the precision both know (0 = unknown month/day)."""
    if date is None or limit is None:
        return False
    for a, b in zip(date, limit, strict=True):
        if a == 0 or b == 0:
            return False
        if a != b:
            return a > b
    return False


def banned_ids(
    collection: Collection,
    *,
    date_filter: bool,
    near_duplicate_threshold: float,
    dups: dict[str, set[str]] | None = None,
) -> dict[str, set[str]]:
    """Per source paper: its own id, its near-duplicates and (optionally) records dated after it.

    ``dups`` is :func:`~toolgym.tools.papers.near_duplicates` at the threshold, when already computed.
    """
    if dups is None:
        dups = near_duplicates(collection, threshold=near_duplicate_threshold)
    out = {}
    for paper in collection.papers:
        ban = {collection.paper_ids[paper.paper_id]} | dups[paper.paper_id]
        if date_filter:
            ban |= {r.id for r in collection.records.values() if _later(r.date, paper.date)}
        out[paper.paper_id] = ban
    return out


def split_groups(collection: Collection, dups: dict[str, set[str]]) -> dict[str, str]:
    """Per source paper id, its split grouping key: ``paper:<smallest collection id of its group>``.

    Source papers share a group when they map to one collection record, or when one's record is a
    near-duplicate (``dups``, per source paper) of the other: leakage happens between a paper and its
    copy just as within one paper.
    """
    parent = {p.paper_id: p.paper_id for p in collection.papers}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    by_record: dict[str, list[str]] = {}
    for paper in collection.papers:
        by_record.setdefault(collection.paper_ids[paper.paper_id], []).append(paper.paper_id)
    for paper in collection.papers:
        linked = [collection.paper_ids[paper.paper_id], *sorted(dups.get(paper.paper_id, ()))]
        for cid in linked:
            for other in by_record.get(cid, ()):
                a, b = find(paper.paper_id), find(other)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    smallest: dict[str, str] = {}
    for paper in collection.papers:
        root, cid = find(paper.paper_id), collection.paper_ids[paper.paper_id]
        smallest[root] = min(smallest.get(root, cid), cid)
    return {p.paper_id: f"paper:{smallest[find(p.paper_id)]}" for p in collection.papers}


def label_splits(collection: Collection, tasks: list[Task], dups: dict[str, set[str]]) -> list[Task]:
    """``tasks`` with ``metadata["split"]`` set by query-paper group (see the module docstring).

    Every source paper takes part, even one without a task, so that its own ``split`` field still
    binds the papers it is grouped with.

    Raises:
        ConfigError: papers of one group carry different ``split`` fields.
    """
    keys = split_groups(collection, dups)
    items = [SplitItem(keys[p.paper_id], p.split, p.where) for p in collection.papers]
    labels = assign_splits(items, namespace=SPLIT_NAMESPACE, test_fraction=TEST_FRACTION)
    of_paper = {p.paper_id: label for p, label in zip(collection.papers, labels, strict=True)}
    return label_tasks(tasks, [of_paper[t.metadata["paper_id"]] for t in tasks])


# ----------------------------------------------------------------------------- verifier


class CitationF1Verifier:
    """F1 of the submitted ids against ``task.reference`` (a list of gold collection ids).

    Submitted strings are resolved through the collection (a collection id, or an arXiv id / DOI /
    OpenAlex id of a record). Precision divides by *everything* submitted, so duplicates (the same
    record twice, in any id form) and unknown ids lower it. A string answer (an ``<answer>`` tag or a
    plain-text turn) is split on commas and whitespace. A task without gold ids is a data bug: raises.
    """

    def __init__(self, collection: Collection) -> None:
        self.collection = collection

    def score(self, task: Task, answer: Any, trajectory: Sequence[Message]) -> Score:
        gold = task.reference
        if not isinstance(gold, list | tuple) or not gold or not all(isinstance(g, str) for g in gold):
            raise ValueError(f"task {task.id!r} has no gold ids (reference={gold!r}); fix the data")
        if isinstance(answer, str):
            answer = [a for a in re.split(r"[,\s]+", answer) if a]
        invalid = not isinstance(answer, list | tuple) or not all(isinstance(a, str) for a in answer)
        submitted = [] if invalid else list(answer)
        seen: set[str] = set()
        correct = duplicates = unknown = 0
        for value in submitted:
            cid = self.collection.resolve(value)
            if cid is None:
                unknown += 1
            elif cid in seen:
                duplicates += 1
            else:
                seen.add(cid)
                correct += cid in set(gold)
        precision = correct / len(submitted) if submitted else 0.0
        recall = correct / len(set(gold))
        f1 = 2 * precision * recall / (precision + recall) if correct else 0.0
        metrics = {
            "reward/f1": f1,
            "reward/precision": precision,
            "reward/recall": recall,
            "answer/duplicates": float(duplicates),
            "answer/unknown_ids": float(unknown),
            "answer/submitted": float(len(submitted)),
            "answer/invalid": float(invalid),
        }
        return Score(f1, metrics)


# ----------------------------------------------------------------------------- shared state


@dataclass
class _Shared:
    collection: Collection
    tasks: list[Task]
    stats: dict[str, int]
    banned: dict[str, set[str]]
    index: Any
    lock: threading.Lock = field(default_factory=threading.Lock)


_SHARED: dict[tuple[Any, ...], _Shared] = {}
_SHARED_LOCK = threading.Lock()


def _shared(corpus: Path, backend: str, rule: ContextRule, date_filter: bool, threshold: float) -> _Shared:
    key = (str(corpus.resolve()), corpus.stat().st_mtime_ns, backend, rule, date_filter, threshold)
    with _SHARED_LOCK:
        if key not in _SHARED:
            from toolgym.tools.index import build_index

            collection = build_collection(load_papers(corpus))
            dups = near_duplicates(collection, threshold=threshold)
            banned = banned_ids(
                collection, date_filter=date_filter, near_duplicate_threshold=threshold, dups=dups
            )
            tasks, stats = build_tasks(collection, rule, banned)
            if not tasks:
                raise ConfigError(f"{corpus}: no paper has a cited context under the section rule {rule}")
            tasks = label_splits(collection, tasks, dups)
            index = build_index((r.index_doc() for r in collection.records.values()), backend=backend)
            _SHARED[key] = _Shared(collection, tasks, stats, banned, index)
        return _SHARED[key]


# ----------------------------------------------------------------------------- environment


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
        corpus: a JSONL(.gz) corpus in the format of :mod:`toolgym.tools.papers`; default: the packaged
            unarXive sample (49 papers).
        backend: search backend for :func:`toolgym.tools.index.build_index`.
        sections, fallback_sections, max_context_chars: the context rule (:class:`ContextRule`).
        date_filter: hide records dated after the query paper.
        near_duplicate_threshold: n-gram overlap at which a record counts as a copy of the query.
        max_turns: assistant turns before truncation.
        split: ``"train"``, ``"test"`` or ``"all"`` (default, the behaviour before splits existed);
            by query paper, see the module docstring. The collection and index are the same in every
            split.
    """

    description = (
        "Reconstruct a paper's related-work citations with search_papers/read_paper over a fixed collection."
    )

    def __init__(
        self,
        corpus: str | Path | None = None,
        *,
        backend: str = "default",
        sections: str = DEFAULT_SECTIONS,
        fallback_sections: str = DEFAULT_FALLBACK,
        max_context_chars: int = 6_000,
        date_filter: bool = True,
        near_duplicate_threshold: float = 0.3,
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
        self._shared = _shared(path, backend, rule, date_filter, near_duplicate_threshold)
        self.collection = self._shared.collection
        self.selection = select_split(self._shared.tasks, split)
        self.split = split
        self.tasks = list(self.selection.tasks)
        self.verifier = CitationF1Verifier(self.collection)

    @property
    def stats(self) -> dict[str, int]:
        """Collection counts and citation-linking counts of this configuration."""
        return {**self.collection.counts(), **self._shared.stats, "tasks": len(self.tasks)}

    def _choose_task(self, options: dict[str, Any]) -> Task:
        self.selection.check_options(options)  # a task id of the other split: say so
        return super()._choose_task(options)

    def banned_for(self, task: Task) -> set[str]:
        """Collection ids the tools of ``task`` never return."""
        return self._shared.banned[task.metadata["paper_id"]]

    def search(self, task: Task, query: str, k: int) -> list[PaperRecord]:
        """The ``k`` best allowed records for ``query`` (over-fetch by the number of banned ids, then drop them)."""
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
            raise ToolCallError(f"k must be an integer from 1 to {MAX_K}, got {k!r}")
        banned = self.banned_for(task)
        fetch = min(k + len(banned), len(self.collection.records))
        with self._shared.lock:
            hits = self._shared.index.search(query, fetch)
        records = [self.collection.records[h.doc_id] for h in hits if h.doc_id not in banned]
        return records[:k]

    def read(self, task: Task, paper_id: str) -> PaperRecord:
        cid = self.collection.resolve(paper_id)
        if cid is None or cid in self.banned_for(task):
            raise ToolCallError(
                f"no paper {paper_id!r} in the collection; use an id from search_papers results"
            )
        return self.collection.records[cid]

    async def episode_tools(self, task: Task) -> Sequence[Tool]:
        def search_papers(query: str, k: int = 5) -> str:
            records = self.search(task, query, k)
            if not records:
                return "No papers match this query."
            return "\n".join(_render_hit(r) for r in records)

        def read_paper(paper_id: str) -> str:
            return _render_paper(self.read(task, paper_id))

        return [
            FunctionTool(
                "search_papers",
                "Search the paper collection (BM25 over titles, authors, reference details and text). "
                "Returns lines '[paper_id] title — authors (year)', best first.",
                {
                    "type": "object",
                    "properties": {
                        "query": {"type": "string", "description": "words to search for"},
                        "k": {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": MAX_K,
                            "description": "number of results",
                        },
                    },
                    "required": ["query"],
                },
                search_papers,
            ),
            FunctionTool(
                "read_paper",
                "Read one paper of the collection: title, authors, year, ids, and abstract or text excerpt.",
                {
                    "type": "object",
                    "properties": {"paper_id": {"type": "string", "description": "an id from search_papers"}},
                    "required": ["paper_id"],
                },
                read_paper,
            ),
            FunctionTool(
                "submit",
                "Submit the ids of all papers cited in the text; this ends the episode.",
                {
                    "type": "object",
                    "properties": {
                        "paper_ids": {
                            "type": "array",
                            "items": {"type": "string"},
                            "description": "cited paper ids",
                        }
                    },
                    "required": ["paper_ids"],
                },
                terminal=True,
            ),
        ]


# ----------------------------------------------------------------------------- BM25 baseline


def placeholder_queries(prompt: str, max_queries: int = DEFAULT_MAX_TURNS - 1) -> list[str]:
    """One query per sentence of the context that holds a placeholder (placeholders and formulas removed).

    With more such sentences than ``max_queries``, consecutive sentences are joined so that the
    whole context is still covered in ``max_queries`` searches. A query keeps at most
    ``MAX_QUERY_WORDS`` words (a joined query: an equal share of each sentence's first words).
    """
    start, end = prompt.find(CONTEXT_START), prompt.find(CONTEXT_END)
    context = prompt[start + len(CONTEXT_START) : end] if 0 <= start < end else prompt
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z\[])", context)
    queries = []
    for sentence in sentences:
        if "[CITATION" not in sentence:
            continue
        text = re.sub(r"\[CITATION \d+\]|\$[^$]*\$|\[(?:FORMULA|FIGURE|TABLE)\]", " ", sentence)
        text = " ".join(re.findall(r"[^\W_]+(?:[-'][^\W_]+)*", text)[:MAX_QUERY_WORDS])
        if text:
            queries.append(text)
    if len(queries) > max_queries >= 1:
        size = -(-len(queries) // max_queries)
        share = max(1, MAX_QUERY_WORDS // size)
        queries = [
            " ".join(w for q in queries[i : i + size] for w in q.split()[:share])
            for i in range(0, len(queries), size)
        ]
    return queries


def _submission(result_lists: Sequence[Sequence[str]], k: int) -> list[str]:
    """The top ``k`` ids of each result list, in order, without repeats."""
    return list(dict.fromkeys(i for ids in result_lists for i in list(ids)[:k]))


@dataclass(frozen=True)
class BaselineResult:
    """Mean reward and metrics of the scripted BM25 baseline, with per-task rewards."""

    mean_reward: float
    metrics: dict[str, float]
    rewards: dict[str, float]


def bm25_baseline(
    env_or_tasks: ArxivRefsEnv | Sequence[Task], k: int = 2, max_queries: int = DEFAULT_MAX_TURNS - 1
) -> BaselineResult:
    """Score the scripted agent: search each placeholder sentence, submit the top ``k`` hits of each.

    Given tasks instead of an environment, they are scored in a default :class:`ArxivRefsEnv`. The
    searches go through the same per-task filtered tools the agent gets, so this is an honest floor.
    """
    env = env_or_tasks if isinstance(env_or_tasks, ArxivRefsEnv) else ArxivRefsEnv()
    tasks = env.tasks if isinstance(env_or_tasks, ArxivRefsEnv) else list(env_or_tasks)
    if not tasks:
        raise ConfigError("bm25_baseline needs at least one task")
    rewards: dict[str, float] = {}
    sums: dict[str, float] = {}
    for task in tasks:
        lists = [
            [r.id for r in env.search(task, q, k)] for q in placeholder_queries(task.prompt, max_queries)
        ]
        score = env.verifier.score(task, _submission(lists, k), [])
        rewards[task.id] = score.reward
        for key, value in score.metrics.items():
            sums[key] = sums.get(key, 0.0) + value
    n = len(tasks)
    return BaselineResult(sum(rewards.values()) / n, {key: v / n for key, v in sums.items()}, rewards)


class BM25BaselineRule:
    """The BM25 baseline as a rule over the rendered transcript (text in, next assistant turn out).

    It reads only the transcript: the placeholder sentences of the task prompt and the ids in its own
    search results. One ``search_papers`` call per query (see :func:`placeholder_queries`), then
    ``submit`` with the top ``k`` ids of each result: the same queries and submission as
    :func:`bm25_baseline`, so the two agree exactly when ``max_queries < max_turns``.
    """

    def __init__(self, k: int = 2, max_queries: int = DEFAULT_MAX_TURNS - 1) -> None:
        if k < 1 or max_queries < 1:
            raise ConfigError(f"k and max_queries must be >= 1, got k={k}, max_queries={max_queries}")
        self.k = k
        self.max_queries = max_queries

    def __call__(self, transcript: str) -> str:
        user = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", transcript, re.DOTALL)
        queries = placeholder_queries(user.group(1) if user else transcript, self.max_queries)
        responses = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", transcript, re.DOTALL)
        if len(responses) < len(queries):
            return format_tool_call("search_papers", {"query": queries[len(responses)], "k": self.k})
        lists = [re.findall(r"^\[([0-9a-f]{10})\]", r, re.MULTILINE) for r in responses]
        return format_tool_call("submit", {"paper_ids": _submission(lists, self.k)})


class BM25BaselinePolicy:
    """:class:`BM25BaselineRule` as a :class:`~toolgym.core.Policy` (``toolgym eval --policy bm25``).

    Environments may not import ``toolgym.agents`` (DESIGN.md §2), so the chat template and tokenizer
    come from ``chat``: any ``toolgym.agents`` chat policy (``ChatPolicy(ByteTokenizer())`` for a
    model-free run). Its ``render`` and ``complete`` are used; its own ``generate`` never is.
    """

    name = "bm25"

    def __init__(self, chat: Any, k: int = 2, max_queries: int = DEFAULT_MAX_TURNS - 1) -> None:
        for attr in ("render", "complete", "tokenizer"):
            if not hasattr(chat, attr):
                raise ConfigError(
                    f"chat must be a toolgym.agents ChatPolicy (needs .{attr}), got {type(chat).__name__}"
                )
        self.chat = chat
        self.rule = BM25BaselineRule(k, max_queries)

    def render(
        self, messages: Sequence[Message], *, continuation: bool = False, close_turn: bool = False
    ) -> list[int]:
        return self.chat.render(messages, continuation=continuation, close_turn=close_turn)

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        return self.chat.complete(self.rule(self.chat.tokenizer.decode(token_ids)), sampling)


def baseline_rule() -> BM25BaselineRule:
    """The model-free baseline of ``toolgym eval --policy scripted``: BM25 per placeholder, then submit."""
    return BM25BaselineRule(2)
