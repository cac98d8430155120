"""Once, everywhere: the golden traces replay byte for byte natively and through ``toolgym serve``."""

from __future__ import annotations

import pytest
from golden import SCRIPTS, canonical, golden_path, play

from toolgym.registry import make

IDS = [pytest.param(env_id, marks=[pytest.mark.docker] if "CodeExec" in env_id else []) for env_id in SCRIPTS]


@pytest.mark.parametrize("env_id", IDS)
def test_native_replay_matches_the_golden_trace(env_id: str) -> None:
    assert canonical(play(lambda: make(env_id), env_id)) == golden_path(env_id).read_text(encoding="utf-8")


@pytest.mark.parametrize("env_id", IDS)
def test_served_replay_matches_the_golden_trace(env_id: str, serve) -> None:
    with serve(env_id) as (url, server):
        text = canonical(play(lambda: make(url), env_id))
        assert not server.sessions  # every episode's session was closed by the next reset or close
    assert text == golden_path(env_id).read_text(encoding="utf-8")
