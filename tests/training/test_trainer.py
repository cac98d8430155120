"""Trainer smoke tests on a tiny randomly initialised model and a registered toy environment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from builders import tiny_overrides

from toolgym.errors import ConfigError
from toolgym.training.config import load_config
from toolgym.training.trainer import Trainer

TINY = tiny_overrides(steps=3)


async def test_tiny_training_changes_parameters_and_writes_logs(tmp_path: Path) -> None:
    config = load_config(
        None,
        [
            *TINY,
            'curriculum.stages=[["answer"], ["answer", "lookup"]]',
            "curriculum.min_stay=1",
            "curriculum.patience=1",
            "curriculum.min_attempts=1",
            "curriculum.success_threshold=0.99",
            "curriculum.unsolved_threshold=0.5",
        ],
    )
    trainer = Trainer(config, tmp_path)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    history = await trainer.run()
    assert len(history) == 3
    assert all(torch.isfinite(torch.tensor(m["loss/pg"])) for m in history)
    changed = sum(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert changed > 0
    assert trainer.policy.policy_version == 3
    lines = (tmp_path / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 3 * 2 * 4
    record = json.loads(lines[0])
    assert {"step", "group", "sample", "advantage", "trained", "trajectory"} <= set(record)
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1.0, 2.0, 3.0]
    for key in (
        "reward/mean",
        "loss/pg",
        "staleness/mean",
        "mismatch/kl",
        "time/generate",
        "time/env",
        "time/learn",
        "time/queue_wait",
        "curriculum/stage",
        "tool/answer/calls",
        "use/searched",  # the environment's tool-use measures, a mean over the step's episodes
    ):
        assert key in metrics[0], key
    episodes = [json.loads(x)["trajectory"] for x in lines[:8]]  # step 1's
    assert metrics[0]["use/searched"] == sum(t["metrics"]["use/searched"] for t in episodes) / 8
    # nothing solved at 0.99 letters share -> the unsolved signal unlocks "lookup" after one step
    assert metrics[-1]["curriculum/stage"] == 1.0
    assert json.loads((tmp_path / "curriculum.jsonl").read_text())["tools"] == ["answer", "lookup"]
    assert (tmp_path / "checkpoint.pt").is_file()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["kind"] == "train" and manifest["env"]["id"] == config.env.id
    assert len(manifest["env"]["data_sha256"]) == 64 and manifest["run"]["task_ids"] == trainer.task_ids
    assert manifest["run"]["seed"] == config.train.seed and manifest["policy"]["kind"] == "tiny"
    # the first step samples with the learner's own weights: ratios are 1 and the mismatch is ~0
    assert metrics[0]["staleness/mean"] == 0.0 and metrics[0]["mismatch/kl"] < 1e-4


async def test_async_lookahead_bounds_staleness(tmp_path: Path) -> None:
    config = load_config(
        None, [*TINY, "train.rollouts.max_off_policy_steps=1", "train.rollouts.workers=3", "train.steps=4"]
    )
    history = await Trainer(config, tmp_path).run()
    assert all(m["staleness/max"] <= 1 for m in history)
    assert len((tmp_path / "trajectories.jsonl").read_text().splitlines()) == 4 * 2 * 4


def test_unknown_env_id_says_did_you_mean(tmp_path: Path) -> None:
    config = load_config(None, ["env.id=toolgym/SerchQA-v0", "policy.kind=tiny"])
    with pytest.raises(ConfigError, match="(?i)did you mean"):
        Trainer(config, tmp_path)


async def test_a_learner_out_of_memory_stops_the_run_naming_what_to_lower_and_a_rerun_resumes(
    tmp_path: Path, monkeypatch
) -> None:
    """A CUDA out-of-memory error in the second step's gradient (injected: the CPU has none) stops the
    run with RunStopped naming the settings; the first step's checkpoint resumes the same run."""
    from toolgym.errors import RunStopped
    from toolgym.training.distributed import learners

    real, calls = learners.accumulate_gradients, []

    def second_step_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(learners, "accumulate_gradients", second_step_fails)
    config = load_config(None, [*tiny_overrides(steps=2), "train.checkpoint_every=1"])
    trainer = Trainer(config, tmp_path)
    try:
        with pytest.raises(RunStopped) as info:
            await trainer.run()
    finally:
        trainer.close()
    message = str(info.value)
    assert "ran out of memory on cpu in step 2 (CUDA out of memory. Tried to allocate 2.00 GiB)" in message
    assert (
        "train.batching.micro_batch_tokens (now 0: passes of up to micro_batch x max_total_tokens" in message
    )
    assert "train.batching.checkpoint_layers = true" in message and "memory estimate on cpu" in message
    assert "resumes from the last checkpoint" in message
    monkeypatch.setattr(learners, "accumulate_gradients", real)
    again = Trainer(config, tmp_path)
    try:
        assert again.resume() and again.step == 1
        history = await again.run()
    finally:
        again.close()
    assert [m["step"] for m in history] == [2.0] and again.step == 2
