"""Harness-vs-no-harness evaluation: the same tasks and seeds on every track, paired statistics.

``evaluate`` picks ``n`` task ids with a seeded generator, runs each task once per track with the same
seed (task ``i`` gets seed ``seed + i``), and returns per-track summaries plus the paired difference of
each track against the first (bootstrap 95% interval over tasks). Episodes run concurrently, each on its
own environment instance; a policy that batches concurrent requests (HFPolicy) gets batch speed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np

from toolgym.agents.harness import get_harness
from toolgym.agents.rollout import run_episode, write_trajectories
from toolgym.core import Policy, SamplingParams, Trajectory
from toolgym.errors import ConfigError

__all__ = ["EvalReport", "TrackSummary", "evaluate", "paired_bootstrap", "summarize"]


@dataclass(frozen=True)
class TrackSummary:
    """Aggregates of one track over the evaluated tasks."""

    harness: str
    n: int
    success: float
    reward: float
    metrics: dict[str, float]
    tool_calls: float
    tokens: float
    seconds: float
    infra_errors: int


@dataclass(frozen=True)
class EvalReport:
    env_id: str
    policy: str
    seed: int
    task_ids: list[str]
    tracks: list[TrackSummary]
    #: track name -> (mean difference vs the first track, ci_low, ci_high)
    paired: dict[str, tuple[float, float, float]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def paired_bootstrap(
    a: Sequence[float], b: Sequence[float], *, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """Mean of ``b - a`` over paired items and its percentile-bootstrap 95% interval."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired samples must have the same non-zero length, got {len(a)} and {len(b)}")
    diff = np.asarray(b, dtype=float) - np.asarray(a, dtype=float)
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(resamples, len(diff)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(diff.mean()), float(low), float(high)


def summarize(harness: str, trajectories: Sequence[Trajectory]) -> TrackSummary:
    scored = [t for t in trajectories if t.status != "infra_error"]
    keys = sorted({k for t in scored for k in t.metrics if k.startswith("reward/")})
    mean = lambda xs: float(np.mean(xs)) if xs else 0.0  # noqa: E731
    return TrackSummary(
        harness=harness,
        n=len(trajectories),
        success=mean([float(t.reward >= 1.0 - 1e-9) for t in scored]),
        reward=mean([t.reward for t in scored]),
        metrics={k: mean([t.metrics.get(k, 0.0) for t in scored]) for k in keys},
        tool_calls=mean(
            [
                sum(v for k, v in t.metrics.items() if k.startswith("tool/") and k.endswith("/calls"))
                for t in scored
            ]
        ),
        tokens=mean([t.metrics.get("tokens/sampled", 0.0) for t in scored]),
        seconds=mean([t.timings.get("time/total", 0.0) for t in scored]),
        infra_errors=len(trajectories) - len(scored),
    )


async def evaluate(
    env_id: str,
    policy_factory: Callable[[], Policy],
    harnesses: Sequence[str] = ("bare", "scaffold"),
    *,
    n: int = 50,
    seed: int = 0,
    concurrency: int = 8,
    sampling: SamplingParams | None = None,
    max_total_tokens: int = 8192,
    out_dir: str | Path | None = None,
    env_kwargs: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> EvalReport:
    """Run every track on the same ``n`` tasks and seeds (see the module docstring).

    ``policy_factory`` is called once per track with a fresh state (scripted policies keep a cursor);
    policies that hold a model should return the same shared instance.
    """
    harness_objs = [get_harness(h) for h in harnesses]
    if len({h.name for h in harness_objs}) != len(harness_objs):
        raise ConfigError(f"each harness may appear once, got {list(harnesses)}")
    probe = gymnasium.make(env_id, **(env_kwargs or {}))
    try:
        all_ids = probe.unwrapped.task_ids()
    finally:
        probe.close()
    if n < 1:
        raise ConfigError(f"n must be >= 1, got {n}")
    rng = np.random.default_rng(seed)
    picked = [all_ids[i] for i in rng.choice(len(all_ids), size=min(n, len(all_ids)), replace=False)]
    total = len(picked) * len(harness_objs)
    done = 0
    sampling = sampling or SamplingParams(max_tokens=96, temperature=0.0)
    semaphore = asyncio.Semaphore(concurrency)
    pool: list[gymnasium.Env] = []

    async def one(harness: Any, policy: Policy, i: int, task_id: str) -> Trajectory:
        nonlocal done
        async with semaphore:
            env = pool.pop() if pool else gymnasium.make(env_id, **(env_kwargs or {}))
            try:
                trajectory = await run_episode(
                    env,
                    policy,
                    harness,
                    seed=seed + i,
                    options={"task_id": task_id},
                    sampling=sampling,
                    max_total_tokens=max_total_tokens,
                    env_id=env_id,
                )
            finally:
                pool.append(env)
        done += 1
        if progress is not None:
            progress(done, total)
        return trajectory

    results: dict[str, list[Trajectory]] = {}
    started = time.perf_counter()
    try:
        for harness in harness_objs:
            policy = policy_factory()
            results[harness.name] = list(
                await asyncio.gather(*(one(harness, policy, i, t) for i, t in enumerate(picked)))
            )
    finally:
        for env in pool:
            env.close()
    tracks = [summarize(name, trajs) for name, trajs in results.items()]
    names = list(results)
    paired = {
        name: paired_bootstrap(
            [t.reward for t in results[names[0]]], [t.reward for t in results[name]], seed=seed
        )
        for name in names[1:]
    }
    report = EvalReport(env_id, getattr(policy, "name", type(policy).__name__), seed, picked, tracks, paired)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name, trajs in results.items():
            write_trajectories(out / f"trajectories-{name}.jsonl", trajs, append=False)
        (out / "summary.json").write_text(report.to_json(), encoding="utf-8")
        (out / "elapsed_s.txt").write_text(f"{time.perf_counter() - started:.1f}\n", encoding="utf-8")
    return report
