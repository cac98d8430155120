"""The Docker engine stops in the middle of a CodeExec evaluation and comes back.

The engine is stopped with SIGTERM (as an operator or a crash would) and restarted exactly as CI
starts it (``.ci/docker.sh``, which waits until ``docker info`` answers). Runs after every other test
of the session (marker ``stops_docker``). Before running it by hand on a shared machine, check that
nobody else's Docker tests are running (``pgrep -af pytest``). ``TOOLGYM_SKIP_DOCKER_RESTART=1`` skips
it on a machine whose engine must not be restarted (one managed by systemd, say); CI never sets it.
"""

from __future__ import annotations

import os

import pytest
from faultkit import (
    HookPolicy,
    docker_answers,
    episode,
    python,
    require_docker,
    start_dockerd,
    stop_dockerd,
    submit,
)

from toolgym.env import RetryPolicy
from toolgym.envs.code_exec import CodeExecEnv, reference_code
from toolgym.tools.sandbox import DockerSandbox, leaked_containers

pytestmark = [pytest.mark.faults, pytest.mark.docker, pytest.mark.stops_docker]


async def test_episodes_during_an_engine_outage_are_infra_errors_and_the_run_goes_on_after_it() -> None:
    require_docker()
    if os.environ.get("TOOLGYM_SKIP_DOCKER_RESTART") == "1":
        pytest.skip("TOOLGYM_SKIP_DOCKER_RESTART=1 asks not to restart the Docker engine")
    sandbox = DockerSandbox(pool_size=1)
    env = CodeExecEnv(sandbox=sandbox, max_turns=3)
    env.retry = RetryPolicy(retries=2, backoff_s=0.1)
    try:
        before = await episode(
            env, HookPolicy([python("print(1)"), submit(reference_code("HumanEval/0"))]), "HumanEval/0"
        )
        assert before.status == "ok" and before.reward == 1.0

        # the engine goes down just before the episode's first tool call
        tool = await episode(
            env, HookPolicy([python("print(1)"), submit("pass")], {1: stop_dockerd}), "HumanEval/2"
        )
        assert tool.status == "infra_error" and tool.reward == 0.0
        assert tool.error.startswith("Sandbox") and tool.metrics["env/infra_retries"] == 2.0

        # still down: a submission cannot be verified, and is not scored
        verify = await episode(env, HookPolicy([submit(reference_code("HumanEval/3"))]), "HumanEval/3")
        assert verify.status == "infra_error" and verify.reward == 0.0
        assert verify.error.startswith("VerificationUnavailable: the verifier of HumanEval/3 could not run")
        assert verify.metrics["env/infra_retries"] == 2.0

        start_dockerd()
        after = await episode(
            env, HookPolicy([python("print(1)"), submit(reference_code("HumanEval/4"))]), "HumanEval/4"
        )
        assert after.status == "ok" and after.reward == 1.0  # the same sandbox object recovered
    finally:
        if not docker_answers():
            start_dockerd()  # never leave the engine down for the rest of the session
        env.close()
        sandbox.close()
    assert leaked_containers(instance=sandbox.instance) == []
