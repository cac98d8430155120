"""Faults during a short training run: the policy fails, the engine dies for good, the disk refuses a
checkpoint. The run either goes on (failed episodes are ``infra_error``, counted, never trained on)
or stops with a clear message and resumes from its last checkpoint to exactly the results of an
uninterrupted run: no step lost, none counted twice.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from toolgym.errors import CheckpointError, InfraDown, PolicyError
from toolgym.training import checkpoint
from toolgym.training.config import load_config
from toolgym.training.sampling.workers import GroupSampler
from toolgym.training.tiny_policy import TinyPolicy
from toolgym.training.trainer import Trainer

pytestmark = pytest.mark.faults

STEPS = 4
CONFIG = load_config(
    None,
    [
        "env.id=toy_env:toolgym-test/Letters-v0",
        "policy.kind=tiny",
        "policy.hidden=16",
        "policy.layers=1",
        "sampling.max_tokens=8",
        f"train.steps={STEPS}",
        "train.tasks_per_step=2",
        "train.group_size=2",
        "train.optim.lr=0.01",
        "train.rollouts.max_off_policy_steps=0",  # deterministic: a resumed run must equal the uninterrupted one
        "train.checkpoint_every=1",
        "train.max_infra_groups=2",
        "train.seed=5",
    ],
)


def tiny() -> TinyPolicy:
    pc = CONFIG.policy
    return TinyPolicy(hidden=pc.hidden, layers=pc.layers, seed=CONFIG.train.seed)


class FlakyPolicy(TinyPolicy):
    """Raises :class:`PolicyError` (what a dead vLLM engine or an unreachable server raises) whenever
    ``fails(policy, episode_seed, turn)`` says so."""

    def __init__(self, fails) -> None:  # type: ignore[no-untyped-def]
        pc = CONFIG.policy
        super().__init__(hidden=pc.hidden, layers=pc.layers, seed=CONFIG.train.seed)
        self.fails = fails
        self.turns: dict[int | None, int] = {}
        self.raised = 0

    async def generate(self, token_ids, sampling):  # type: ignore[no-untyped-def]
        turn = self.turns[sampling.seed] = self.turns.get(sampling.seed, 0) + 1
        if self.fails(self, sampling.seed, turn):
            self.raised += 1
            raise PolicyError("the vLLM engine process died (injected)")
        return await super().generate(token_ids, sampling)


async def train(run_dir: Path, policy: TinyPolicy, *, resume: bool = False) -> Trainer:
    trainer = Trainer(CONFIG, run_dir, policy=policy)
    try:
        if resume:
            assert trainer.resume()
        await trainer.run()
    finally:
        trainer.close()
    return trainer


def lines(run_dir: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def comparable(run_dir: Path) -> tuple[list[dict], list[tuple]]:
    metrics = [
        {k: v for k, v in m.items() if not k.startswith("time/")} for m in lines(run_dir, "metrics.jsonl")
    ]
    trajs = [
        (
            r["step"],
            r["group"],
            r["sample"],
            r["advantage"],
            r["trained"],
            tuple(r["trajectory"]["token_ids"]),
        )
        for r in lines(run_dir, "trajectories.jsonl")
    ]
    return metrics, trajs


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[tuple]]:
    import asyncio

    run_dir = tmp_path_factory.mktemp("uninterrupted")
    asyncio.run(train(run_dir, tiny()))
    return comparable(run_dir)


def assert_same_as_uninterrupted(run_dir: Path, uninterrupted: tuple[list[dict], list[tuple]]) -> None:
    metrics, trajs = comparable(run_dir)
    assert [m["step"] for m in metrics] == [float(s) for s in range(1, STEPS + 1)]  # none lost or twice
    assert len({t[:3] for t in trajs}) == len(trajs) == STEPS * 2 * 2  # every sample exactly once
    assert (metrics, trajs) == uninterrupted
    assert torch.load(run_dir / checkpoint.CHECKPOINT_NAME, weights_only=False)["step"] == STEPS


async def test_policy_failures_mid_run_are_counted_and_never_trained_on(tmp_path: Path, capsys) -> None:
    # sample 0 of every other group fails: groups keep a usable sample, so the run must go on
    sampler = GroupSampler(["w0"], group_size=CONFIG.train.group_size, seed=CONFIG.train.seed)
    doomed = {sampler.episode_seed(group, 0) for group in range(0, STEPS * 2, 2)}
    policy = FlakyPolicy(lambda p, seed, turn: seed in doomed)
    await train(tmp_path, policy)
    metrics, records = lines(tmp_path, "metrics.jsonl"), lines(tmp_path, "trajectories.jsonl")
    assert [m["step"] for m in metrics] == [float(s) for s in range(1, STEPS + 1)]  # the run went on
    failed = [r for r in records if r["trajectory"]["status"] == "infra_error"]
    assert len(failed) == policy.raised == len(doomed) == STEPS
    assert {r["trajectory"]["seed"] for r in failed} == doomed
    assert sum(m["env/infra_errors"] for m in metrics) == len(failed)
    assert not any(r["trained"] for r in failed) and any(r["trained"] for r in records)
    assert all(r["trajectory"]["error"].startswith("PolicyError: the vLLM engine") for r in failed)
    assert all(r["trajectory"]["reward"] == 0.0 for r in failed)
    # one episode of four left out each step: past the 5% threshold, every step says so
    printed = capsys.readouterr().out
    for step in range(1, STEPS + 1):
        assert f"WARNING: step {step}: 1 of 4 episodes (25%) ended in infra_error and are left out" in printed


async def test_an_engine_gone_for_good_stops_the_run_which_resumes_with_nothing_lost(
    tmp_path: Path, uninterrupted
) -> None:
    dying = FlakyPolicy(lambda p, seed, turn: p.policy_version >= 2)  # dies after the second step
    with pytest.raises(
        InfraDown, match=r"the last 2 groups .* ended in infra_error .* rerun the same command"
    ):
        await train(tmp_path, dying)
    assert [m["step"] for m in lines(tmp_path, "metrics.jsonl")] == [1.0, 2.0]
    await train(tmp_path, tiny(), resume=True)  # the engine is back
    assert_same_as_uninterrupted(tmp_path, uninterrupted)


class _RefusingOs:
    """``os`` as the checkpoint module sees it, except that ``replace`` fails with a full disk."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def replace(src: Any, dst: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))


