"""The learner's optimizer: learning-rate schedules (exact values), fp32 master weights for bf16
models, and a state that resumes bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from toolgym.errors import ConfigError
from toolgym.training.learn.optim import LearnerOptimizer, ScheduleConfig, lr_factor


def test_constant_schedule_with_warmup() -> None:
    config = ScheduleConfig(name="constant", warmup_steps=4, total_steps=10)
    assert [lr_factor(config, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_and_cosine_end_at_the_floor() -> None:
    linear = ScheduleConfig(name="linear", warmup_steps=0, total_steps=5, min_lr_ratio=0.2)
    assert [lr_factor(linear, s) for s in range(5)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    cosine = ScheduleConfig(name="cosine", warmup_steps=2, total_steps=6)
    values = [lr_factor(cosine, s) for s in range(6)]
    assert values[:2] == [0.5, 1.0]
    assert values[2:] == pytest.approx(
        [1.0, 0.5 * (1 + math.cos(math.pi / 3)), 0.5 * (1 + math.cos(2 * math.pi / 3)), 0.0]
    )


def test_unknown_schedule_says_did_you_mean() -> None:
    with pytest.raises(ConfigError, match="Did you mean 'linear'"):
        ScheduleConfig(name="lineer")


def _bf16_model() -> torch.nn.Linear:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.05)
    return model.to(torch.bfloat16)


def _step(model: torch.nn.Module, optimizer: LearnerOptimizer) -> None:
    optimizer.zero_grad()
    model(torch.ones((1, 8), dtype=torch.bfloat16)).sum().backward()
    optimizer.step(max_grad_norm=1e9)


def test_master_weights_keep_small_steps_that_bf16_rounds_away() -> None:
    # AdamW's first steps move each weight by about lr; at 0.05, bf16's spacing is 2.4e-4
    plain = _bf16_model()
    adam = torch.optim.AdamW(plain.parameters(), lr=1e-5, weight_decay=0.0)
    for _ in range(30):
        adam.zero_grad()
        plain(torch.ones((1, 8), dtype=torch.bfloat16)).sum().backward()
        adam.step()
    assert torch.equal(plain.weight, _bf16_model().weight), "plain bf16 AdamW should lose these steps"

    model = _bf16_model()
    optimizer = LearnerOptimizer(model.parameters(), lr=1e-5)
    assert optimizer.has_masters
    for _ in range(30):
        _step(model, optimizer)
    master = optimizer.masters[0].detach()
    assert master.dtype == torch.float32
    # 30 steps of ~1e-5 accumulate in fp32 and reach the bf16 weights once they pass a bf16 step
    assert float((torch.tensor(0.05) - master).abs().min()) > 2.5e-4
    assert bool((model.weight != torch.tensor(0.05, dtype=torch.bfloat16)).all())
    assert torch.equal(model.weight, master.to(torch.bfloat16))


def test_fp32_parameters_are_their_own_master_weights() -> None:
    model = torch.nn.Linear(4, 4)
    optimizer = LearnerOptimizer(model.parameters(), lr=1e-3)
    assert not optimizer.has_masters and optimizer.masters[0] is model.weight


def test_state_dict_resumes_the_schedule_and_the_master_weights() -> None:
    schedule = ScheduleConfig(name="linear", warmup_steps=2, total_steps=10)
    a, b = _bf16_model(), _bf16_model()
    opt_a = LearnerOptimizer(a.parameters(), lr=1e-3, schedule=schedule)
    for _ in range(3):
        _step(a, opt_a)
    opt_b = LearnerOptimizer(b.parameters(), lr=1e-3, schedule=schedule)
    b.load_state_dict(a.state_dict())
    opt_b.load_state_dict(opt_a.state_dict())
    assert opt_b.lr == opt_a.lr == pytest.approx(1e-3 * lr_factor(schedule, 3))
    for _ in range(2):
        _step(a, opt_a)
        _step(b, opt_b)
    assert torch.equal(a.weight, b.weight) and torch.equal(opt_a.masters[0], opt_b.masters[0])


def test_weights_changed_outside_the_optimizer_survive_its_next_step() -> None:
    """A warm start fine-tunes a bf16 model after its optimizer made the masters: reload them, or
    the first RL step writes the old weights back."""
    model = _bf16_model()
    optimizer = LearnerOptimizer(model.parameters(), lr=1e-6)
    with torch.no_grad():
        model.weight.fill_(0.5)  # the warm start's fine-tune, say
    stale = _bf16_model()
    stale_opt = LearnerOptimizer(stale.parameters(), lr=1e-6)
    with torch.no_grad():
        stale.weight.fill_(0.5)
    _step(stale, stale_opt)  # without the reload: back near 0.05
    assert float(stale.weight.detach().float().max()) < 0.06
    optimizer.reload_masters()
    _step(model, optimizer)
    assert float((model.weight.detach().float() - 0.5).abs().max()) < 1e-2


def test_a_model_without_trainable_parameters_is_refused() -> None:
    model = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        LearnerOptimizer(model.parameters(), lr=1e-3)
