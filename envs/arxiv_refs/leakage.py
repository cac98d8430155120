"""ArxivRefs leakage: what a task's tools may not return, and which query papers share a split.

Anti-leak (per task): the query paper's collection id (which every version, id form and citing
bibliography entry of it was merged into) is banned; so are records whose text copies the query's
(:func:`toolgym.tools.papers.copies.near_duplicates`) and, with ``date_filter``, records dated after
the query paper (compared at the precision both dates know). :func:`banned_ids` computes these sets;
the environment's tools filter them out of one shared index.

Splits (``split="train" | "test" | "all"``, default ``"all"``, every task):
by query paper. Query papers are grouped when they are one collection record (versions of a paper)
or when one copies the other's text (the near-duplicate rule above), so a paper and its copy never
straddle the line; a group goes to ``test`` by the hash rule of :mod:`toolgym.splits` (namespace
``ArxivRefs``, key ``paper:<smallest collection id of the group>``, test fraction
:data:`TEST_FRACTION`), unless a corpus record carries its own ``"split"``. The collection and index
stay whole in every split: they are the world the agent searches, not the tasks. Default data: 27
train / 13 test tasks (49 groups of one paper each: no two sample papers copy each other).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable

from toolgym.core import Task
from toolgym.splits import SplitItem, assign_splits, label_tasks
from toolgym.tools.papers.collection import Collection, UnionFind
from toolgym.tools.papers.copies import near_duplicates

__all__ = ["SPLIT_NAMESPACE", "TEST_FRACTION", "banned_ids", "label_splits", "split_groups"]

#: Share of query-paper groups the hash rule puts in the test split (the same as SearchQA's; on the 40
#: default tasks it gives 27 train / 13 test: enough test tasks to report a mean on).
TEST_FRACTION = 0.25
#: Namespace of the split hash (see :mod:`toolgym.splits`).
SPLIT_NAMESPACE = "ArxivRefs"


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


class _LaterIndex:
    """The records dated after a given date, by :func:`_later`'s rule, without scanning every record.

    Records are bucketed by year, year-month and year-month-day; a query takes the buckets after its
    date (a sorted key list and a bisection per level), so its cost is the size of its answer.
    """

    def __init__(self, dated: Iterable[tuple[str, tuple[int, int, int] | None]]) -> None:
        self.levels: list[dict[tuple[int, ...], list[str]]] = [{}, {}, {}]
        for cid, date in dated:
            if date is None:
                continue
            for depth in range(3):
                if date[depth] == 0:
                    break
                self.levels[depth].setdefault(date[: depth + 1], []).append(cid)
        self.keys = [sorted(level) for level in self.levels]

    def after(self, limit: tuple[int, int, int] | None) -> set[str]:
        out: set[str] = set()
        if limit is None:
            return out
        for depth in range(3):
            if limit[depth] == 0:
                break
            # Keys sharing the limit's prefix and larger at this level: later at this precision.
            prefix, keys = limit[:depth], self.keys[depth]
            for key in keys[bisect_right(keys, limit[: depth + 1]) :]:
                if key[:depth] != prefix:
                    break
                out.update(self.levels[depth][key])
        return out


def banned_ids(
    collection: Collection,
    *,
    date_filter: bool,
    near_duplicate_threshold: float,
    dups: dict[str, set[str]] | None = None,
) -> dict[str, set[str]]:
    """Per source paper: its own id, its near-duplicates and (optionally) records dated after it.

    ``dups`` is :func:`~toolgym.tools.papers.copies.near_duplicates` at the threshold, when already computed.
    """
    if dups is None:
        dups = near_duplicates(collection, threshold=near_duplicate_threshold)
    later = _LaterIndex((r.id, r.date) for r in collection.records.values()) if date_filter else None
    out = {}
    for paper in collection.papers:
        ban = {collection.paper_ids[paper.paper_id]} | dups[paper.paper_id]
        if later is not None:
            ban |= later.after(paper.date)
        out[paper.paper_id] = ban
    return out


def split_groups(collection: Collection, dups: dict[str, set[str]]) -> dict[str, str]:
    """Per source paper id, its split grouping key: ``paper:<smallest collection id of its group>``.

    Source papers share a group when they map to one collection record, or when one's record is a
    near-duplicate (``dups``, per source paper) of the other: leakage happens between a paper and its
    copy just as within one paper.
    """
    node = {p.paper_id: i for i, p in enumerate(collection.papers)}
    groups = UnionFind([{} for _ in collection.papers])  # no ids to guard: a plain union-find
    by_record: dict[str, list[int]] = {}
    for paper in collection.papers:
        by_record.setdefault(collection.paper_ids[paper.paper_id], []).append(node[paper.paper_id])
    for paper in collection.papers:
        linked = [collection.paper_ids[paper.paper_id], *sorted(dups.get(paper.paper_id, ()))]
        for cid in linked:
            for other in by_record.get(cid, ()):
                groups.union(node[paper.paper_id], other, guard=())
    smallest: dict[int, str] = {}
    for paper in collection.papers:
        root, cid = groups.find(node[paper.paper_id]), collection.paper_ids[paper.paper_id]
        smallest[root] = min(smallest.get(root, cid), cid)
    return {p.paper_id: f"paper:{smallest[groups.find(node[p.paper_id])]}" for p in collection.papers}


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
