"""The ArxivRefs scripted baseline: search BM25 once per placeholder sentence, then submit the top hits.

Model-free, it reads only what an agent sees, so it is an honest floor for the environment:
:func:`bm25_baseline` scores it directly through the environment's tools, and
:class:`BM25BaselineRule` plays it over a rendered transcript (``toolgym eval --policy scripted``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from toolgym.core import Task
from toolgym.envs.arxiv_refs.data import CONTEXT_END, CONTEXT_START, DEFAULT_MAX_TURNS
from toolgym.envs.arxiv_refs.env import ArxivRefsEnv
from toolgym.errors import ConfigError
from toolgym.parsing import format_tool_call, tool_responses

__all__ = [
    "MAX_QUERY_WORDS",
    "BM25BaselineRule",
    "BaselineResult",
    "baseline_rule",
    "bm25_baseline",
    "placeholder_queries",
    "reference_rule",
]

#: Longest baseline query (words): keeps each search call short enough for a small token budget.
MAX_QUERY_WORDS = 32
#: A placeholder the collection can answer (a marked one reads ``[CITATION n: not in the collection]``).
_FINDABLE = re.compile(r"\[CITATION \d+\]")


def placeholder_queries(prompt: str, max_queries: int = DEFAULT_MAX_TURNS - 1) -> list[str]:
    """One query per sentence of the context that holds a placeholder (placeholders and formulas removed).

    A placeholder marked as not in the collection (``[CITATION n: not in the collection]``) has no
    answer to search for: a sentence holding only such placeholders gives no query. With more such
    sentences than ``max_queries``, consecutive sentences are joined so that the
    whole context is still covered in ``max_queries`` searches. A query keeps at most
    ``MAX_QUERY_WORDS`` words (a joined query: an equal share of each sentence's first words).
    """
    start, end = prompt.find(CONTEXT_START), prompt.find(CONTEXT_END)
    context = prompt[start + len(CONTEXT_START) : end] if 0 <= start < end else prompt
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z\[])", context)
    queries = []
    for sentence in sentences:
        if not _FINDABLE.search(sentence):
            continue
        text = re.sub(r"\[CITATION \d+(?::[^\]]*)?\]|\$[^$]*\$|\[(?:FORMULA|FIGURE|TABLE)\]", " ", sentence)
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


_RESULT_ID = re.compile(r"^\[([0-9a-f]{10})\]", re.MULTILINE)


def _result_ids(responses: Sequence[str]) -> list[list[str]]:
    """The collection ids of each ``search_papers`` result, in rank order."""
    return [_RESULT_ID.findall(r) for r in responses]


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
        responses = tool_responses(transcript)
        if len(responses) < len(queries):
            return format_tool_call("search_papers", {"query": queries[len(responses)], "k": self.k})
        return format_tool_call("submit", {"paper_ids": _submission(_result_ids(responses), self.k)})


def baseline_rule() -> BM25BaselineRule:
    """The model-free baseline of ``toolgym eval --policy scripted``: BM25 per placeholder, then submit."""
    return BM25BaselineRule(2)


def reference_rule(task: Task, k: int = 3, max_queries: int = DEFAULT_MAX_TURNS - 1) -> Callable[[str], str]:
    """A demonstration of ``task`` built from its gold ids (warm-start data, never evaluation).

    It searches each placeholder sentence as the baseline does (:func:`placeholder_queries`, ``k``
    results), then submits the gold ids that appeared in the results it was shown, in the order it saw
    them; with none in sight it submits the top hit of each search, which the verifier scores low. So
    a reward threshold (``warm_start.min_reward``) keeps the demonstrations that teach "search each
    cited sentence, then submit the ids from the results that fit", never an id the agent could not
    have seen.
    """
    gold = set(task.reference) if isinstance(task.reference, list | tuple) else set()
    queries = placeholder_queries(task.prompt, max_queries)

    def rule(transcript: str) -> str:
        responses = tool_responses(transcript)
        if len(responses) < len(queries):
            return format_tool_call("search_papers", {"query": queries[len(responses)], "k": k})
        lists = _result_ids(responses)
        seen = [i for i in dict.fromkeys(i for ids in lists for i in ids) if i in gold]
        return format_tool_call("submit", {"paper_ids": seen or _submission(lists, 1)})

    return rule
