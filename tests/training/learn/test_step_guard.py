"""A non-finite number in a step never reaches the weights: the step is skipped, counted, kept for
inspection, and too many in a row stop the run."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from builders import tiny_overrides

from toolgym.core import SamplingParams
from toolgym.training.config import load_config
from toolgym.training.experiments.report import write_report
from toolgym.training.learn import grpo
from toolgym.training.learn.optim import LearnerOptimizer, ScheduleConfig
from toolgym.training.learn.step_guard import NonFiniteSteps
from toolgym.training.tiny_policy import TinyPolicy
from toolgym.training.trainer import Trainer


class NaNLogprobPolicy(TinyPolicy):
    """The tiny policy, but the first sampled token of every completion reports a NaN logprob."""

    def _generate(self, token_ids: list[int], sampling: SamplingParams):  # type: ignore[override]
        completion = super()._generate(token_ids, sampling)
        return dataclasses.replace(completion, logprobs=(math.nan, *completion.logprobs[1:]))


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b.parameters(), strict=True))


def _config(*extra: str):
    return load_config(None, [*tiny_overrides(steps=2), "train.skip_zero_variance=false", *extra])


async def test_a_nan_logprob_skips_the_step_and_leaves_every_weight_untouched(tmp_path: Path) -> None:
    config = _config("train.max_nonfinite_steps=3")
    policy = NaNLogprobPolicy(hidden=32, seed=config.train.seed)
    trainer = Trainer(config, tmp_path, policy=policy)
    before = _weights(trainer.model)
    history = await trainer.run()
    assert [m["train/skipped"] for m in history] == [1.0, 1.0]
    assert [m["train/skipped_steps"] for m in history] == [1.0, 2.0]
    assert [m["train/updated"] for m in history] == [0.0, 0.0]
    assert _same(before, trainer.model)  # before the guard: every weight NaN after the first step
    assert policy.policy_version == 0  # nothing was published
    kept = [json.loads(line) for line in (tmp_path / "nonfinite" / "step-1.jsonl").read_text().splitlines()]
    assert len(kept) == 2 * 4 and {k["reason"] for k in kept} == {"logprobs"}
    assert math.isnan(kept[0]["trajectory"]["logprobs"][kept[0]["trajectory"]["loss_mask"].index(1)])
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    page = write_report(tmp_path).read_text()
    assert '<p id="skipped" class="warning">2 step(s) skipped' in page and "steps\n1, 2;" in page


async def test_too_many_skipped_steps_in_a_row_stop_the_run_with_a_fix(tmp_path: Path) -> None:
    config = _config("train.max_nonfinite_steps=2")
    trainer = Trainer(config, tmp_path, policy=NaNLogprobPolicy(hidden=32, seed=config.train.seed))
    with pytest.raises(
        NonFiniteSteps, match=r"2 steps in a row \(the last, step 2\) had a non-finite behaviour logprob"
    ):
        await trainer.run()
    assert (tmp_path / "nonfinite" / "step-2.jsonl").is_file()


async def test_a_nan_loss_with_finite_logprobs_skips_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = grpo.mismatch_kl
    monkeypatch.setattr(grpo, "mismatch_kl", lambda *a, **k: real(*a, **k) * math.nan)
    config = _config("train.max_nonfinite_steps=5")
    trainer = Trainer(config, tmp_path)
    before = _weights(trainer.model)
    history = await trainer.run()
    assert [m["train/skipped"] for m in history] == [1.0, 1.0]
    assert _same(before, trainer.model)
    assert {json.loads(line)["reason"] for line in (tmp_path / "nonfinite" / "step-2.jsonl").open()} == {
        "loss"
    }


def test_the_optimizer_skips_a_nan_gradient_without_touching_weights_moments_or_schedule() -> None:
    layer = torch.nn.Linear(3, 2).to(torch.bfloat16)  # low precision: fp32 master copies too
    opt = LearnerOptimizer(layer.parameters(), lr=0.1, schedule=ScheduleConfig("linear", total_steps=4))
    before, lr = _weights(layer), opt.lr
    layer(torch.ones(1, 3, dtype=torch.bfloat16)).sum().backward()
    layer.weight.grad[0, 0] = math.nan
    norm = opt.step(1.0)
    assert math.isnan(norm) and opt.last_skipped
    assert _same(before, layer) and opt.optimizer.state == {} and opt.steps == 0 and opt.lr == lr
    assert all(p.grad is None for p in layer.parameters())
    layer(torch.ones(1, 3, dtype=torch.bfloat16)).sum().backward()
    assert math.isfinite(opt.step(1.0, finite_loss=False)) and opt.last_skipped and _same(before, layer)
    layer(torch.ones(1, 3, dtype=torch.bfloat16)).sum().backward()
    opt.step(1.0)
    assert not opt.last_skipped and opt.steps == 1 and not _same(before, layer)
