"""Benchmark the weight sync after a learner step, side by side: in-process engine vs vLLM server, by model size.

Usage::

    python bench/weight_sync.py [--models smollm2,random-1b] [--kinds vllm,vllm-server] [--rounds 3]
        [--dtype bfloat16 [--files engine,float32]] [--smoke]

For each model and each policy kind it starts the policy (``VLLMPolicy``, an engine inside this
process's reach, or ``VLLMServerPolicy``, vLLM's own server), loads the learner's fp32 twin
(``training.policies.learner_model``) and pushes its weights ``--rounds`` times through
:class:`~toolgym.training.weight_sync.VLLMWeightSync`, as the trainer does after every optimizer
step: ``export`` (the learner's state dict written as safetensors into ``/dev/shm``), ``load`` (the
engine's in-place reload, measured inside its worker) and ``sync`` (the whole call, pause and resume
included). It then checks the push reached the engine: the engine's logprobs of a fixed sequence
equal the learner's (the largest gap is printed: ~1e-6 in fp32, larger when the engine serves
bfloat16, ``--dtype``). The file is written in the engine's dtype, as the trainer writes it
(``--files engine``); ``--files engine,float32`` also measures the fp32 file the engine would cast
on load, side by side (half the bytes in bfloat16).

Models: ``smollm2`` is the embedded SmolLM2-135M-Instruct; ``random-1b`` a randomly initialised Llama
of 1.0 B parameters (hidden 2048, 20 layers, 32 heads with 8 key/value heads, MLP 5632, SmolLM2's
tokenizer and vocabulary, tied embeddings), written once to a temporary directory: weights need not
be trained to be moved. ``--smoke``: a 2-layer random model of hidden 128 (head dimension 64: the CPU attention kernels take no smaller), so ``tests/test_scripts.py``
runs the script end to end; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

SHAPES = {
    "random-1b": dict(
        hidden_size=2048,
        num_hidden_layers=20,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=5632,
    ),
    "random-smoke": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
    ),
}


def random_model(name: str, where: Path) -> Path:
    """A randomly initialised Llama of ``SHAPES[name]`` with the embedded model's tokenizer, saved to ``where``."""
    import torch
    import transformers

    from toolgym.agents.policies.spec import resolve_model_dir

    base = resolve_model_dir(None)
    config = transformers.AutoConfig.from_pretrained(base)
    for key, value in SHAPES[name].items():
        setattr(config, key, value)
    config.head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.save_pretrained(where, safe_serialization=True)
    for file in base.iterdir():
        if file.name.startswith(
            ("tokenizer", "special_tokens", "vocab", "merges", "generation_config", "chat_template")
        ):
            shutil.copy(file, where / file.name)
    return where


def make_policy(kind: str, model_dir: Path, max_model_len: int, dtype: str):
    if kind == "vllm":
        from toolgym.agents.policies.vllm import VLLMPolicy

        return VLLMPolicy(model_dir, max_model_len=max_model_len, cpu_reserved=0, dtype=dtype)
    from toolgym.agents.policies.vllm_server import VLLMServerPolicy

    return VLLMServerPolicy(model_dir, max_model_len=max_model_len, cpu_reserved=0, dtype=dtype)


def measure(kind: str, model_dir: Path, rounds: int, dtype: str, file_dtype: str) -> dict[str, object]:
    import torch

    from toolgym.training.learn.scoring import token_logprobs
    from toolgym.training.policy_build import learner_model
    from toolgym.training.weight_sync import VLLMWeightSync

    t0 = time.perf_counter()
    policy = make_policy(kind, model_dir, 512, dtype)
    start = time.perf_counter() - t0
    try:
        learner = learner_model(model_dir)
        params = sum(p.numel() for p in learner.parameters())
        rows = []
        with VLLMWeightSync(policy, dtype=file_dtype) as sync:
            for r in range(rounds):
                with torch.no_grad():  # a step's worth of change, so every push carries new weights
                    for p in learner.parameters():
                        p.add_(torch.randn_like(p) * 1e-4)
                rows.append(sync.sync(learner, r + 1))
        sequence = policy.render([{"role": "user", "content": "Say a word."}]) + policy.tokenizer.encode(
            "Apple."
        )
        with torch.no_grad():
            mine = token_logprobs(learner, [sequence])[0][0, 1:].tolist()
        theirs = asyncio.run(policy.score(sequence))
        gap = max(abs(a - b) for a, b in zip(mine, theirs, strict=True))
    finally:
        policy.close()
    return {"params": params, "start": start, "rows": rows, "gap": gap}


