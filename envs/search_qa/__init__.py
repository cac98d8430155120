"""``toolgym/SearchQA-v0``: question answering with a local BM25 search engine.

1. The agent gets a question and three tools: ``search(query, k)`` over a local index, ``open(doc_id)``
   to read a whole document, and ``answer(answer)``, which ends the episode.
2. The reward is exact match after SQuAD normalisation (lower-case, no punctuation, no articles, single
   spaces) against any gold answer; token F1 is always logged too, and ``metric="f1"`` makes it the
   reward (:mod:`~toolgym.envs.search_qa.verifier`).
3. Default data (shipped in the package, CC BY-SA 4.0): the 1,190 XQuAD-en questions over its 240
   SQuAD paragraphs, plus 10,033 Wikipedia lead paragraphs as distractors. Bring your own with
   ``gymnasium.make("toolgym/SearchQA-v0", corpus="docs.jsonl", questions="qs.jsonl")``; the formats
   are in environments.md (:mod:`~toolgym.envs.search_qa.data`).
4. Splits (``split="train" | "test" | "all"``, default ``"all"``, every question): questions about one
   paragraph never straddle the line (the rule: :mod:`~toolgym.envs.search_qa.data`). Default data:
   924 train / 266 test questions (187 / 53 paragraphs). Train on ``"train"``, report on ``"test"``.
5. ``questions="hard"``: 453 questions (331 train / 122 test) on which searching the question itself
   fails and another query works (:mod:`~toolgym.envs.search_qa.hard`); ``select="copy-fails"``
   applies that test to any question set.

Document ids are short (``xq0042``, ``wk01234``) so that a small model can copy them. Modules: ``env``
(the environment and its tools) · ``verifier`` · ``data`` (questions, documents, the shared index) ·
``hard`` (the hard set) · ``rules`` (the model-free baseline of ``--policy scripted``, the warm start's
reference rule and the reformulating rule).
"""

from __future__ import annotations

from toolgym.envs.search_qa.data import (
    PROMPT,
    SPLIT_NAMESPACE,
    TEST_FRACTION,
    default_corpus,
    default_questions,
    split_key,
)
from toolgym.envs.search_qa.env import QUESTION_SETS, SearchQAEnv
from toolgym.envs.search_qa.hard import build_hard_questions, hard_questions, select_copy_fails
from toolgym.envs.search_qa.rules import (
    REFERENCE_RULES,
    baseline_rule,
    default_reference_rule,
    reference_rule,
    reformulating_rule,
)
from toolgym.envs.search_qa.search_results import DEFAULT_K, MAX_K, SNIPPET_CHARS
from toolgym.envs.search_qa.verifier import METRICS, ExactMatchVerifier, f1_score, normalize_answer

__all__ = [
    "DEFAULT_K",
    "MAX_K",
    "METRICS",
    "PROMPT",
    "QUESTION_SETS",
    "REFERENCE_RULES",
    "SNIPPET_CHARS",
    "SPLIT_NAMESPACE",
    "TEST_FRACTION",
    "ExactMatchVerifier",
    "SearchQAEnv",
    "baseline_rule",
    "build_hard_questions",
    "default_corpus",
    "default_reference_rule",
    "default_questions",
    "f1_score",
    "hard_questions",
    "normalize_answer",
    "reference_rule",
    "reformulating_rule",
    "select_copy_fails",
    "split_key",
]
