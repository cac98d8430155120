"""Every registered environment passes gymnasium's own checker and toolgym's contract checks."""

from __future__ import annotations

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import toolgym
from toolgym.errors import ConfigError, ToolgymError

ENV_IDS = toolgym.env_ids()


@pytest.fixture(params=ENV_IDS)
def env_id(request):
    return request.param


def test_ids_are_versioned_and_registered():
    assert ENV_IDS, "no environment registered"
    for env_id in ENV_IDS:
        namespace, rest = env_id.split("/")
        name, version = rest.rsplit("-v", 1)
        assert namespace == "toolgym" and name and version.isdigit()
        assert env_id in gymnasium.registry


def test_gymnasium_checker(env_id):
    env = gymnasium.make(env_id)
    check_env(env.unwrapped)
    env.close()


def test_seeded_reset_is_deterministic(env_id):
    env = gymnasium.make(env_id)
    first = [env.reset(seed=s)[1]["task_id"] for s in range(8)]
    again = [env.reset(seed=s)[1]["task_id"] for s in range(8)]
    obs_a, _ = env.reset(seed=3)
    obs_b, _ = env.reset(seed=3)
    env.close()
    assert first == again
    assert obs_a == obs_b
    assert len(set(first)) > 1, "different seeds should pick different tasks"


def test_reward_is_zero_until_the_end_and_turn_limit_truncates(env_id):
    env = gymnasium.make(env_id)
    obs, info = env.reset(seed=0)
    limit = info["max_turns"]
    for turn in range(1, limit + 1):
        obs, reward, terminated, truncated, info = env.step(
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        )
        assert reward == 0.0 and not terminated
        assert obs[0]["content"].startswith("Error: unknown tool 'nope'")
        assert truncated == (turn == limit)
    assert info["metrics"]["env/truncated"] == 1.0
    with pytest.raises(ToolgymError, match="call reset"):
        env.step("more")
    env.close()


def test_malformed_calls_become_observations(env_id):
    env = gymnasium.make(env_id)
    env.reset(seed=1)
    for bad in [
        "<tool_call>{not json</tool_call>",
        "<tool_call>",
        "</tool_call>",
        "<tool_call>[]</tool_call>",
    ]:
        obs, reward, terminated, truncated, _ = env.step(bad)
        assert obs and all(m["role"] == "tool" and m["content"].startswith("Error: ") for m in obs)
        assert reward == 0.0 and not terminated
        if truncated:
            env.reset(seed=1)
    env.close()


def test_tool_restriction_keeps_the_terminal_tool(env_id):
    env = gymnasium.make(env_id)
    _, info = env.reset(seed=0)
    tools = info["allowed_tools"]
    _, restricted = env.reset(seed=0, options={"tools": []})
    assert set(restricted["allowed_tools"]) < set(tools) and restricted["allowed_tools"]
    with pytest.raises(ConfigError, match="unknown tool"):
        env.reset(seed=0, options={"tools": ["definitely_not_a_tool"]})
    env.close()


def test_close_is_idempotent(env_id):
    env = gymnasium.make(env_id)
    env.reset(seed=0)
    env.close()
    env.close()


def test_unknown_id_says_did_you_mean():
    with pytest.raises(ConfigError, match=r"Did you mean 'toolgym/SearchQA-v0'"):
        toolgym.make("toolgym/SearchQA-v1")
    with pytest.raises(ConfigError, match="unknown environment id"):
        toolgym.make("nothing/like-this")
