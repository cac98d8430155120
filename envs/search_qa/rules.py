"""SearchQA's scripted rules: the model-free baseline and the warm start's reference demonstrations."""

from __future__ import annotations

import re
from collections.abc import Callable

from toolgym.core import Task
from toolgym.parsing import format_tool_call, tool_responses

__all__ = ["baseline_rule", "reference_rule"]

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
