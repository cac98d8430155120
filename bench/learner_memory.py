"""The start-up memory estimate against the measured memory of a learner step, for shipped configs.

Usage::

    python bench/learner_memory.py [--configs demo,learn,hard] [--threads 2] [--smoke]

For each config (its learner's model: the embedded SmolLM2-135M in fp32 on CPU), one learner pass at
the config's token budget: ``micro_batch`` sequences of ``max_total_tokens`` random tokens (no common
prefix, so the pass holds the whole budget), the second half of each trained on, rewards alternating
so every sequence has an advantage; then the gradient clip and AdamW step. Two steps run; the first
allocates the gradients and AdamW's moments, the second reuses them. Reported: what
:func:`~toolgym.training.memory_estimate.estimate_memory` says beyond the weights (gradients and AdamW,
activations, scoring) and how far this process's resident memory rose above its level before the
first step (sampled every 10 ms), in MB (10^6 bytes). ``--smoke``: the byte-level tiny model on short sequences.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time

import torch
from memory import PeakRSS  # bench/memory.py (this script's folder is on sys.path)

from toolgym.core import Trajectory, sampled_ids_hash
from toolgym.training.config import RunConfig, load_config
from toolgym.training.learn.grpo import StepSettings, accumulate_gradients, plan_step
from toolgym.training.learn.optim import LearnerOptimizer
from toolgym.training.memory_estimate import estimate_memory, pass_budget


def budget_group(config: RunConfig, vocab: int, seed: int = 0) -> list[Trajectory]:
    """``micro_batch`` sequences of ``max_total_tokens`` tokens that fill one pass of the config's budget."""
    rng = random.Random(seed)
    length = max(env.max_total_tokens for env in config.envs)
    tokens = pass_budget(config)
    group = []
    for i in range(tokens // length):
        ids = [i + 1] + [rng.randrange(1, vocab) for _ in range(length - 1)]  # no two share a first token
        mask = [0] * (length // 2) + [1] * (length - length // 2)
        group.append(
            Trajectory(
                env_id="bench",
                task_id="t",
                seed=i,
                harness="bare",
                allowed_tools=(),
                messages=(),
                token_ids=tuple(ids),
                loss_mask=tuple(mask),
                logprobs=tuple(0.0 for _ in ids),
                reward=float(i % 2),
                metrics={},
                status="ok",
                policy_version=0,
                timings={},
                token_hash=sampled_ids_hash(ids, mask),
            )
        )
    return group


def measure(name: str, overrides: list[str], model_for: str) -> dict[str, float]:
    """Estimate and measure one config; MB."""
    config = load_config(name, [*overrides, "train.batching.share_prefix=false"])
    if model_for == "tiny":
        from toolgym.training.tiny_policy import tiny_model

        model = tiny_model(hidden=32)
    else:
        from toolgym.agents.policies.models import smollm2_path
        from toolgym.training.policy_build import learner_model

        model = learner_model(smollm2_path(show_progress=False))
    estimate = estimate_memory(config, model)
    tc = config.train
    group = budget_group(config, int(model.config.vocab_size))
    plan = plan_step([group], skip_zero_variance=False)
    optimizer = LearnerOptimizer.from_config(model.parameters(), tc.optim, tc.steps)
    rises, seconds = [], []
    for _ in range(2):
        optimizer.zero_grad()
        gc.collect()
        with PeakRSS() as memory:
            t0 = time.perf_counter()
            accumulate_gradients(
                model,
                plan,
                StepSettings(
                    tc.loss,
                    micro_batch=tc.batching.micro_batch,
                    micro_batch_tokens=tc.batching.micro_batch_tokens,
                    temperature=config.sampling.temperature,
                    share_prefix=False,
                ),
            )
            optimizer.step(tc.optim.max_grad_norm)
            seconds.append(time.perf_counter() - t0)
        rises.append(memory.rise)
    part = estimate.learner
    return {
        "tokens": float(estimate.tokens),
        "weights": part["weights"] / 1e6,
        "state": (part["gradients"] + part["AdamW"]) / 1e6,
        "activations": part["activations"] / 1e6,
        "scoring": part["scoring"] / 1e6,
        "estimate": (estimate.learner_bytes - part["weights"] - part["reference"]) / 1e6,
        "first": rises[0] / 1e6,
        "second": rises[-1] / 1e6,
        "seconds": min(seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", default="demo,learn,hard")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="the tiny model on 2 sequences of 128 tokens")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    overrides, model_for = [], "embedded"
    if args.smoke:
        overrides = ["policy.kind=tiny", "env.max_total_tokens=128", "train.batching.micro_batch=2"]
        model_for, args.configs = "tiny", "demo"
    print(f"load average {os.getloadavg()[0]:.1f}; {args.threads} threads", flush=True)
    print(
        "| config | tokens a pass | gradients + AdamW (MB) | activations | scoring | estimate beyond weights "
        "| measured rise: first step | second step | step s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.configs.split(","):
        row = measure(name, overrides, model_for)
        print(
            f"| {name} | {row['tokens']:,.0f} | {row['state']:,.0f} | {row['activations']:,.0f} | "
            f"{row['scoring']:,.0f} | {row['estimate']:,.0f} | {row['first']:,.0f} "
            f"({row['first'] / row['estimate']:.2f}x) | {row['second']:,.0f} | {row['seconds']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
