"""Every registered environment passes :func:`toolgym.envs.check_env`: gymnasium's own checker plus
toolgym's contract (versioned id, seeding, sparse terminal reward, truncation, the model's mistakes as
observations, tool restriction, idempotent close)."""

from __future__ import annotations

import gymnasium
import pytest

import toolgym
from toolgym.envs import check_env
from toolgym.errors import ConfigError

ENV_IDS = toolgym.env_ids()


def test_ids_are_versioned_and_registered():
    assert ENV_IDS, "no environment registered"
    for env_id in ENV_IDS:
        namespace, rest = env_id.split("/")
        name, version = rest.rsplit("-v", 1)
        assert namespace == "toolgym" and name and version.isdigit()
        assert env_id in gymnasium.registry


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_env_passes_the_checker(env_id):
    check_env(gymnasium.make(env_id))


def test_unknown_id_says_did_you_mean():
    with pytest.raises(ConfigError, match=r"Did you mean 'toolgym/SearchQA-v0'"):
        toolgym.make("toolgym/SearchQA-v1")
    with pytest.raises(ConfigError, match="unknown environment id"):
        toolgym.make("nothing/like-this")
