"""Sandbox faults during a CodeExec evaluation: a container killed from outside, a full workdir.

Each case runs real episodes (a scripted policy, the real Docker sandbox and hidden-test verifier)
and ends with zero leaked containers.
"""

from __future__ import annotations

import pytest
from faultkit import HookPolicy, containers_of, docker, episode, python, require_docker, submit, wait_for

from toolgym.env import RetryPolicy
from toolgym.envs.code_exec import CodeExecEnv, reference_code
from toolgym.tools.sandbox import DockerSandbox, leaked_containers

pytestmark = [pytest.mark.faults, pytest.mark.docker]
TASK = "HumanEval/0"


@pytest.fixture
def sandbox():
    require_docker()
    box = DockerSandbox(pool_size=1, workdir_mb=4)
    try:
        yield box
    finally:
        box.close()
    assert leaked_containers(instance=box.instance) == []


@pytest.fixture
def env(sandbox):
    env = CodeExecEnv(sandbox=sandbox, max_turns=4)
    env.retry = RetryPolicy(retries=2, backoff_s=0.1)
    yield env
    env.close()


def kill_all(sandbox: DockerSandbox) -> None:
    """``docker kill`` every container of the sandbox (its episode container and its warm pool)."""
    wait_for(lambda: len(containers_of(sandbox.instance)) >= 2, "the episode and pool containers")
    docker("kill", *containers_of(sandbox.instance))


async def test_a_container_killed_mid_episode_is_retried_and_the_episode_goes_on(env, sandbox):
    turns = [python("x = 41"), python("print(x + 1)"), submit(reference_code(TASK))]
    trajectory = await episode(env, HookPolicy(turns, {2: lambda: kill_all(sandbox)}), TASK)
    assert trajectory.status == "ok" and trajectory.reward == 1.0  # scored right, not lost
    # the call met the dead episode container, then the dead pool container, then ran in a fresh one
    assert trajectory.metrics["env/infra_retries"] == 2.0
    tool_outputs = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert "NameError" in tool_outputs[1]  # a fresh interpreter: the killed one's variables are gone


async def test_a_container_killed_before_verification_is_retried_and_scored(env, sandbox):
    turns = [python("print(1)"), submit(reference_code(TASK))]
    trajectory = await episode(env, HookPolicy(turns, {2: lambda: kill_all(sandbox)}), TASK)
    assert trajectory.status == "ok" and trajectory.reward == 1.0
    assert trajectory.metrics["env/infra_retries"] == 1.0  # the pool container was dead; the retry ran


async def test_a_workdir_filled_by_the_model_is_an_observation_not_an_infra_error(env):
    fill = "open('/work/fill', 'wb').write(b'0' * (8 << 20))"  # twice the 4 MB workdir
    turns = [python(fill), python("print(2 + 3)"), submit(reference_code(TASK))]
    trajectory = await episode(env, HookPolicy(turns), TASK)
    assert trajectory.status == "ok" and trajectory.reward == 1.0
    first, second = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert "No space left on device" in first and second.strip() == "5"
    assert "env/infra_retries" not in trajectory.metrics


async def test_a_submission_that_fills_the_workdir_gets_its_score_not_an_error(env):
    fill = "open('/work/fill', 'wb').write(b'0' * (8 << 20))\n"
    trajectory = await episode(env, HookPolicy([submit(fill + reference_code(TASK))]), TASK)
    assert trajectory.status == "ok" and trajectory.reward == 0.0  # the candidate's doing: its score
    assert trajectory.metrics["reward/tests_passed"] == 0.0
    assert "env/infra_retries" not in trajectory.metrics
