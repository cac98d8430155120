"""OpenEnv: toolgym environments served by OpenEnv's own server, driven by OpenEnv's own client."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from golden import SCRIPTS, canonical, golden_path, play
from openenv.core.generic_client import GenericEnvClient
from servers import uvicorn_thread

from toolgym.serving.guards import uvicorn_options
from toolgym.serving.openenv_server import openenv_app


@contextmanager
def openenv_server(env_id: str) -> Iterator[str]:
    """The server ``toolgym serve --openenv`` runs (guards and connection rules included)."""
    with uvicorn_thread(openenv_app(env_id, max_sessions=4), **uvicorn_options()) as url:
        yield url


class OpenEnvClientAsGym:
    """OpenEnv's GenericEnvClient seen through reset/step, so the golden script can drive it."""

    def __init__(self, url: str) -> None:
        self.client = GenericEnvClient(base_url=url).sync()
        self.client.connect()

    def reset(self, *, seed: int, options: dict[str, Any]) -> tuple[Any, Any]:
        result = self.client.reset(seed=seed, **options)
        assert result.done is False and result.reward == 0.0
        return result.observation["messages"], result.observation["info"]

    def step(self, action: str) -> tuple[Any, float, bool, bool, Any]:
        result = self.client.step({"text": action})
        obs = result.observation
        assert result.done == (obs["terminated"] or obs["truncated"])
        return obs["messages"], result.reward, obs["terminated"], obs["truncated"], obs["info"]

    def close(self) -> None:
        self.client.close()


IDS = [pytest.param(e, marks=[pytest.mark.docker] if "CodeExec" in e else []) for e in SCRIPTS]


@pytest.mark.parametrize("env_id", IDS)
def test_openenv_client_replays_the_golden_trace(env_id: str) -> None:
    with openenv_server(env_id) as url:
        text = canonical(play(lambda: OpenEnvClientAsGym(url), env_id))
    assert text == golden_path(env_id).read_text(encoding="utf-8")


def test_openenv_serving_beyond_loopback_needs_a_token() -> None:
    from toolgym.errors import ConfigError
    from toolgym.serving.server import serve_command

    with pytest.raises(ConfigError, match="without a bearer token: pass --token"):
        serve_command("toolgym/SearchQA-v0", {}, host="0.0.0.0", openenv=True)


@pytest.mark.parametrize("bad", [{"max_sessions": 0}, {"session_timeout": 0}])
def test_openenv_app_settings_are_checked(bad: dict[str, Any]) -> None:
    from toolgym.errors import ConfigError

    with pytest.raises(ConfigError, match=next(iter(bad))):
        openenv_app("toolgym/SearchQA-v0", **bad)


def test_unlock_rules_reach_the_environment_through_the_adapter() -> None:
    from toolgym.interop.openenv import OpenEnvAdapter, ToolgymAction

    adapter = OpenEnvAdapter("toolgym/SearchQA-v0")
    try:
        rules = [{"tool": "open", "after": {"turn": 1}}]
        result = adapter.reset(seed=0, unlocks=rules)
        assert "open" not in result.info["allowed_tools"]  # withheld until its rule fires
        call = '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'
        step = adapter.step(ToolgymAction(text=call))
        assert [u["tool"] for u in step.info["unlocked"]] == ["open"]
    finally:
        adapter.close()
