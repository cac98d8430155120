"""What the ``search`` tool of SearchQA shows: one ``[doc_id] title: snippet`` line per hit.

The environment shows it (:mod:`~toolgym.envs.search_qa.env`), and the hard question set is built
against the same text (:mod:`~toolgym.envs.search_qa.hard`), so "shown" there means shown to the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["DEFAULT_K", "MAX_K", "SNIPPET_CHARS", "format_results"]

#: Results a ``search`` call shows when the model gives no ``k`` (what copying the question sees).
DEFAULT_K = 3
MAX_K = 10
SNIPPET_CHARS = 240


def format_results(index: Any, hits: Sequence[Any]) -> str:
    """What ``search`` shows for ``hits``: one ``[doc_id] title: snippet`` line each."""
    if not hits:
        return "No results. Try other words."
    lines = []
    for hit in hits:
        doc = index.get(hit.doc_id)
        snippet = doc["text"][:SNIPPET_CHARS] + ("..." if len(doc["text"]) > SNIPPET_CHARS else "")
        lines.append(f"[{hit.doc_id}] {doc['title']}: {snippet}")
    return "\n".join(lines)
