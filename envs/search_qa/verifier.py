"""SearchQA's verifier: exact match after SQuAD normalisation against any gold answer, and token F1.

Both metrics are always logged; ``metric`` picks which one is the reward.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Sequence
from typing import Any

from toolgym.core import Message, Score, Task
from toolgym.errors import ConfigError, VerifierError, did_you_mean

__all__ = ["METRICS", "ExactMatchVerifier", "f1_score", "normalize_answer"]

METRICS = ("em", "f1")


_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD v1.1 normalisation: lower-case, drop punctuation and articles, collapse whitespace."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def f1_score(prediction: str, gold: str) -> float:
    """SQuAD token-level F1 between normalised strings."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = collections.Counter(pred) & collections.Counter(ref)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred), overlap / len(ref)
    return 2 * precision * recall / (precision + recall)


class ExactMatchVerifier:
    """EM (or F1) against the best-matching gold answer; both always in metrics.

    ``task.reference`` is the list of gold answer strings. An answer that is not a string (or is
    empty) is the model's mistake: reward 0 with ``answer/invalid = 1``. A task without gold answers
    is a data bug and raises.
    """

    def __init__(self, metric: str = "em") -> None:
        if metric not in METRICS:
            raise ConfigError(f"unknown metric {metric!r}.{did_you_mean(metric, METRICS)} Choose em or f1")
        self.metric = metric

    def score(self, task: Task, answer: Any, trajectory: Sequence[Message]) -> Score:
        golds = task.reference
        if not isinstance(golds, list | tuple) or not golds or not all(isinstance(g, str) for g in golds):
            raise VerifierError(f"task {task.id!r} has no gold answers (reference={golds!r}); fix the data")
        if not isinstance(answer, str) or not answer.strip():
            return Score(0.0, {"reward/em": 0.0, "reward/f1": 0.0, "answer/invalid": 1.0})
        em = max(float(normalize_answer(answer) == normalize_answer(g)) for g in golds)
        f1 = max(f1_score(answer, g) for g in golds)
        return Score(
            em if self.metric == "em" else f1, {"reward/em": em, "reward/f1": f1, "answer/invalid": 0.0}
        )
