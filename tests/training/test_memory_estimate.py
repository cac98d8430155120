"""The start-up memory estimate: its parts follow the config, and its activations are measured on the model."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from builders import tiny_overrides

from toolgym.training.config import load_config
from toolgym.training.learn.lora import apply_lora
from toolgym.training.memory_estimate import GiB, activation_bytes_per_token, estimate_memory
from toolgym.training.progress import RunProgress
from toolgym.training.tiny_policy import tiny_model
from toolgym.training.trainer import Trainer


@pytest.fixture
def model() -> torch.nn.Module:
    return tiny_model(hidden=32, seed=0)


def saved_bytes(model: torch.nn.Module, tokens: int) -> int:
    """Bytes of every tensor autograd saves in a whole forward pass and loss of ``tokens`` tokens."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in weights:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=torch.ones((1, tokens), dtype=torch.long)).last_hidden_state.sum()
    return sum(saved.values())


def test_activations_per_token_are_the_saved_tensors_of_a_pass_and_scale_with_it(model):
    per_token = activation_bytes_per_token(model)
    assert per_token == activation_bytes_per_token(model, tokens=96)  # linear in the tokens
    # what the decoder keeps for a 300-token pass, counted independently, is the estimate's
    assert saved_bytes(model.get_decoder(), 300) == pytest.approx(300 * per_token, rel=0.02)
    apply_lora(model, load_config(None, ["train.lora.rank=4"]).train.lora, seed=0)
    # frozen weights keep no input for their own gradient; the adapters add little
    assert activation_bytes_per_token(model) != per_token
    assert all(p.grad is None for p in model.parameters())  # the probe never runs a backward pass


def test_the_parts_follow_the_config(model):
    params = sum(p.numel() for p in model.parameters())
    base = ["policy.kind=tiny", "env.max_total_tokens=1024", "train.batching.micro_batch=4"]
    plain = estimate_memory(load_config(None, base), model, per_token=1000)
    assert plain.learner["weights"] == 4 * params and plain.learner["gradients"] == 4 * params
    assert plain.learner["AdamW"] == 8 * params and plain.learner["reference"] == 0
    assert plain.tokens == 4 * 1024 + 1024  # the budget and one shared prefix
    assert plain.learner["activations"] == plain.tokens * 1000
    assert plain.learner["scoring"] == 3 * plain.tokens * 258 * 4  # small logits are scored whole
    budget = estimate_memory(
        load_config(
            None, [*base, "train.batching.micro_batch_tokens=2048", "train.batching.share_prefix=false"]
        ),
        model,
        per_token=1000,
    )
    assert budget.tokens == 2048
    kl = estimate_memory(load_config(None, [*base, "train.loss.kl_coef=0.1"]), model, per_token=1000)
    assert kl.learner["reference"] == kl.learner["weights"]
    engine = estimate_memory(
        load_config(None, ["policy.kind=vllm", "policy.kv_cache_gib=2", "policy.dtype=bfloat16"]),
        model,
        per_token=1000,
    )
    assert engine.sampler == {"engine weights": 2 * params, "KV cache": 2 * GiB}
    assert set(estimate_memory(load_config(None, ["policy.kind=hf"]), model, per_token=1).sampler) == {
        "prefix cache"
    }
    apply_lora(model, load_config(None, ["train.lora.rank=4"]).train.lora, seed=0)
    lora = estimate_memory(load_config(None, base), model, per_token=1000)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora.learner["gradients"] == 4 * trainable < plain.learner["gradients"] / 4
    assert "learner at most" in plain.describe() and f"{plain.tokens:,} tokens" in plain.describe()


def test_the_trainer_says_its_estimate_at_start(tmp_path: Path):
    out = io.StringIO()
    trainer = Trainer(
        load_config(None, tiny_overrides()), tmp_path, progress=RunProgress(out, terminal=False)
    )
    try:
        assert trainer.memory is not None and trainer.memory.learner["weights"] > 0
        assert "memory estimate on cpu: learner at most" in out.getvalue()
    finally:
        trainer.close()


def test_checkpointed_layers_shrink_the_activations_but_not_the_prefix_s(model):
    base = ["policy.kind=tiny", "env.max_total_tokens=1024", "train.batching.micro_batch=4"]
    plain = estimate_memory(load_config(None, base), model)
    checkpointed = estimate_memory(load_config(None, [*base, "train.batching.checkpoint_layers=true"]), model)
    per_token = activation_bytes_per_token(model)
    assert plain.learner["activations"] == plain.tokens * per_token
    layer_inputs = activation_bytes_per_token(model, checkpoint=True)
    assert layer_inputs < per_token / 2
    # the pass: layer inputs plus the one layer being recomputed; the shared prefix's pass: plain
    expected = 4 * 1024 * (layer_inputs + per_token // 2) + 1024 * per_token
    assert checkpointed.learner["activations"] == expected < plain.learner["activations"]
