"""The ``{{kind:id}}`` markers in a paper's body text: citations, formulas, figures and tables.

A corpus keeps every citation as ``{{cite:<ref_id>}}`` and every formula, figure or table as
``{{formula:<id>}}`` (and so on) inside a paragraph's text (:mod:`toolgym.tools.papers.corpus`). This
module finds the citation markers and renders the others as readable text.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

__all__ = ["MARKER", "iter_citations", "render_markers"]

#: One marker: group 1 is its kind (``cite``, ``formula``, ``figure``, ``table``), group 2 its id.
MARKER = re.compile(r"\{\{(\w+):([^{}]*)\}\}")
_CITE_CMD = re.compile(r"\\cite\w*\s*(?:\[[^\]]*\]\s*)*\{[^}]*\}")


def render_markers(
    text: str, formulas: Mapping[str, tuple[str, str]], *, cite: str = "", max_formula_chars: int = 60
) -> str:
    """Readable text: formulas as ``$latex$`` (long ones as ``[FORMULA]``), figures/tables as tags.

    ``cite`` replaces citation markers (empty: removed). ``\\cite`` commands that leak into formula
    LaTeX are removed, so cite keys never reach the agent.
    """

    def one(match: re.Match[str]) -> str:
        kind, ref = match.group(1), match.group(2)
        if kind == "cite":
            return cite
        if kind == "formula":
            raw = _CITE_CMD.sub("", formulas.get(ref, ("", ""))[1])
            latex = re.sub(r"\s+", " ", raw).strip()
            if re.search(r"(?:^|\s)[A-Za-z]{3,}\s+[A-Za-z]{2,}(?:\s|$)", raw) and "\\" not in raw:
                # unarXive artefact: the "formula" is the prose between two formulas; show it as text.
                return f" {latex} "
            return f"${latex}$" if latex and len(latex) <= max_formula_chars else "[FORMULA]"
        return f"[{kind.upper()}]"

    return re.sub(r"[ \t]+", " ", MARKER.sub(one, text)).strip()


def iter_citations(text: str) -> Iterator[tuple[int, int, str]]:
    """``(start, end, ref_id)`` of each citation marker in ``text``."""
    for match in MARKER.finditer(text):
        if match.group(1) == "cite":
            yield match.start(), match.end(), match.group(2)