@pytest.mark.parametrize("fault", ["full-device", "rename-refused"])
async def test_a_disk_that_refuses_a_checkpoint_stops_the_run_which_resumes_with_nothing_lost(
    tmp_path: Path, uninterrupted, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    from toolgym.training import trainer as trainer_module

    real_save, saves = checkpoint.save_checkpoint, []

    def save(run_dir: Path, state: dict) -> Path:
        saves.append(state["step"])
        if state["step"] == 3:  # the third checkpoint meets the fault
            if fault == "full-device":  # every write to the temporary file fails with ENOSPC
                full = lambda path: open("/dev/full", "wb")  # noqa: E731, SIM115 (the writer closes it)
                monkeypatch.setattr(checkpoint, "create_new", full)
            else:
                monkeypatch.setattr(checkpoint, "os", _RefusingOs())
        return real_save(run_dir, state)

    monkeypatch.setattr(trainer_module, "save_checkpoint", save)
    with pytest.raises(
        CheckpointError, match=r"could not write the checkpoint of step 3 .*No space left"
    ) as info:
        await train(tmp_path, tiny())
    assert "The previous checkpoint is untouched" in str(info.value) and "rerun the same command" in str(
        info.value
    )
    assert torch.load(tmp_path / checkpoint.CHECKPOINT_NAME, weights_only=False)["step"] == 2
    assert not (tmp_path / f".{checkpoint.CHECKPOINT_NAME}.tmp").exists()  # nothing half-written left
    assert len(lines(tmp_path, "metrics.jsonl")) == 3  # step 3 was logged; the resume cuts it back

    monkeypatch.undo()  # the disk is fixed
    await train(tmp_path, tiny(), resume=True)
    assert_same_as_uninterrupted(tmp_path, uninterrupted)


def test_an_unreadable_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    checkpoint.save_checkpoint(tmp_path, {"step": 1})
    path = tmp_path / checkpoint.CHECKPOINT_NAME
    path.write_bytes(path.read_bytes()[:40])  # truncated outside toolgym
    with pytest.raises(CheckpointError, match=r"cannot read the checkpoint .* Fix: restore it"):
        checkpoint.load_checkpoint(tmp_path)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read the checkpoint"):
        checkpoint.load_checkpoint(tmp_path)


def test_env_kwargs_set_the_retry_policy_of_any_toolgym_env() -> None:
    from toolgym.env import RetryPolicy
    from toolgym.errors import ConfigError
    from toolgym.training.sampling.workers import make_env

    env = make_env(
        "toy_env:toolgym-test/Letters-v0", {"infra_retries": 4, "infra_backoff_s": 0.25, "n_tasks": 2}
    )
    try:
        assert env.unwrapped.retry == RetryPolicy(retries=4, backoff_s=0.25)
        assert len(env.unwrapped.tasks) == 2  # the other kwargs still reach the environment
    finally:
        env.close()
    with pytest.raises(ConfigError, match="infra retries must be an integer >= 0"):
        make_env("toy_env:toolgym-test/Letters-v0", {"infra_retries": -1})


def test_infra_guard_counts_only_consecutive_groups_without_a_usable_sample() -> None:
    from toolgym.core import Trajectory
    from toolgym.training.sampling.workers import Group, InfraGuard

    def group(index: int, *statuses: str) -> Group:
        trajs = tuple(
            Trajectory("e", "t", 0, "bare", (), (), (), (), (), 0.0, {}, s, error=f"E{index}")
            for s in statuses
        )
        return Group(index=index, task_id="t", trajectories=trajs)

    guard = InfraGuard(limit=2)
    guard.observe(group(0, "infra_error", "infra_error"))
    guard.observe(group(1, "infra_error", "ok"))  # one usable sample: the infrastructure works
    guard.observe(group(2, "infra_error", "infra_error"))
    assert guard.consecutive == 1
    with pytest.raises(InfraDown, match=r"the last 2 groups \(up to group 3\).*Last error: E3"):
        guard.observe(group(3, "infra_error", "infra_error"))


async def test_a_verifier_bug_stops_the_run_instead_of_being_trained_around(tmp_path: Path) -> None:
    from dataclasses import replace

    from toolgym.errors import VerifierError

    config = replace(CONFIG, env=replace(CONFIG.env, id="faultkit:toolgym-test/LettersBrokenVerifier-v0"))
    trainer = Trainer(config, tmp_path, policy=tiny())
    try:
        with pytest.raises(VerifierError, match="cannot be checked"):
            await trainer.run()
    finally:
        trainer.close()
    assert trainer.step == 0 and not (tmp_path / "metrics.jsonl").exists()  # nothing scored as 0
