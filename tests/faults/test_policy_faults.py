"""A policy whose server is unreachable during a CodeExec evaluation: infra_error episodes, no crash.

(The vLLM engine killed mid-run is tested on the real engine, last in ``tests/agents/policies/test_vllm_policy.py``,
which reuses that module's engine; the training-run cases in ``test_training_faults.py`` use a policy
raising the same :class:`~toolgym.errors.PolicyError` a dead engine raises.)
"""

from __future__ import annotations

import socket

import pytest
from faultkit import episode

from toolgym.agents.policies.http import HTTPPolicy
from toolgym.envs.code_exec import CodeExecEnv

pytestmark = pytest.mark.faults


def closed_port() -> int:
    """A local port nothing listens on: connecting to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_an_unreachable_policy_server_gives_infra_error_episodes_and_the_evaluation_goes_on() -> None:
    policy = HTTPPolicy(f"http://127.0.0.1:{closed_port()}/v1", "served-model", retries=1, backoff_s=0.01)
    env = CodeExecEnv(max_turns=2)  # the episode fails before any tool or verifier call
    try:
        results = [await episode(env, policy, task_id) for task_id in ("HumanEval/0", "HumanEval/1")]
    finally:
        env.close()
    for trajectory in results:
        assert trajectory.status == "infra_error" and trajectory.reward == 0.0
        assert (
            trajectory.error.startswith("PolicyError: http://127.0.0.1:")
            and "ConnectError" in trajectory.error
        )
        assert trajectory.task_id in ("HumanEval/0", "HumanEval/1") and sum(trajectory.loss_mask) == 0
