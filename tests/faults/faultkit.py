"""Shared pieces of the fault-injection suite: canned policies with injection points, Docker controls.

Faults are injected at a known point of an episode (before the policy's turn ``n``) rather than at a
time, so each case is deterministic: the part is broken exactly when the next tool or verifier call
needs it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from toolgym.agents.harness import get_harness
from toolgym.agents.policies.base import ScriptedPolicy
from toolgym.agents.rollout import run_episode
from toolgym.core import SamplingParams, Trajectory
from toolgym.parsing import format_tool_call

REPO = Path(__file__).resolve().parents[2]
#: ScriptedPolicy cuts a canned turn at ``max_tokens`` bytes; submissions are longer than the default.
LONG = SamplingParams(max_tokens=16_000)


def require_docker() -> None:
    if os.environ.get("TOOLGYM_SKIP_DOCKER") == "1":
        pytest.skip("TOOLGYM_SKIP_DOCKER=1 asks to skip Docker tests")


class HookPolicy(ScriptedPolicy):
    """Replays canned turns; ``hooks[n]`` runs (in a thread) just before turn ``n`` (1-based) is produced."""

    def __init__(self, turns: Sequence[str], hooks: dict[int, Callable[[], None]] | None = None) -> None:
        super().__init__(turns)
        self.hooks = dict(hooks or {})

    async def generate(self, token_ids, sampling):  # type: ignore[no-untyped-def]
        hook = self.hooks.get(self._next + 1)
        if hook is not None:
            await asyncio.to_thread(hook)
        return await super().generate(token_ids, sampling)


def python(code: str) -> str:
    return format_tool_call("python", {"code": code})


def submit(code: str) -> str:
    return format_tool_call("submit", {"code": code})


async def episode(env, policy, task_id: str) -> Trajectory:  # type: ignore[no-untyped-def]
    return await run_episode(
        env,
        policy,
        get_harness("bare"),
        seed=0,
        options={"task_id": task_id},
        sampling=LONG,
        max_total_tokens=100_000,
    )


# ------------------------------------------------------------------ Docker, from the outside
def docker(*args: str, timeout: float = 60) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=True)
    return done.stdout


def containers_of(instance: str) -> list[str]:
    """Running container ids of one DockerSandbox instance (by its label), as an operator sees them."""
    return docker("ps", "-q", "--filter", f"label=toolgym.sandbox.instance={instance}").split()


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
    """Wait until ``condition()`` holds (a precondition of the injection, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} after {timeout:g} s")
        time.sleep(0.1)


def docker_answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0


def dockerd_pids() -> list[int]:
    done = subprocess.run(["pgrep", "-x", "dockerd"], capture_output=True, text=True)
    return [int(pid) for pid in done.stdout.split()]


def stop_dockerd() -> None:
    """Stop the Docker engine the way an operator does (SIGTERM) and wait until it is gone."""
    pids = dockerd_pids()
    assert pids, (
        "no dockerd process: this test stops and restarts the engine that .ci/docker.sh starts "
        "(set TOOLGYM_SKIP_DOCKER=1 on a machine whose engine runs elsewhere)"
    )
    for pid in pids:
        os.kill(pid, signal.SIGTERM)

    def gone() -> bool:
        return not any(Path(f"/proc/{pid}").exists() for pid in pids)

    wait_for(gone, "dockerd to exit")
    assert not docker_answers()


def start_dockerd() -> None:
    """Start the engine exactly as CI does (``.ci/docker.sh``), which waits until ``docker info`` answers."""
    subprocess.run(["bash", str(REPO / ".ci" / "docker.sh")], check=True, timeout=300, start_new_session=True)
    assert docker_answers()


# ------------------------------------------------------------------ an environment with a verifier bug
BROKEN_VERIFIER_ID = "toolgym-test/LettersBrokenVerifier-v0"


class _BrokenVerifier:
    def score(self, task, answer, trajectory):  # type: ignore[no-untyped-def]
        from toolgym.errors import VerifierError

        raise VerifierError(f"the reference of {task.id} cannot be checked (injected bug)")


def _broken_letters(**kwargs):  # type: ignore[no-untyped-def]
    from toy_env import LettersEnv

    env = LettersEnv(**kwargs)
    env.verifier = _BrokenVerifier()
    return env


def _register() -> None:
    import gymnasium

    if BROKEN_VERIFIER_ID not in gymnasium.registry:
        gymnasium.register(id=BROKEN_VERIFIER_ID, entry_point=_broken_letters)


_register()
