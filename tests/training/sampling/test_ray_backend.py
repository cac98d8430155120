"""The Ray backend on a local Ray instance: environment actors, the same trajectories, a full training run.

The CLI test starts and stops its own local instance (the backend owns it); the other tests share one
module-scoped instance and check that pools on it leave it running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch
from builders import tiny_overrides

from toolgym.agents.harness import get_harness
from toolgym.agents.policies.base import ScriptedPolicy
from toolgym.agents.rollout import run_episode
from toolgym.cli import main
from toolgym.core import Trajectory, sampled_ids_hash
from toolgym.errors import ConfigError, InfraError
from toolgym.training.config import load_config
from toolgym.training.sampling.ray_envs import ActorEnv, EnvActorPool
from toolgym.training.sampling.workers import make_env
from toolgym.training.tiny_policy import tiny_model

TINY = tiny_overrides()

SEARCH_TURNS = [
    '<tool_call>{"name": "search", "arguments": {"query": "capital city of France", "k": 2}}</tool_call>',
    '<tool_call>{"name": "answer", "arguments": {"answer": "Paris"}}</tool_call>',
]


def _without_timings(t: Trajectory) -> Trajectory:
    return dataclasses.replace(t, timings={})


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines()]


def test_backend_is_a_config_field_with_did_you_mean() -> None:
    assert load_config(None, []).train.rollouts.backend == "asyncio"
    assert load_config(None, ["train.rollouts.backend=ray"]).train.rollouts.backend == "ray"
    with pytest.raises(ConfigError, match="Did you mean 'ray'"):
        load_config(None, ["train.rollouts.backend=rya"])
    with pytest.raises(ConfigError, match="ray_env_actors"):
        load_config(None, ["train.rollouts.ray_env_actors=0"])


def test_cli_backend_flag_is_the_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import toolgym.training.commands as commands

    seen: list[list[str]] = []
    monkeypatch.setattr(
        commands, "train_command", lambda config, overrides, out: seen.append(overrides) or out
    )
    assert main(["train", "--out", str(tmp_path), "--backend", "ray", "train.steps=1"]) == 0
    assert seen == [["train.steps=1", "train.rollouts.backend=ray"]]
    with pytest.raises(SystemExit):
        main(["train", "--backend", "rya"])


@pytest.mark.slow
def test_cli_train_on_ray_matches_asyncio_and_shuts_ray_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not ray.is_initialized()
    made: list[ActorEnv] = []
    real_make = EnvActorPool.make

    def spy_make(self: EnvActorPool) -> ActorEnv:
        made.append(real_make(self))
        return made[-1]

    monkeypatch.setattr(EnvActorPool, "make", spy_make)
    ray_dir, local_dir = tmp_path / "ray", tmp_path / "asyncio"
    assert main(["train", "--out", str(ray_dir), *TINY, "train.rollouts.backend=ray"]) == 0
    # every episode ran on actor slots: 2 workers x group of 4 concurrent episodes
    assert len(made) == 2 * 4 and all(isinstance(env, ActorEnv) for env in made)
    # the backend started its own local instance, so it shut it down
    assert not ray.is_initialized()
    assert json.loads((ray_dir / "config.json").read_text())["train"]["rollouts"]["backend"] == "ray"
    assert main(["train", "--out", str(local_dir), *TINY]) == 0

    records = _records(ray_dir)
    assert len(records) == 2 * 2 * 4
    for record in records:
        t = Trajectory.from_json(json.dumps(record["trajectory"]))
        assert t.status in ("ok", "truncated")
        assert len(t.token_ids) == len(t.loss_mask) == len(t.logprobs)
        assert sum(t.loss_mask) > 0
        assert t.token_hash == sampled_ids_hash(t.token_ids, t.loss_mask)
        # NOTE: look-ahead 0: step s trains on groups sampled by version s - 1, stamped by the learner
        assert t.policy_version == record["step"] - 1
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if not m)
    metrics = [json.loads(x) for x in (ray_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1.0, 2.0]
    assert all(torch.isfinite(torch.tensor(m["loss/pg"])) for m in metrics)
    assert metrics[0]["staleness/max"] == 0.0

    # parameters changed, and exactly as the in-process backend changed them (look-ahead 0 is bitwise
    # deterministic on CPU, so the backend must not alter a single sample)
    initial = tiny_model(hidden=32, layers=2, seed=0).state_dict()
    trained = torch.load(ray_dir / "checkpoint.pt", weights_only=False)["model"]
    local = torch.load(local_dir / "checkpoint.pt", weights_only=False)["model"]
    assert any(not torch.equal(initial[k], trained[k]) for k in initial)
    assert all(torch.equal(trained[k], local[k]) for k in local)
    for a, b in zip(records, _records(local_dir), strict=True):
        ta = Trajectory.from_json(json.dumps(a["trajectory"]))
        tb = Trajectory.from_json(json.dumps(b["trajectory"]))
        assert _without_timings(ta) == _without_timings(tb)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 1024**2)
    try:
        yield
    finally:
        ray.shutdown()
    assert not ray.is_initialized()


@pytest.mark.slow
async def test_env_actor_gives_the_in_process_trajectory_on_searchqa(local_ray: None) -> None:
    pool = EnvActorPool("toolgym/SearchQA-v0", {}, actors=1)
    try:
        actor_pid = ray.get(pool.actors[0].pid.remote())
        assert actor_pid != os.getpid()
        harness = get_harness("bare")
        seeds = [3, 11, 29]
        # three slots of one actor, stepped concurrently: episodes must not leak into each other
        remote = await asyncio.gather(
            *(run_episode(pool.make(), ScriptedPolicy(SEARCH_TURNS), harness, seed=s) for s in seeds)
        )
        for seed, got in zip(seeds, remote, strict=True):
            env = make_env("toolgym/SearchQA-v0", {})
            try:
                want = await run_episode(env, ScriptedPolicy(SEARCH_TURNS), harness, seed=seed)
            finally:
                env.close()
            assert got.env_id == "toolgym/SearchQA-v0" and got.status == "ok"
            assert any(m["role"] == "tool" and "[" in m["content"] for m in got.messages)
            assert _without_timings(got) == _without_timings(want)
        assert len({t.task_id for t in remote}) == len(seeds)
    finally:
        pool.close()
    assert ray.is_initialized()  # the pool joined a running instance: it leaves it running


async def test_env_exceptions_come_back_as_themselves(local_ray: None) -> None:
    with pytest.raises(ConfigError, match="(?i)did you mean"):
        EnvActorPool("toolgym/SerchQA-v0", {}, actors=1)
    pool = EnvActorPool("toolgym/SearchQA-v0", {}, actors=1)
    try:
        env = pool.make()
        with pytest.raises(ConfigError, match="unknown reset option 'task'"):
            await env.areset(seed=0, options={"task": "x"})
    finally:
        pool.close()


async def test_a_dead_actor_is_an_infra_error_and_is_restarted(local_ray: None) -> None:
    pool = EnvActorPool("toolgym/SearchQA-v0", {}, actors=1)
    try:
        env: ActorEnv = pool.make()
        await env.areset(seed=0)
        pid = ray.get(pool.actors[0].pid.remote())
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(InfraError):
            await env.astep(SEARCH_TURNS[0])
        # Ray restarts the actor empty: the lost episode stays an infra error, a new one runs
        trajectory = await run_episode(env, ScriptedPolicy(SEARCH_TURNS), get_harness("bare"), seed=0)
        assert trajectory.status == "ok"
        assert ray.get(pool.actors[0].pid.remote()) != pid
    finally:
        pool.close()


def test_too_many_actors_for_the_cluster_fail_at_start_up(local_ray: None) -> None:
    with pytest.raises(ConfigError, match="ray_env_actors"):
        EnvActorPool("toolgym/SearchQA-v0", {}, actors=3)


def test_a_run_without_an_address_starts_its_own_ray_and_one_with_an_address_joins(monkeypatch) -> None:
    """Without RAY_ADDRESS a run starts a local instance even where a `ray start` cluster lives (Ray's
    default would try to join that one, and refuse the run's CPU count); with it, the run joins."""
    from toolgym.training.distributed import ray_cluster

    class FakeRay:
        def __init__(self) -> None:
            self.inits: list[dict] = []
            self.up = False

        def is_initialized(self) -> bool:
            return self.up

        def init(self, **kwargs) -> None:
            self.inits.append(kwargs)
            self.up = True

        def shutdown(self) -> None:
            self.up = False

    fake = FakeRay()
    monkeypatch.setattr(ray_cluster, "require_ray", lambda: fake)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray_cluster.acquire_ray(2)
    ray_cluster.release_ray()
    assert fake.inits[0]["address"] == "local" and fake.inits[0]["num_cpus"] == 2 and not fake.up
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    ray_cluster.acquire_ray(2)
    ray_cluster.release_ray()
    assert fake.inits[1] == {"include_dashboard": False}
