"""The held-out curve: the training policy itself, evaluated greedily on a fixed test slice during training.

"Is it generalising?" is the first thing a researcher looks at, and the answer should not wait for the
run's end. With ``heldout.every = N`` the trainer evaluates, before the first step and after every
``N``-th, the policy it is training: the same object that samples the rollouts (the hf module, or the
vLLM engine after its weight sync), greedy, on ``heldout.curve_n`` tasks of the held-out split (one
seeded choice, the same at every point) and on ``heldout.curve_harnesses``. Each point is an ordinary
``toolgym eval`` directory (``RUN/heldout_curve/step-NNNNNN``, resumable); its means go to
``heldout_curve.jsonl`` and into that step's ``metrics.jsonl`` row (``heldout_curve/<track>/reward``
and ``.../em``), and ``toolgym report`` draws them.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from toolgym.agents.eval.evaluate import evaluate
from toolgym.core import Policy, SamplingParams
from toolgym.errors import InfraDown
from toolgym.run_files import open_append
from toolgym.training.config import RunConfig
from toolgym.training.heldout.table import check_disjoint

__all__ = ["CURVE_FILE", "curve_point", "read_curve"]

CURVE_FILE = "heldout_curve.jsonl"


async def curve_point(
    config: RunConfig, run_dir: str | Path, policy: Policy, step: int, train_task_ids: Sequence[str]
) -> dict[str, float]:
    """Evaluate ``policy`` on the curve's slice; append the point to ``heldout_curve.jsonl`` and return it."""

    hc, env = config.heldout, config.heldout_env
    run_dir = Path(run_dir)
    env_kwargs = {**dict(env.kwargs), **dict(hc.kwargs), "split": hc.split}
    out_dir = run_dir / "heldout_curve" / f"step-{step:06d}"
    report = await evaluate(
        env.id,
        lambda: policy,
        hc.curve_harnesses or hc.harnesses,
        n=hc.curve_n,
        seed=hc.seed,
        concurrency=hc.concurrency,
        sampling=SamplingParams(max_tokens=hc.max_tokens, temperature=0.0),
        max_total_tokens=hc.max_total_tokens or env.max_total_tokens,
        out_dir=out_dir,
        env_kwargs=env_kwargs,
        policy_label=f"train@{step}",
        policy_info={"run": str(run_dir), "step": step, "policy_version": int(policy_version(policy))},
    )
    check_disjoint(train_task_ids, report.task_ids)
    point: dict[str, float] = {"step": float(step)}
    for track in report.tracks:
        if track.infra_errors == track.n:  # nothing was scored: a point of zeros would be a lie
            first = next(t.error for t in report.trajectories[track.harness] if t.error)
            shutil.rmtree(out_dir)  # a resume evaluates this point again, not its failures
            raise InfraDown(
                f"the held-out curve at step {step}: every {track.harness} episode ended in infra_error "
                f"({first}); fix the cause and rerun the same command: the run resumes from its last checkpoint"
            )
        point[f"heldout_curve/{track.harness}/reward"] = track.reward
        point[f"heldout_curve/{track.harness}/em"] = track.metrics.get("reward/em", track.success)
        if track.infra_errors:
            point[f"heldout_curve/{track.harness}/infra_errors"] = float(track.infra_errors)
    with open_append(run_dir / CURVE_FILE) as fh:  # never through a planted link
        fh.write(json.dumps(point) + "\n")
    return point


def policy_version(policy: Any) -> int:
    return int(getattr(policy, "policy_version", 0))


def read_curve(run_dir: str | Path) -> list[dict[str, float]]:
    """The curve's points, in step order (empty without a curve)."""
    path = Path(run_dir) / CURVE_FILE
    if not path.is_file():
        return []
    points = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return sorted(points, key=lambda p: p["step"])
