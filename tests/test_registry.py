"""The registry is the one way to build an environment from an id: "did you mean", module:id, retries."""

from __future__ import annotations

import pytest

import toolgym
from toolgym.env import RetryPolicy
from toolgym.errors import ConfigError


def test_retry_settings_ride_along_with_the_environment_arguments():
    env = toolgym.make("toolgym/SearchQA-v0", infra_retries=0, infra_backoff_s=0.25, max_turns=2)
    try:
        assert env.unwrapped.retry == RetryPolicy(retries=0, backoff_s=0.25)
        assert env.unwrapped.max_turns == 2
    finally:
        env.close()


def test_bad_retry_settings_are_a_config_error():
    with pytest.raises(ConfigError, match="infra retries must be an integer >= 0, got -1"):
        toolgym.make("toolgym/SearchQA-v0", infra_retries=-1)


def test_unversioned_and_misspelt_ids_say_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown environment id 'toolgym/SearchQA'\. Did you mean"):
        toolgym.make("toolgym/SearchQA")
    with pytest.raises(ConfigError, match=r"Did you mean 'toolgym/SearchQA-v0'"):
        toolgym.make("toolgym/SerchQA-v0")


def test_module_id_form_with_a_missing_module_is_a_config_error():
    with pytest.raises(ConfigError, match=r"names module 'no_such_module_here', which cannot be imported"):
        toolgym.make("no_such_module_here:local/Thing-v0")


def test_the_trainer_builds_environments_through_the_registry():
    from toolgym.training.sampling import workers as rollouts

    with pytest.raises(ConfigError, match=r"Did you mean 'toolgym/SearchQA-v0'"):
        rollouts.make_env("toolgym/SearchQA-v9", {})