def row(name: str, kind: str, dtype: str, file_dtype: str, out: dict[str, object]) -> str:
    """One table row: medians over the pushes, and the learner-vs-engine logprob gap after them."""
    rows = out["rows"]
    assert isinstance(rows, list)
    med = {k: statistics.median(r[f"time/weight_{k}"] for r in rows) for k in ("export", "load", "sync")}
    return (
        f"| {name} | {out['params'] / 1e6:.0f}M | {kind} | {dtype} | {file_dtype} | {med['export']:.2f} | {med['load']:.2f} | "
        f"{med['sync']:.2f} | {out['gap']:.1e} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="smollm2,random-1b", help="comma-separated: smollm2, random-1b")
    parser.add_argument("--kinds", default="vllm,vllm-server", help="comma-separated: vllm, vllm-server")
    parser.add_argument("--rounds", type=int, default=3, help="pushes per model and kind")
    parser.add_argument(
        "--dtype",
        default="float32",
        help="the engine's serving dtype (bfloat16 halves its copy; the learner stays fp32)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny random model, one kind's rounds: numbers mean nothing"
    )
    parser.add_argument(
        "--files",
        default="engine",
        help="comma-separated dtypes of the weight file: engine (the serving dtype, as the trainer writes it), float32",
    )
    args = parser.parse_args()
    files = list(dict.fromkeys(args.dtype if f == "engine" else f for f in args.files.split(",") if f))
    models = ["random-smoke"] if args.smoke else [m for m in args.models.split(",") if m]
    kinds = [k for k in args.kinds.split(",") if k]
    print(f"load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            if name == "smollm2":
                from toolgym.agents.policies.spec import resolve_model_dir

                model_dir = resolve_model_dir(None)
            else:
                model_dir = random_model(name, Path(tmp) / name)
                gc.collect()  # the generated model is on disk now; only the learner's copy should stay
            for kind in kinds:
                for file_dtype in files:
                    out = measure(kind, model_dir, args.rounds, args.dtype, file_dtype)
                    results.append((name, kind, file_dtype, out))
                    print(
                        f"{name} {kind}: {out['params'] / 1e6:.0f}M parameters, started in {out['start']:.0f} s"
                    )
                    print(row(name, kind, args.dtype, file_dtype, out), flush=True)  # as soon as measured
    print(
        "\n| model | parameters | policy | engine dtype | file dtype | export s | load s | sync s (median) | logprob gap |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, kind, file_dtype, out in results:
        print(row(name, kind, args.dtype, file_dtype, out))
    by = {(n, k, f): statistics.median(r["time/weight_sync"] for r in o["rows"]) for n, k, f, o in results}
    for name in models:
        for file_dtype in files:
            if (name, "vllm", file_dtype) in by and (name, "vllm-server", file_dtype) in by:
                ratio = by[(name, "vllm-server", file_dtype)] / by[(name, "vllm", file_dtype)]
                print(
                    f"{name}, {file_dtype} file: the server's sync takes {ratio:.2f}x the in-process engine's"
                )
        for kind in kinds:
            if len(files) > 1 and all((name, kind, f) in by for f in files):
                ratio = by[(name, kind, files[0])] / by[(name, kind, files[-1])]
                print(
                    f"{name}, {kind}: a {files[0]} file syncs in {ratio:.2f}x the time of a {files[-1]} file"
                )


if __name__ == "__main__":
    main()
