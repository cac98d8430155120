"""ArxivRefs tasks: which paragraphs of a paper are shown, and how its citations become placeholders.

Context rule (:class:`ContextRule`, configurable): paragraphs whose section name matches ``sections``
(related work, background, prior/previous work, literature, state of the art), in document order;
when none match or they hold no citation, the ``fallback_sections`` (introduction, motivation);
paragraphs are kept up to ``max_context_chars`` (at least one). A paper with no citation in its
context gives no task. Placeholders are numbered by first appearance of each distinct reference, so a
reference cited twice keeps its number. Formulas render as ``$latex$`` (long ones as ``[FORMULA]``),
figures and tables as ``[FIGURE]``/``[TABLE]``.

Unlinked citations (a marker whose reference has no record in the collection: nothing the tools
return can answer it) follow ``unlinked`` (:data:`UNLINKED_MODES`): ``"mark"`` (default) shows them
as ``[CITATION n: not in the collection]`` and says so above the context, ``"omit"`` leaves them out
of the context, ``"plain"`` shows them as ordinary placeholders. Either way the gold holds only what
the collection answers, and ``metadata["placeholders_unlinked"]`` counts them. A context without
unlinked citations is rendered identically in every mode.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from toolgym.core import Task
from toolgym.errors import ConfigError, check_choice
from toolgym.tools.papers.collection import Collection
from toolgym.tools.papers.corpus import SourcePaper
from toolgym.tools.papers.markers import iter_citations, render_markers

__all__ = [
    "CONTEXT_END",
    "CONTEXT_START",
    "DEFAULT_FALLBACK",
    "DEFAULT_MAX_TURNS",
    "DEFAULT_SECTIONS",
    "PROMPT",
    "UNLINKED_MARK",
    "UNLINKED_MODES",
    "UNLINKED_NOTE",
    "ContextRule",
    "build_tasks",
]

DEFAULT_SECTIONS = (
    r"related\s+works?|background|prior\s+work|previous\s+work|literature|state\s+of\s+the\s+art"
)
DEFAULT_FALLBACK = r"introduction|motivation"
#: Assistant turns an episode gets by default (the environment's ``max_turns``; the scripted
#: baseline searches at most one query fewer, so that it can still submit).
DEFAULT_MAX_TURNS = 16
#: The prompt's context delimiters (the baseline finds the context between them).
CONTEXT_START, CONTEXT_END = "<<<CONTEXT", "CONTEXT>>>"
PROMPT = (
    'Below is the {where} of the paper "{title}". Every citation was replaced by a placeholder '
    "[CITATION n]; the same number means the same reference.\n"
    "Find the cited papers in the collection with search_papers and read_paper, then call submit with "
    "the list of their paper ids (all placeholders at once).\n"
    f"{CONTEXT_START}\n{{context}}\n{CONTEXT_END}"
)
#: How citations without a collection record are shown (see the module docstring).
UNLINKED_MODES = ("mark", "omit", "plain")
#: The placeholder of an unlinked citation under ``unlinked="mark"``.
UNLINKED_MARK = "[CITATION {number}: not in the collection]"
#: Said above the context of a task with marked placeholders (and only then).
UNLINKED_NOTE = (
    "Placeholders marked [CITATION n: not in the collection] cite papers the collection does not "
    "hold: they cannot be found and are not scored.\n"
)
_PROMPT_NOTED = PROMPT.replace(CONTEXT_START, "{note}" + CONTEXT_START, 1)
#: Separators and brackets left empty where an omitted citation was (``\x00`` marks the spot).
_OMITTED = (
    (re.compile(r"\x00(?:\s*[,;]\s*\x00)+"), "\x00"),
    (re.compile(r"[(\[]\s*\x00\s*[)\]]"), ""),
    (re.compile(r"\s*[,;]\s*\x00"), "\x00"),
    (re.compile(r"\x00\s*[,;](?=\s)"), "\x00"),
    (re.compile(r"[ \t]*\x00"), ""),
)


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
            kept: list[str] = []
            size = 0
            for p in chosen:
                if kept and size + len(p.text) > rule.max_context_chars:
                    break
                kept.append(p.text)
                size += len(p.text)
            return label, kept
    return "", []


def build_tasks(
    collection: Collection,
    rule: ContextRule,
    banned: Mapping[str, AbstractSet[str]],
    unlinked: str = "mark",
) -> tuple[list[Task], dict[str, int]]:
    """One task per paper with a cited context; returns the tasks and linking statistics.

    Gold = collection ids of the references cited in the shown context that the task's tools can
    reach; cited references banned for the task (dated later than the paper) are listed in
    ``metadata["gold_unreachable"]`` instead. A marker whose ref id has no bibliography entry links
    to nothing (counted as ``markers_unlinked``); its placeholder is marked, left out or shown plain
    as ``unlinked`` says (module docstring), and counted per task in
    ``metadata["placeholders_unlinked"]`` (``metadata["placeholders"]`` counts those shown). The
    statistics add both counts summed over the tasks built.

    Raises:
        ConfigError: ``unlinked`` is not one of :data:`UNLINKED_MODES`.
    """
    check_choice("unlinked", unlinked, UNLINKED_MODES)
    tasks: list[Task] = []
    stats = {"markers": 0, "markers_linked": 0, "markers_unlinked": 0, "gold_unreachable": 0}
    stats |= {"placeholders": 0, "placeholders_unlinked": 0}
    for paper in collection.papers:
        where, paragraphs = _context(paper, rule)
        if not paragraphs:
            continue
        numbers: dict[str, int] = {}
        without: set[str] = set()  # ref ids of the unlinked citations
        gold: dict[str, None] = {}
        rendered = []
        for text in paragraphs:
            pieces, pos = [], 0
            for start, end, ref_id in iter_citations(text):
                stats["markers"] += 1
                cid = collection.ref_ids.get((paper.paper_id, ref_id))
                pieces.append(text[pos:start])
                pos = end
                if cid is None:
                    stats["markers_unlinked"] += 1
                    without.add(ref_id)
                    if unlinked == "omit":
                        pieces.append("\x00")
                        continue
                else:
                    stats["markers_linked"] += 1
                    gold[cid] = None
                number = numbers.setdefault(ref_id, len(numbers) + 1)
                marked = cid is None and unlinked == "mark"
                pieces.append(UNLINKED_MARK.format(number=number) if marked else f"[CITATION {number}]")
            pieces.append(text[pos:])
            joined = "".join(pieces)
            if "\x00" in joined:
                for pattern, replacement in _OMITTED:
                    joined = pattern.sub(replacement, joined)
            rendered.append(render_markers(joined, paper.formulas))
        ban = banned[paper.paper_id]
        reachable = sorted(c for c in gold if c not in ban)
        unreachable = sorted(c for c in gold if c in ban)
        stats["gold_unreachable"] += len(unreachable)
        if not reachable:
            continue
        note = UNLINKED_NOTE if without and unlinked == "mark" else ""
        prompt = _PROMPT_NOTED.format(
            where=where, title=paper.title or paper.paper_id, note=note, context="\n\n".join(rendered)
        )
        meta = {
            "paper_id": paper.paper_id,
            "title": paper.title,
            "context": where,
            "placeholders": len(numbers),
            "placeholders_unlinked": len(without),
            "gold_unreachable": unreachable,
        }
        stats["placeholders"] += len(numbers)
        stats["placeholders_unlinked"] += len(without)
        tasks.append(Task(id=f"arxiv-{paper.paper_id}", prompt=prompt, reference=reachable, metadata=meta))
    return tasks, stats
