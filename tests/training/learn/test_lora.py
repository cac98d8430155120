"""LoRA through peft: adapters injected in place, only they train, exports carry merged weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from builders import tiny_overrides

from toolgym.errors import ConfigError
from toolgym.training.config import load_config, to_dict
from toolgym.training.learn.lora import LoraConfig, apply_lora, is_lora, plain_state_dict, trainable_count
from toolgym.training.tiny_policy import tiny_model
from toolgym.training.trainer import Trainer

IDS = torch.tensor([[256, 5, 77, 120, 3, 9, 200]])


def _adapted(rank: int = 4) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model = tiny_model(hidden=32, layers=2, seed=1)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, LoraConfig(rank=rank, alpha=8.0), seed=0)
    return model, base


def test_only_the_adapters_train_and_start_as_the_identity() -> None:
    model, base = _adapted()
    assert is_lora(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert trainable_count(model) < sum(p.numel() for p in model.parameters()) / 5
    fresh = tiny_model(hidden=32, layers=2, seed=1)
    with torch.no_grad():  # lora_B starts at 0: the adapted model computes the base model's function
        assert torch.equal(model(IDS).logits, fresh(IDS).logits)
    assert set(plain_state_dict(model)) == set(base)


def test_merged_weights_compute_what_the_adapted_model_computes() -> None:
    model, _ = _adapted()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    merged = tiny_model(hidden=32, layers=2, seed=1)
    merged.load_state_dict(plain_state_dict(model), strict=True)
    with torch.no_grad():
        got, want = merged(IDS).logits, model(IDS).logits
        base = tiny_model(hidden=32, layers=2, seed=1)(IDS).logits
    assert float((got - want).abs().max()) < 1e-5 and float((want - base).abs().max()) > 1e-3


def test_targets_the_model_lacks_are_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="no Linear layers named \\['c_attn'\\]"):
        apply_lora(tiny_model(hidden=32, layers=2), LoraConfig(rank=4, targets=("q_proj", "c_attn")))
    with pytest.raises(ConfigError, match="train.lora.rank must be >= 0"):
        load_config(None, ["train.lora.rank=-1"])


async def test_a_lora_training_run_moves_the_adapters_only(tmp_path: Path) -> None:
    config = load_config(None, [*tiny_overrides(steps=2), "train.lora.rank=4", "train.optim.lr=0.05"])
    trainer = Trainer(config, tmp_path)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    try:
        history = await trainer.run()
    finally:
        trainer.close()
    assert all(m["train/updated"] == 1.0 for m in history)
    params = dict(trainer.model.named_parameters())
    assert all(torch.equal(params[n], v) for n, v in frozen.items())
    assert any(not torch.equal(params[n], v) for n, v in adapters.items())
    resumed = Trainer(config, tmp_path)  # the checkpoint holds the adapters; a resume re-applies LoRA
    try:
        assert resumed.resume() and resumed.step == 2
        assert all(torch.equal(dict(resumed.model.named_parameters())[n], p) for n, p in params.items())
    finally:
        resumed.close()


WARM = ["warm_start.samples=4", "warm_start.min_reward=0.0", "warm_start.epochs=1", "warm_start.lr=0.01"]


async def _warm_started(run: Path, *extra: str) -> Trainer:
    """A tiny trainer after its warm start alone (no RL step); the caller closes it."""
    from toolgym.training.sampling.workers import env_factory

    trainer = Trainer(load_config(None, [*tiny_overrides(steps=1), *WARM, *extra]), run)
    make, free = env_factory("asyncio", trainer.config.env.id, dict(trainer.config.env.kwargs))
    try:
        await trainer.warm_start(make)
    finally:
        free()
    assert json.loads((run / "warm_start.json").read_text())["kept"] > 0
    return trainer


async def test_a_lora_run_warm_starts_the_whole_model_as_a_full_run_does(tmp_path: Path) -> None:
    """The warm start is a full fine-tune whether RL then trains adapters or not: a LoRA run's
    warm-started weights equal a full run's, its adapters are untouched by it, and only they train
    afterwards."""
    full = await _warm_started(tmp_path / "full")
    full.close()
    lora = Trainer(load_config(None, [*tiny_overrides(steps=1), *WARM, "train.lora.rank=4"]), tmp_path / "x")
    adapters = {n: p.detach().clone() for n, p in lora.model.named_parameters() if "lora_" in n}
    lora.close()
    lora = await _warm_started(tmp_path / "lora", "train.lora.rank=4")
    lora.close()
    assert all(torch.equal(p, adapters[n]) for n, p in lora.model.named_parameters() if "lora_" in n)
    trainable = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable), "only the adapters train after it"
    ours, theirs = plain_state_dict(lora.model), full.model.state_dict()
    init = tiny_model(hidden=32, layers=2, seed=0).state_dict()
    assert set(ours) == set(theirs)
    assert any(not torch.equal(theirs[k], init[k]) for k in theirs if k in init), "the warm start trained"
    assert all(float((ours[k] - theirs[k]).abs().max()) < 1e-6 for k in ours)


async def test_a_lora_run_reuses_a_full_runs_warm_start(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    full = await _warm_started(tmp_path / "full")
    full.close()
    warm = {k: v.detach().clone().contiguous() for k, v in full.model.state_dict().items()}
    export = tmp_path / "full" / "export" / "step-000000"  # the tiny policy writes no export of its own
    export.mkdir(parents=True)
    save_file(warm, str(export / "model.safetensors"))
    (tmp_path / "full" / "config.json").write_text(json.dumps(to_dict(full.config)))  # run() writes it
    reuse = f"warm_start.reuse={tmp_path / 'full'}"
    config = load_config(None, [*tiny_overrides(steps=1), *WARM, reuse, "train.lora.rank=4"])
    lora = Trainer(config, tmp_path / "lora")
    try:
        await lora.run()  # the export goes into the adapted layers' base weights; then adapters train
    finally:
        lora.close()
    base = {n: p for n, p in lora.model.state_dict().items() if "lora_" not in n}
    assert all(torch.equal(base[k], warm[k.replace(".base_layer.", ".")]) for k in base)
    merged = plain_state_dict(lora.model)
    assert any(not torch.equal(merged[k], warm[k]) for k in merged), "the adapters trained after it"
