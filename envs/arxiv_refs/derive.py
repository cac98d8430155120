"""ArxivRefs' data from its two input files: the work a cache entry saves.

:func:`derive` reads the corpus and the optional collection, links them
(:func:`~toolgym.tools.papers.collection.build_collection`), finds near-duplicates and the ids each
query paper's tools must not return (:mod:`toolgym.envs.arxiv_refs.leakage`), and builds the tasks
(:mod:`toolgym.envs.arxiv_refs.data`) with their splits; :class:`CacheSettings` is every constructor
setting the result depends on. :mod:`toolgym.envs.arxiv_refs.cache` stores the result and opens it in
later processes; nothing else calls this.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolgym.core import Task
from toolgym.envs.arxiv_refs.data import UNLINKED_MODES, ContextRule, build_tasks
from toolgym.envs.arxiv_refs.leakage import banned_ids, label_splits
from toolgym.errors import ConfigError, check_choice, did_you_mean
from toolgym.tools.papers.collection import Collection, build_collection
from toolgym.tools.papers.copies import near_duplicates
from toolgym.tools.papers.corpus import load_papers
from toolgym.tools.papers.records import load_records
from toolgym.tools.search.index import BACKENDS

__all__ = ["CacheSettings", "derive", "no_tasks", "phase"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheSettings:
    """The constructor settings that change the derived data (each is part of the key)."""

    rule: ContextRule
    date_filter: bool
    near_duplicate_threshold: float
    unlinked: str
    backend: str

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(
                f"unknown search backend {self.backend!r}; expected one of {', '.join(BACKENDS)}."
                + did_you_mean(self.backend, BACKENDS)
            )
        check_choice("unlinked", self.unlinked, UNLINKED_MODES)

    def to_json(self) -> dict[str, Any]:
        return {
            "sections": self.rule.sections,
            "fallback_sections": self.rule.fallback_sections,
            "max_context_chars": self.rule.max_context_chars,
            "date_filter": self.date_filter,
            "near_duplicate_threshold": self.near_duplicate_threshold,
            "unlinked": self.unlinked,
            "backend": self.backend,
        }


@contextmanager
def phase(label: str) -> Iterator[None]:
    """A spinner with the elapsed time while one step of a build runs (on a terminal's stderr, removed
    after); the step and its duration are logged at INFO either way."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    start = time.perf_counter()
    console = Console(stderr=True)
    if console.is_terminal:
        columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            progress.add_task(label, total=None)
            yield
    else:
        yield
    log.info("%s: %.1f s", label, time.perf_counter() - start)


def no_tasks(corpus: Path, rule: ContextRule, stats: dict[str, int]) -> ConfigError:
    """Why no task came out of ``corpus``, with the counts that show it."""
    if stats["markers"] == 0:
        return ConfigError(f"{corpus}: no paper has a cited context under the section rule {rule}")
    if stats["markers_linked"] == 0:
        return ConfigError(
            f"{corpus}: none of the {stats['markers']} citation markers in the chosen contexts links to a "
            "bibliography entry (a {{cite:<ref_id>}} marker or cite_span ref_id must be a key of the "
            "paper's bib_entries)"
        )
    return ConfigError(
        f"{corpus}: every cited reference is hidden by the anti-leak rules ({stats['markers_linked']} linked "
        f"markers, {stats['gold_unreachable']} cited records banned: the query paper itself, its copies, "
        "or dated after it; date_filter=False keeps later ones)"
    )


def derive(
    corpus: Path, collection_path: Path | None, settings: CacheSettings
) -> tuple[Collection, list[Task], dict[str, int], dict[str, set[str]]]:
    """The environment's data from its inputs (the work a cache entry saves)."""
    with phase(f"ArxivRefs: reading {corpus.name}"):
        papers = load_papers(corpus)
    given = []
    if collection_path is not None:
        with phase(f"ArxivRefs: reading {collection_path.name}"):
            given = load_records(collection_path)
    with phase(f"ArxivRefs: linking {len(papers):,} papers and {len(given):,} records"):
        collection = build_collection(papers, given)
    if given and collection.given_linked == 0:
        counts = collection.counts()
        raise ConfigError(
            f"{collection_path}: none of its {len(given)} records is linked to any of the "
            f"{counts['bib_entries']} bibliography entries of the {len(papers)} papers of {corpus} "
            "(links are by arXiv id, DOI, OpenAlex id, then normalised title of >= 3 words); "
            "check that the two files describe the same papers"
        )
    with phase(f"ArxivRefs: near-duplicates and banned ids over {len(collection.records):,} records"):
        threshold = settings.near_duplicate_threshold
        dups = near_duplicates(collection, threshold=threshold)
        banned = banned_ids(
            collection, date_filter=settings.date_filter, near_duplicate_threshold=threshold, dups=dups
        )
    tasks, stats = build_tasks(collection, settings.rule, banned, settings.unlinked)
    if not tasks:
        raise no_tasks(corpus, settings.rule, stats)
    return collection, label_splits(collection, tasks, dups), stats, banned
