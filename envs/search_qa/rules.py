"""SearchQA's scripted rules: the model-free baseline and the warm start's reference demonstrations.

``reference_rule`` copies the question as its query; ``reformulating_rule`` searches the queries a
hard question was built with (:mod:`~toolgym.envs.search_qa.hard`), so its demonstrations show a
query that is not the question.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from toolgym.core import Task
from toolgym.envs.search_qa.hard import shown_answer
from toolgym.envs.search_qa.search_results import DEFAULT_K
from toolgym.parsing import format_tool_call, tool_responses

__all__ = [
    "REFERENCE_RULES",
    "baseline_rule",
    "default_reference_rule",
    "reference_rule",
    "reformulating_rule",
]

#: The first result line of a ``search`` observation, ``[doc_id] title: snippet`` (the baseline reads its title).
_TOP_HIT = re.compile(r"\[[^\]]+\] ([^:\n]+):")


def baseline_rule() -> Callable[[str], str]:
    """The model-free baseline of ``toolgym eval --policy scripted``: a rule over the transcript.

    It searches the question's words, then answers with the title of the top hit: a weak, honest floor.
    """

    def rule(transcript: str) -> str:
        if not tool_responses(transcript):
            questions = re.findall(r"Question: (.*)", transcript)  # the last: a demonstration may precede
            return format_tool_call(
                "search", {"query": questions[-1] if questions else transcript[-200:], "k": 1}
            )
        episode = transcript.rsplit("Question: ", 1)[-1]  # after the worked example, if any
        hits = (_TOP_HIT.match(result) for result in tool_responses(episode))
        title = next((hit.group(1) for hit in hits if hit), "unknown")
        return format_tool_call("answer", {"answer": title})

    return rule


def reference_rule(task: Task) -> Callable[[str], str]:
    """A demonstration of ``task`` built from its gold answers (warm-start data, never evaluation).

    It searches the question (3 results, like the worked example), then answers with the first gold
    answer that appears verbatim in the search results it was shown, spelled as it appears there. When
    no gold answer is visible it answers ``"unknown"``, which the verifier scores low, so a reward
    threshold keeps exactly the demonstrations in which the answer could be copied from the results:
    they teach "search, then copy a short span", never an answer the agent could not have seen.
    """
    golds = sorted(task.reference, key=len) if isinstance(task.reference, list | tuple) else []
    question = str(task.metadata.get("question", "")) or task.prompt

    def rule(transcript: str) -> str:
        episode = transcript.rsplit("Question: ", 1)[-1]  # after the worked example, if any
        results = tool_responses(episode)
        if not results:
            return format_tool_call("search", {"query": question, "k": 3})
        seen = next((g for g in golds if any(g in result for result in results)), None)
        return format_tool_call("answer", {"answer": seen if seen is not None else "unknown"})

    return rule


def reformulating_rule(task: Task) -> Callable[[str], str]:
    """A demonstration of ``task`` that searches with other words than the question's (warm-start data).

    It searches the task's ``hops`` (``metadata["hops"]``: for a hard question, a part of it, or the
    question and then a name its results showed; for any other question, the question itself), one
    search per turn with the default 3 results, and answers as soon as a result shows a gold answer
    (SQuAD words; :func:`~toolgym.envs.search_qa.hard.shown_answer`). When the hops are spent and the
    gold document was shown without the answer, it opens that document once. A hop that uses a name
    (``metadata["bridge"]``) is searched only after a result has shown that name; otherwise, and when
    nothing showed a gold answer, it answers ``"unknown"``, which the verifier scores low. Like
    :func:`reference_rule` it never answers what the agent was not shown.
    """
    golds = [str(g) for g in task.reference] if isinstance(task.reference, list | tuple) else []
    question = str(task.metadata.get("question", "")) or task.prompt
    raw_hops = task.metadata.get("hops")
    hops = [str(h) for h in raw_hops] if isinstance(raw_hops, list) and raw_hops else [question]
    bridge = task.metadata.get("bridge")
    gold_doc = task.metadata.get("gold_doc")

    def rule(transcript: str) -> str:
        episode = transcript.rsplit("Question: ", 1)[-1]  # after the worked example, if any
        results = tool_responses(episode)
        seen = "\n".join(results)
        found = shown_answer(seen, golds) if results else None
        if found is not None:
            return format_tool_call("answer", {"answer": found})
        step = len(results)
        if step < len(hops):
            hop = hops[step]
            if isinstance(bridge, str) and bridge in hop and bridge not in seen:
                return format_tool_call("answer", {"answer": "unknown"})
            return format_tool_call("search", {"query": hop, "k": DEFAULT_K})
        if step == len(hops) and gold_doc is not None and f"[{gold_doc}]" in seen:
            return format_tool_call("open", {"doc_id": str(gold_doc)})
        return format_tool_call("answer", {"answer": "unknown"})

    return rule


#: The reference rules by name (``env.reference_rule``): ``copy`` searches the question itself,
#: ``reformulate`` searches its stored hops (the hard questions' demonstrations).
REFERENCE_RULES = {"copy": reference_rule, "reformulate": reformulating_rule}


def default_reference_rule(env_kwargs: Mapping[str, Any]) -> str:
    """The rule for a configuration's question set: ``reformulate`` for ``questions="hard"`` (the copy
    rule solves 0.6 % of them), else ``copy``."""
    return "reformulate" if env_kwargs.get("questions") == "hard" else "copy"
