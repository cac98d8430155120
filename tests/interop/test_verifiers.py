"""verifiers: a toolgym environment as a verifiers (0.4, ``verifiers.v1``) environment.

The episodes are played by verifiers itself: its environment loader finds toolgym's taskset by id,
its agent (the ``null`` chat harness, run as a program in the subprocess runtime) asks a model
endpoint for every turn through its interception server. The endpoint is scripted with the golden
actions, so the toolgym side of each episode must equal the golden trace byte for byte, and what the
model was shown must be the environment's observations.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import verifiers.v1 as vf
from golden import SCRIPTS, _stable, canonical, golden_path
from servers import ScriptedModel, uvicorn_thread
from verifiers.v1.clients import ModelContext

from toolgym.errors import ConfigError
from toolgym.interop.verifiers import ToolgymEnv, ToolgymTaskset, ToolgymTasksetConfig, user_turn

KEY_VAR = "TOOLGYM_SCRIPTED_MODEL_KEY"


def play_in_verifiers(
    env: str, resets: list[dict[str, Any]], replies: list[str]
) -> tuple[list[Any], ScriptedModel]:
    model = ScriptedModel(replies)
    config = vf.resolve_env_config(
        {
            "taskset": {"id": "toolgym-verifiers", "env": env, "resets": resets},
            "player": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}},
        }
    )
    environment = vf.load_environment(config)
    assert isinstance(environment, ToolgymEnv)

    async def run_all(url: str) -> list[Any]:
        ctx = ModelContext(
            model="scripted", client=vf.EvalClientConfig(base_url=f"{url}/v1", api_key_var=KEY_VAR)
        )
        async with environment.serving():
            return [
                await environment.run_slot(environment.slots(task)[0], ctx) for task in environment.taskset
            ]

    with uvicorn_thread(model.app()) as url:
        episodes = asyncio.run(run_all(url))
    return episodes, model


IDS = [pytest.param(e, marks=[pytest.mark.docker] if "CodeExec" in e else []) for e in SCRIPTS]


@pytest.mark.slow
@pytest.mark.parametrize("env_id", IDS)
def test_verifiers_replays_the_golden_trace(env_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_VAR, "unused")
    scripts = SCRIPTS[env_id]
    golden = json.loads(golden_path(env_id).read_text(encoding="utf-8"))
    replies = [step["action"] for episode in golden for step in episode["steps"]]  # the turns played
    episodes, model = play_in_verifiers(env_id, [{"seed": s, "options": o} for s, o, _ in scripts], replies)
    assert [e.errors for e in episodes] == [[]] * len(scripts) and all(e.ok for e in episodes)
    records = [episode.traces[0].info["toolgym"] for episode in episodes]
    played = [{k: r[k] for k in ("seed", "options", "reset", "steps")} for r in records]
    assert canonical(_stable(played)) == golden_path(env_id).read_text(encoding="utf-8")
    for episode, record in zip(episodes, records, strict=True):
        rewards = episode.traces[0].rewards
        assert rewards["toolgym_reward"].score == sum(step["reward"] for step in record["steps"])
    # The model was asked once per golden turn and shown exactly the environment's observations.
    assert len(model.requests) == len(replies)
    shown = iter(model.requests)
    for record in records:
        observations = [record["reset"]["observation"]] + [s["observation"] for s in record["steps"][:-1]]
        for observation in observations:
            sent = [{"role": m["role"], "content": m["content"]} for m in next(shown)["messages"]]
            turn = user_turn(observation)
            assert sent[-len(turn) :] == turn


@pytest.mark.slow
def test_verifiers_plays_an_environment_served_by_toolgym_serve(
    serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_VAR, "unused")
    env_id = "toolgym/SearchQA-v0"
    seed, options, turns = SCRIPTS[env_id][0]
    with serve(env_id) as (url, _):
        episodes, _ = play_in_verifiers(url, [{"seed": seed, "options": options}], turns)
    [record] = [episodes[0].traces[0].info["toolgym"]]
    [golden] = [e for e in json.loads(golden_path(env_id).read_text()) if e["seed"] == seed]
    assert canonical(_stable(record["steps"])) == canonical(golden["steps"])
    assert episodes[0].traces[0].rewards["toolgym_reward"].score == 1.0


def test_taskset_lists_one_task_per_environment_task() -> None:
    from toolgym.registry import make

    env = make("toolgym/SearchQA-v0", split="test")
    expected = [task.id for task in env.unwrapped.tasks]
    env.close()
    taskset = ToolgymTaskset(ToolgymTasksetConfig(env="toolgym/SearchQA-v0", env_kwargs={"split": "test"}))
    tasks = list(taskset)
    assert [t.data.options["task_id"] for t in tasks] == expected and len(expected) > 10
    assert all(t.data.prompt is None and t.data.env_kwargs == {"split": "test"} for t in tasks)


def test_a_malformed_reset_entry_is_a_clear_error() -> None:
    config = ToolgymTasksetConfig(env="toolgym/SearchQA-v0", resets=[{"seed": 0, "task_id": "x"}])
    with pytest.raises(ConfigError, match=r"taskset.resets\[0\].*unknown keys \['task_id'\]"):
        list(ToolgymTaskset(config))


def test_tool_results_reach_the_agent_as_one_user_turn() -> None:
    observation = [
        {"role": "tool", "name": "search", "content": "a"},
        {"role": "tool", "name": "open", "content": "b"},
        {"role": "user", "content": "note"},
    ]
    assert user_turn(observation) == [
        {
            "role": "user",
            "content": "<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response>",
        },
        {"role": "user", "content": "note"},
    ]
