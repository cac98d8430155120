"""``toolgym.envs.check_env`` catches each broken promise: one broken environment per test.

The environments here are small real :class:`~toolgym.ToolEnv` subclasses, each breaking exactly one
part of the contract, so every check is shown to be able to fail (and a conforming one to pass).
"""

from __future__ import annotations

from typing import Any

import gymnasium
import pytest

from toolgym import FunctionTool, Score, Task, ToolEnv
from toolgym.envs import EnvCheckError, check_env
from toolgym.errors import ToolParseError


class Exact:
    def score(self, task: Task, answer: object, trajectory: object) -> Score:
        return Score(float(str(answer) == str(task.reference)), {})


class Good(ToolEnv):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_turns=3, **kwargs)
        self.tasks = [Task(f"t{i}", f"Say {i}.", i) for i in range(4)]
        self.verifier = Exact()

    async def episode_tools(self, task: Task) -> list[FunctionTool]:
        return [
            FunctionTool(
                "echo", "Echo.", {"type": "object", "properties": {"x": {"type": "string"}}}, fn=str
            ),
            FunctionTool(
                "answer",
                "Answer.",
                {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
                terminal=True,
            ),
        ]


class PaysEveryStep(Good):
    async def astep(self, action: str):
        obs, reward, terminated, truncated, info = await super().astep(action)
        return obs, reward + 0.1, terminated, truncated, info


class RaisesOnMalformed(Good):
    async def astep(self, action: str):
        if action.startswith("<tool_call>{not json"):
            raise ToolParseError("tool call is not valid JSON")  # escapes instead of becoming an observation
        return await super().astep(action)


class IgnoresTheSeed(Good):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.resets = 0

    def _choose_task(self, options: dict[str, Any]) -> Task:
        self.resets += 1
        return self.tasks[self.resets % 3]  # a counter, not the seed


class KeepsEveryTool(Good):
    @staticmethod
    def _restrict(tools: dict, allowed: Any) -> dict:
        return tools


class ClosesOnce(Good):
    def close(self) -> None:
        if self._closed:
            raise RuntimeError("already closed")
        super().close()


class NoMaxTurnsInInfo(Good):
    async def areset(self, *, seed: int | None = None, options: dict | None = None):
        obs, info = await super().areset(seed=seed, options=options)
        del info["max_turns"]
        return obs, info


def _make(cls: type, env_id: str = "toolgym-check/Probe-v0") -> gymnasium.Env:
    if env_id in gymnasium.registry:
        del gymnasium.registry[env_id]
    gymnasium.register(id=env_id, entry_point=cls)
    return gymnasium.make(env_id)


def test_a_conforming_environment_passes():
    check_env(_make(Good))


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (PaysEveryStep, "the reward is 0 until the terminal step"),
        (RaisesOnMalformed, "it must become an observation"),
        (IgnoresTheSeed, "the same seed must choose the same task"),
        (KeepsEveryTool, "must keep only the terminal tool"),
        (NoMaxTurnsInInfo, r"reset\(\) info lacks \['max_turns'\]"),
    ],
)
def test_each_broken_promise_is_caught(cls, message):
    with pytest.raises(EnvCheckError, match=message):
        check_env(_make(cls), skip_gymnasium=True)


def test_close_twice_must_not_raise():
    with pytest.raises(RuntimeError, match="already closed"):
        check_env(_make(ClosesOnce), skip_gymnasium=True)


def test_unversioned_id_is_refused():
    with pytest.raises(EnvCheckError, match="versioned"):
        check_env(_make(Good, "toolgym-check/Unversioned"), skip_gymnasium=True)
