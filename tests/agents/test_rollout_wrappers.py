"""run_episode honours a user's gymnasium wrappers (reward, observation, statistics) and keeps the async
fast path when only gymnasium.make's own wrappers are present."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import gymnasium
import pytest

from toolgym.agents import rollout
from toolgym.agents.harness import get_harness
from toolgym.agents.policies.base import ScriptedPolicy
from toolgym.agents.rollout import run_episode, user_wrappers
from toolgym.core import FunctionTool, Message, Score, Task, Tool
from toolgym.env import ToolEnv
from toolgym.errors import ConfigError
from toolgym.parsing import format_tool_call

ENV_ID = "toolgym-test/WrappedWord-v0"


class Exact:
    def score(self, task: Task, answer: object, trajectory: Sequence[Message]) -> Score:
        return Score(float(answer == task.reference))


class WordEnv(ToolEnv):
    """``word()`` returns "kiwi"; the answer "kiwi" scores 1."""

    description = "Say the word the tool returns (tests only)."

    def __init__(self) -> None:
        super().__init__(max_turns=3)
        self.tasks = [Task(id="t0", prompt="Find the word.", reference="kiwi")]
        self.verifier = Exact()

    async def episode_tools(self, task: Task) -> Sequence[Tool]:
        return [
            FunctionTool("word", "The word.", {"type": "object", "properties": {}}, lambda: "kiwi"),
            FunctionTool(
                "answer",
                "Answer.",
                {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
                terminal=True,
            ),
        ]


if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point=WordEnv)


class DoubleReward(gymnasium.RewardWrapper[list[Message], str]):
    def reward(self, reward: Any) -> float:
        return 2.0 * float(reward)


class TagObservation(gymnasium.ObservationWrapper[list[Message], str, list[Message]]):
    """Appends a marker to every message's content, so the trajectory shows the wrapper ran."""

    def observation(self, observation: list[Message]) -> list[Message]:
        return [{**m, "content": m["content"] + " [tagged]"} for m in observation]


def script() -> ScriptedPolicy:
    return ScriptedPolicy([format_tool_call("word", {}), format_tool_call("answer", {"answer": "kiwi"})])


def test_gymnasium_make_defaults_are_not_user_wrappers() -> None:
    env = gymnasium.make(ENV_ID)
    try:
        assert env is not env.unwrapped  # make added OrderEnforcing / PassiveEnvChecker
        assert user_wrappers(env) == []
        assert user_wrappers(DoubleReward(env)) == ["DoubleReward"]
    finally:
        env.close()


async def test_bare_env_runs_on_the_async_path_unchanged() -> None:
    env = gymnasium.make(ENV_ID)
    try:
        t = await run_episode(env, script(), get_harness("bare"))
    finally:
        env.close()
    assert t.status == "ok" and t.reward == 1.0
    assert not any("[tagged]" in m["content"] for m in t.messages)


async def test_reward_and_observation_wrappers_apply(caplog: pytest.LogCaptureFixture) -> None:
    monkey_state = rollout._warned_sync_path
    rollout._warned_sync_path = False
    env = TagObservation(DoubleReward(gymnasium.make(ENV_ID)))
    try:
        with caplog.at_level(logging.WARNING, logger=rollout.__name__):
            t = await run_episode(env, script(), get_harness("bare"))
    finally:
        env.close()
        rollout._warned_sync_path = monkey_state
    assert t.status == "ok" and t.reward == 2.0  # the reward wrapper doubled the terminal reward
    tool_and_prompt = [m for m in t.messages if m["role"] != "assistant"]
    assert tool_and_prompt and all(m["content"].endswith("[tagged]") for m in tool_and_prompt)
    assert any("TagObservation, DoubleReward" in r.getMessage() for r in caplog.records)


async def test_record_episode_statistics_sees_the_episode() -> None:
    env = gymnasium.wrappers.RecordEpisodeStatistics(gymnasium.make(ENV_ID))
    try:
        t = await run_episode(env, script(), get_harness("bare"))
    finally:
        env.close()
    assert t.status == "ok"
    assert list(env.return_queue) == [1.0] and list(env.length_queue) == [2]


async def test_time_limit_wrapper_truncates() -> None:
    env = gymnasium.wrappers.TimeLimit(gymnasium.make(ENV_ID), max_episode_steps=1)
    try:
        t = await run_episode(env, script(), get_harness("bare"))
    finally:
        env.close()
    assert t.status == "truncated" and t.reward == 0.0 and len(t.token_ids) > 0


async def test_a_non_toolgym_env_is_a_config_error() -> None:
    env = gymnasium.make("CartPole-v1")
    try:
        with pytest.raises(ConfigError, match="needs a toolgym environment"):
            await run_episode(env, script(), get_harness("bare"))
    finally:
        env.close()
