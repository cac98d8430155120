"""Model-free baseline policies, one per environment, for ``toolgym eval --policy scripted``.

Baselines are rules over the rendered transcript (text in, text out): they know the prompt format of
their environment but import no environment code (DESIGN.md §2).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from toolgym.agents.policy import RulePolicy
from toolgym.errors import ConfigError, did_you_mean
from toolgym.parsing import format_tool_call

__all__ = ["BASELINES", "baseline_policy"]


def _search_qa_rule(transcript: str) -> str:
    """Search the question's words; then answer with the title of the top hit (a weak, honest floor)."""
    if "<tool_response>" not in transcript:
        match = re.search(r"Question: (.*)", transcript)
        return format_tool_call("search", {"query": match.group(1) if match else transcript[-200:], "k": 1})
    hit = re.search(r"<tool_response>\n\[[^\]]+\] ([^:\n]+):", transcript)
    return format_tool_call("answer", {"answer": hit.group(1) if hit else "unknown"})


BASELINES: dict[str, Callable[[], RulePolicy]] = {
    "toolgym/SearchQA-v0": lambda: RulePolicy(_search_qa_rule, name="search-baseline"),
}


def baseline_policy(env_id: str) -> RulePolicy:
    """The scripted baseline of an environment."""
    if env_id not in BASELINES:
        raise ConfigError(
            f"no scripted baseline for {env_id!r}.{did_you_mean(env_id, BASELINES)} Have: {', '.join(BASELINES)}"
        )
    return BASELINES[env_id]()
