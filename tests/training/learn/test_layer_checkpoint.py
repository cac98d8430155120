"""Checkpointed decoder layers give the same loss and gradient, keep fewer activations, and run again."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from builders import tiny_overrides, trajectory

from toolgym.errors import ConfigError
from toolgym.training.config import load_config
from toolgym.training.learn.batching import Sample
from toolgym.training.learn.grpo import StepPlan, StepSettings, accumulate_gradients
from toolgym.training.learn.layer_checkpoint import decoder_layers
from toolgym.training.learn.loss import LossConfig
from toolgym.training.memory_estimate import activation_bytes_per_token
from toolgym.training.tiny_policy import tiny_model
from toolgym.training.trainer import Trainer

TOL = 1e-5


def plan_of(vocab: int, prompt_len: int, groups: list[list[int]], seed: int = 0) -> StepPlan:
    """Groups that share a prompt, each with its own question, then per-sample turns of the given lengths
    (sampled and tool-output stretches alternating)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    out = []
    for g, lengths in enumerate(groups):
        question = [rng.randrange(vocab) for _ in range(5 + g)]
        group = []
        for i, n in enumerate(lengths):
            own = [rng.randrange(vocab) for _ in range(n)]
            ids = prompt + question + own
            mask = [0] * (prompt_len + len(question)) + [1 if (j // 7) % 2 == 0 else 0 for j in range(n)]
            logprobs = [-rng.uniform(0.05, 3.0) if m else 0.0 for m in mask]
            sample = Sample(
                trajectory(ids, mask, logprobs=logprobs, reward=0.0), (-1.0) ** i * (0.4 + i / 10)
            )
            group.append(replace(sample, group=g, index=i))
        out.append(tuple(group))
    return StepPlan(advantages=tuple((0.0,) * len(g) for g in out), groups=tuple(out), zero_variance=0)


def gradient(
    model: torch.nn.Module, plan: StepPlan, **settings
) -> tuple[object, dict[str, torch.Tensor], int]:
    """Loss sums, gradient and how many times the decoder layers' attention ran (a recomputation calls
    the layer's forward itself, not the module, so the count is taken one level down)."""
    model.zero_grad(set_to_none=True)
    calls = [0]
    hooks = [
        next(layer.children()).register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        for layer in decoder_layers(model)
    ]
    try:
        sums = accumulate_gradients(model, plan, StepSettings(LossConfig(), temperature=0.8, **settings))
    finally:
        for hook in hooks:
            hook.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return sums, grads, calls[0]


def assert_same(a, b) -> None:
    (sums_a, grads_a, _), (sums_b, grads_b, _) = a, b
    assert sums_b.pg == pytest.approx(sums_a.pg, abs=TOL) and sums_b.entropy == pytest.approx(
        sums_a.entropy, abs=TOL
    )
    assert sums_b.mismatch_kl == pytest.approx(sums_a.mismatch_kl, abs=TOL)
    assert grads_a.keys() == grads_b.keys()
    largest = max(float(g.abs().max()) for g in grads_a.values())
    assert largest > 1e-4
    assert max(float((grads_a[k] - grads_b[k]).abs().max()) for k in grads_a) < TOL * max(1.0, largest)


@pytest.mark.parametrize("share", [False, True])
def test_checkpointed_layers_give_the_same_loss_and_gradient(share) -> None:
    model = tiny_model(hidden=32, layers=3, seed=5).float()
    plan = plan_of(258, 40, [[12, 30, 4], [25, 9, 17]])
    plain = gradient(model, plan, micro_batch=2, share_prefix=share)
    checkpointed = gradient(model, plan, micro_batch=2, share_prefix=share, checkpoint_layers=True)
    assert_same(plain, checkpointed)
    # the layers really ran again in the backward pass (a switch that did nothing would fail here)
    assert checkpointed[2] > plain[2]
    assert all("forward" not in vars(layer) for layer in decoder_layers(model))  # unwrapped after


def test_a_checkpointed_pass_keeps_a_fraction_of_the_activations() -> None:
    # the bytes autograd saves a token (counted independently of the probe in test_memory_estimate)
    model = tiny_model(hidden=64, layers=4, seed=0).float()
    plain = activation_bytes_per_token(model, tokens=200)
    checkpointed = activation_bytes_per_token(model, tokens=200, checkpoint=True)
    assert checkpointed < plain / 4, (plain, checkpointed)


@pytest.mark.model
def test_checkpointed_layers_on_smollm2_give_the_same_gradient() -> None:
    """The embedded model, two groups sharing a prompt: the step's prompt and each group's question
    computed once, the suffixes checkpointed."""
    from toolgym.agents.policies.models import smollm2_path
    from toolgym.training.policy_build import learner_model

    model = learner_model(smollm2_path(show_progress=False))
    plan = plan_of(49152, 60, [[20, 35], [28, 11]], seed=3)
    plain = gradient(model, plan, micro_batch=2, share_prefix=True)
    checkpointed = gradient(model, plan, micro_batch=2, share_prefix=True, checkpoint_layers=True)
    assert checkpointed[2] > plain[2]
    (sums_a, grads_a, _), (sums_b, grads_b, _) = plain, checkpointed
    assert sums_b.pg == pytest.approx(sums_a.pg, abs=TOL)
    largest = max(float(g.abs().max()) for g in grads_a.values())
    # 135M float32 gradients: the recomputed forward rounds the same way, so the gradient agrees to the
    # float sums' order (relative to the largest gradient, as in test_prefix's SmolLM2 test)
    assert max(float((grads_a[k] - grads_b[k]).abs().max()) for k in grads_a) < 1e-4 * largest


def test_checkpointed_layers_with_fsdp2_shards_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint_layers with train\.learners\.shard = 'fsdp2'"):
        load_config(
            None,
            [
                "policy.kind=tiny",
                "train.learners.count=2",
                "train.learners.shard=fsdp2",
                "train.batching.checkpoint_layers=true",
            ],
        )


@pytest.mark.slow
async def test_a_run_with_checkpointed_layers_trains_the_same_weights(tmp_path: Path) -> None:
    weights = []
    for on in (False, True):
        config = load_config(
            None, [*tiny_overrides(steps=2), f"train.batching.checkpoint_layers={str(on).lower()}"]
        )
        trainer = Trainer(config, tmp_path / str(on))
        history = await trainer.run()
        weights.append(
            ([m["loss/pg"] for m in history], [p.detach().clone() for p in trainer.model.parameters()])
        )
        trainer.close()
    (losses_a, a), (losses_b, b) = weights
    assert losses_b == pytest.approx(losses_a, abs=TOL)
    assert max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True)) < 1e-5
