"""The ArxivRefs reward: F1 of the submitted paper ids against the gold citations."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from toolgym.core import Message, Score, Task
from toolgym.errors import VerifierError
from toolgym.tools.papers.collection import Collection

__all__ = ["CitationF1Verifier"]


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
            raise VerifierError(f"task {task.id!r} has no gold ids (reference={gold!r}); fix the data")
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
