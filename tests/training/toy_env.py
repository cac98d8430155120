"""A small registered environment for trainer tests: ``toolgym-test/Letters-v0``.

The agent may call ``lookup(word)`` (a tool with configurable latency, to stand in for a search or a
sandbox call) and ends with ``answer(answer)`` or plain text. The reward is the share of ASCII letters
in the answer: continuous, so a randomly initialised byte model gets groups with varied rewards and a
real learning signal; ``flat_tasks`` adds tasks every answer scores 0.5 on (groups without variance). Importing this module registers the id (gymnasium's ``module:id`` form).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import gymnasium

from toolgym.core import FunctionTool, Message, Score, Task, Tool
from toolgym.env import ToolEnv
from toolgym.tool_use import ToolUse, search_measures

ENV_ID = "toolgym-test/Letters-v0"


class LettersVerifier:
    def score(self, task: Task, answer: object, trajectory: Sequence[Message]) -> Score:
        if task.reference == "flat":  # a task every answer scores the same on: no reward variance
            return Score(reward=0.5, metrics={"reward/letters": 0.5})
        text = answer if isinstance(answer, str) else ""
        letters = sum(ch.isascii() and ch.isalpha() for ch in text)
        reward = letters / len(text) if text else 0.0
        return Score(reward=reward, metrics={"reward/letters": reward})


class LettersEnv(ToolEnv):
    description = "Answer with letters; a lookup tool with latency (tests only)."

    def __init__(
        self, *, latency: float = 0.0, n_tasks: int = 6, max_turns: int = 2, flat_tasks: int = 0
    ) -> None:
        super().__init__(max_turns=max_turns)
        self.latency = latency
        self.tasks = [
            Task(id=f"w{i}", prompt=f"Say a word with {i + 2} letters.", reference=i + 2)
            for i in range(n_tasks)
        ] + [Task(id=f"f{i}", prompt=f"Say anything ({i}).", reference="flat") for i in range(flat_tasks)]
        self.verifier = LettersVerifier()

    def tool_use_metrics(self, task: Task, calls: Sequence[ToolUse], answer: object) -> dict[str, float]:
        return search_measures(calls, search="lookup", query_key="word", question=task.prompt)

    async def episode_tools(self, task: Task) -> Sequence[Tool]:
        async def lookup(word: str) -> str:
            await asyncio.sleep(self.latency)
            return f"{word}: a word"

        return [
            FunctionTool(
                "lookup",
                "Look a word up.",
                {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
                lookup,
            ),
            FunctionTool(
                "answer",
                "Give the answer.",
                {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
                terminal=True,
            ),
        ]


if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point=f"{__name__}:LettersEnv")


# ----------------------------------------------------------------------------- a learnable target
TARGET_ID = "toolgym-test/Target-v0"


class TargetVerifier:
    """The share of the answer's characters that are the task's target character (0 for no answer)."""

    def score(self, task: Task, answer: object, trajectory: Sequence[Message]) -> Score:
        text = answer if isinstance(answer, str) else ""
        reward = text.count(task.reference) / len(text) if text else 0.0
        return Score(reward=reward, metrics={"reward/target": reward})


class TargetEnv(ToolEnv):
    """One turn: answer with as many of the task's target character as the turn allows.

    A randomly initialised byte model writes the target about once in 256 characters, so its reward
    starts near 0; a policy that learns to repeat it scores 1. ``split``: ``train`` and ``test`` tasks
    differ in their prompts (held-out prompts), not in the target.
    """

    description = "Answer with the target character repeated (tests only)."

    def __init__(self, *, split: str = "train", n_tasks: int = 4, target: str = "a") -> None:
        super().__init__(max_turns=1)
        self.split = split
        self.tasks = [
            Task(id=f"{split}-{i}", prompt=f"{split.title()} task {i}: write {target}.", reference=target)
            for i in range(n_tasks)
        ]
        self.verifier = TargetVerifier()

    async def episode_tools(self, task: Task) -> Sequence[Tool]:
        return [
            FunctionTool(
                "answer",
                "Answer.",
                {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
                terminal=True,
            )
        ]


if TARGET_ID not in gymnasium.registry:
    gymnasium.register(id=TARGET_ID, entry_point=f"{__name__}:TargetEnv")
