"""RL that learns: reward must rise under GRPO, and must not without a real gradient.

The tiny byte-level model starts from random weights on ``toolgym-test/Target-v0``: one turn, the
reward is the share of the answer's characters that are the target character, about 1 in 256 at
first. GRPO must take the step-mean reward from below 0.2 to above 0.8 within :data:`STEPS` steps.
The same check must fail with the advantages' sign flipped and with ``lr = 0``: a test that cannot
fail would prove nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from toolgym.training.config import load_config
from toolgym.training.learn import grpo
from toolgym.training.trainer import Trainer

STEPS = 24
LEARN = [
    "env.id=toy_env:toolgym-test/Target-v0",
    "policy.kind=tiny",
    "policy.hidden=32",
    "sampling.max_tokens=8",
    "sampling.temperature=1.0",
    f"train.steps={STEPS}",
    "train.tasks_per_step=2",
    "train.group_size=8",
    "train.optim.lr=0.02",
    "train.rollouts.max_off_policy_steps=0",
    "train.checkpoint_every=0",
]


async def rewards(tmp_path: Path, *overrides: str) -> list[float]:
    trainer = Trainer(load_config(None, [*LEARN, *overrides]), tmp_path)
    try:
        return [m["reward/mean"] for m in await trainer.run()]
    finally:
        trainer.close()


def learned(curve: list[float]) -> bool:
    """The criterion: starts below 0.2, ends (mean of the last three steps) above 0.8."""
    return curve[0] < 0.2 and sum(curve[-3:]) / 3 > 0.8


@pytest.mark.slow
async def test_grpo_raises_the_reward_from_below_02_to_above_08(tmp_path: Path) -> None:
    curve = await rewards(tmp_path)
    assert learned(curve), [round(r, 3) for r in curve]


@pytest.mark.slow
async def test_the_learning_check_fails_when_the_advantages_are_flipped(tmp_path: Path, monkeypatch) -> None:
    real = grpo.group_advantages
    monkeypatch.setattr(grpo, "group_advantages", lambda r, **kw: [-a for a in real(r, **kw)])
    curve = await rewards(tmp_path)
    assert not learned(curve) and max(curve) < 0.2, [round(r, 3) for r in curve]


@pytest.mark.slow
async def test_the_learning_check_fails_at_lr_zero(tmp_path: Path) -> None:
    trainer = Trainer(load_config(None, [*LEARN, "train.optim.lr=0"]), tmp_path)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    try:
        curve = [m["reward/mean"] for m in await trainer.run()]
        after = list(trainer.model.parameters())
    finally:
        trainer.close()
    assert not learned(curve) and max(curve) < 0.2, [round(r, 3) for r in curve]
    assert all(bool((a == b).all()) for a, b in zip(before, after, strict=True)), "lr = 0 changed a weight"


@pytest.mark.parametrize(
    "variant", ["train.loss.agg=seq_mean", "train.loss.ratio=sequence", "train.loss.tis_cap=2"]
)
@pytest.mark.slow
async def test_the_loss_variants_learn_too(tmp_path: Path, variant: str) -> None:
    curve = await rewards(tmp_path, variant, "train.loss.clip_low=0.2", "train.loss.clip_high=0.28")
    assert learned(curve), (variant, [round(r, 3) for r in curve])
