"""Did the demo run learn? Per-step verifier reward, stage changes, first vs last fifth with a 95% CI.

Usage::

    toolgym train --config demo --out runs/demo
    python bench/demo_learning.py runs/demo [--control runs/demo-lr0]

Reads the run directory the trainer wrote (``metrics.jsonl``, ``trajectories.jsonl``,
``curriculum.jsonl``) through :func:`toolgym.training.experiments.analysis.learning_summary`: the mean verifier
reward of the first and the last fifth of the steps and a bootstrap 95% interval of their difference
(trajectory rewards resampled within each fifth). ``--control`` prints the same for a second run, e.g.
the same config with ``train.optim.lr=0``, which separates what the curriculum's unlocks did from what the
weight updates did.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from toolgym.training.experiments.analysis import (
    bootstrap_difference,
    learning_summary,
    read_run,
    stage_changes,
)


def describe(run_dir: Path, resamples: int) -> dict:
    s = learning_summary(run_dir, resamples=resamples)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    print(f"== {run_dir}")
    print("step  stage  reward/mean  shaped  answer  search  open  tokens  learn_s")
    for m in metrics:
        print(
            f"{int(m['step']):>4}  {int(m.get('curriculum/stage', 0)):>5}  {m['reward/mean']:>11.3f}  "
            f"{m.get('reward/shaped_mean', float('nan')):>6.3f}  {m.get('tool/answer/calls', 0.0):>6.2f}  "
            f"{m.get('tool/search/calls', 0.0):>6.2f}  {m.get('tool/open/calls', 0.0):>4.2f}  "
            f"{m.get('response/tokens_mean', 0.0):>6.1f}  {m.get('time/learn', 0.0):>7.1f}"
        )
    for event in stage_changes(run_dir):
        print(
            f"stage {event['from']} -> {event['to']} after step {event['step']} ({event['signal']}): {event['tools']}"
        )
    print(
        f"first fifth (steps {s.first_steps[0]}-{s.first_steps[-1]}, n={len(s.first_rewards)}): "
        f"{s.first_mean:.4f}; last fifth (steps {s.last_steps[0]}-{s.last_steps[-1]}, "
        f"n={len(s.last_rewards)}): {s.last_mean:.4f}"
    )
    print(
        f"difference {s.difference:+.4f}, bootstrap {s.confidence:.0%} CI [{s.ci_low:+.4f}, {s.ci_high:+.4f}] "
        f"-> {'above zero' if s.learned else 'NOT above zero'}"
    )
    return {
        "run": str(run_dir),
        "first_mean": s.first_mean,
        "last_mean": s.last_mean,
        "difference": s.difference,
        "ci": [s.ci_low, s.ci_high],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--control", type=Path, default=None, help="a second run to compare (e.g. lr=0)")
    parser.add_argument(
        "--from-step",
        type=int,
        default=1,
        help="with --control: compare the two runs' rewards over steps >= this one (e.g. after an unlock)",
    )
    parser.add_argument("--resamples", type=int, default=10_000)
    args = parser.parse_args()
    runs = [describe(args.run_dir, args.resamples)]
    if args.control is not None:
        runs.append(describe(args.control, args.resamples))
        _, trained = read_run(args.run_dir)
        _, control = read_run(args.control)
        a = [r for step, rs in trained.items() if step >= args.from_step for r in rs]
        b = [r for step, rs in control.items() if step >= args.from_step for r in rs]
        low, high = bootstrap_difference(b, a, resamples=args.resamples)
        diff = sum(a) / len(a) - sum(b) / len(b)
        print(
            f"== steps >= {args.from_step}: run {sum(a) / len(a):.4f} (n={len(a)}, {sum(r > 0 for r in a)} > 0) vs "
            f"control {sum(b) / len(b):.4f} (n={len(b)}, {sum(r > 0 for r in b)} > 0): "
            f"difference {diff:+.4f}, bootstrap 95% CI [{low:+.4f}, {high:+.4f}]"
        )
        runs.append({"from_step": args.from_step, "difference": diff, "ci": [low, high]})
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
