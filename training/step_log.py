"""What one training step writes: its metrics row and its consumed samples (the run directory's logs).

:func:`step_metrics` computes the ``metrics.jsonl`` row of a step from its groups and the learner's
results; :func:`write_step` appends that row, one ``trajectories.jsonl`` line per consumed sample and,
when the curriculum moved, its event to ``curriculum.jsonl``; :func:`track_step` sends the row and a
table of the step's samples to the run's experiment trackers (:mod:`toolgym.records.trackers`), if any;
:func:`write_train_manifest` writes the run's ``manifest.json`` (:mod:`toolgym.records.manifest`) and refuses
to resume a run whose environment changed since it started.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolgym.core import Trajectory
from toolgym.errors import ConfigError
from toolgym.records.manifest import manifest_differences, read_run_manifest, run_manifest, write_run_manifest
from toolgym.records.trackers import Trackers, trajectory_rows
from toolgym.registry import env_reference_rule
from toolgym.run_files import open_append, refuse_link
from toolgym.tool_use import tool_use_means
from toolgym.training.config import RunConfig, to_dict
from toolgym.training.learn.grpo import StepResult
from toolgym.training.learn.rewards import shaped_reward
from toolgym.training.sampling.workers import Group

__all__ = [
    "LOG_FILES",
    "RUN_FILES",
    "GroupRecord",
    "group_records",
    "step_metrics",
    "track_step",
    "write_step",
    "write_train_manifest",
]

LOG_FILES = ("metrics.jsonl", "trajectories.jsonl", "curriculum.jsonl", "heldout_curve.jsonl")
#: the run's other files the trainer writes at its top level (checked for planted links at the start)
RUN_FILES = ("config.json", "manifest.json", "checkpoint.pt", ".checkpoint.pt.tmp", "report.html")


@dataclass(frozen=True)
class GroupRecord:
    """A consumed group as the logs show it: its samples' advantages, whether each trained, and why
    the whole group was dropped (``"zero_variance"`` by dynamic sampling, ``"stale"``; empty when kept)."""

    group: Group
    advantages: tuple[float, ...]
    trained: tuple[bool, ...]
    dropped: str = ""


def group_records(
    kept: Sequence[Group], result: StepResult, dropped: Sequence[tuple[Group, str]]
) -> list[GroupRecord]:
    """The step's groups in index order: the kept ones with the learner's advantages, then the dropped."""
    records = [
        GroupRecord(g, adv, trained)
        for g, adv, trained in zip(kept, result.advantages, result.trained, strict=True)
    ]
    for group, reason in dropped:
        n = len(group.trajectories)
        records.append(GroupRecord(group, (0.0,) * n, (False,) * n, reason))
    return sorted(records, key=lambda r: r.group.index)


def step_metrics(
    records: Sequence[GroupRecord],
    result: StepResult,
    *,
    config: RunConfig,
    step: int,
    policy_version: int,
    stale: Sequence[int],
    dropped_groups: int,
    wait: float,
    t_learn: float,
    curriculum: Mapping[str, float],
) -> dict[str, float]:
    """The ``metrics.jsonl`` row of one step.

    Rewards, tool calls and episode shapes are over every group the step drew (kept or dropped for
    zero variance: what the policy did), never over stale groups; ``loss/*`` over what trained.
    """
    drawn = [r for r in records if r.dropped != "stale"]
    trajs = [t for r in drawn for t in r.group.trajectories] or [
        t for r in records for t in r.group.trajectories
    ]
    ok = [t for t in trajs if t.status != "infra_error"]
    rewards = [t.reward for t in ok] or [0.0]
    mean = sum(rewards) / len(rewards)
    tools = sorted(
        {k.split("/")[1] for t in trajs for k in t.metrics if k.startswith("tool/") and k.endswith("/calls")}
        | {n for t in trajs for n in t.allowed_tools}
    )
    tc = config.train
    losses = result.losses
    n = max(len(trajs), 1)
    metrics: dict[str, float] = {
        "step": float(step),
        "policy_version": float(policy_version),
        "reward/mean": mean,
        "reward/std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
        "reward/shaped_mean": sum(shaped_reward(t, tc.format_credit, tc.answer_tool) for t in ok)
        / max(len(ok), 1),
        "reward/success_rate": sum(r >= config.curriculum.success_threshold for r in rewards) / len(rewards),
        "loss/pg": losses.pg,
        "loss/kl": losses.kl,
        "loss/clip_frac": losses.clip_frac,
        "loss/ratio_mean": losses.ratio_mean,
        "loss/tis_frac": losses.tis_frac,
        "loss/dual_clip_frac": losses.dual_frac,
        "loss/entropy": losses.entropy,
        "loss/grad_norm": result.grad_norm,
        "loss/tokens": float(result.tokens),
        "loss/sequences": float(result.sequences),
        "train/lr": result.lr,
        "train/updated": float(result.updated),
        "mismatch/kl": losses.mismatch_kl,
        "staleness/mean": sum(stale) / len(stale) if stale else 0.0,
        "staleness/max": float(max(stale)) if stale else 0.0,
        "staleness/dropped_groups": float(dropped_groups),
        "groups/drawn": float(len(drawn)),
        "groups/informative": float(result.informative),
        "groups/zero_variance": float(result.zero_variance),
        "groups/dropped_zero_variance": float(sum(r.dropped == "zero_variance" for r in records)),
        "response/tokens_mean": sum(sum(v.loss_mask) for t in trajs for v in t.segment_views()) / n,
        "env/turns_mean": sum(t.metrics.get("env/turns", 0.0) for t in trajs) / n,
        "env/segments_mean": sum(1 + len(t.segments) for t in trajs) / n,
        "env/turn_truncated": sum(t.stop_reason == "turn_truncated" for t in trajs) / n,
        "env/infra_errors": float(len(trajs) - len(ok)),
        "env/infra_retries": sum(t.metrics.get("env/infra_retries", 0.0) for t in trajs),
        "time/generate": sum(t.timings.get("time/generate", 0.0) for t in trajs) / n,
        "time/env": sum(t.timings.get("time/env", 0.0) for t in trajs) / n,
        "time/learn": t_learn,
        "time/queue_wait": wait,
    }
    for name in tools:
        metrics[f"tool/{name}/calls"] = sum(t.metrics.get(f"tool/{name}/calls", 0.0) for t in trajs) / n
    metrics.update(tool_use_means(ok))  # use/*: what the episodes did with their tools (toolgym.tool_use)
    metrics.update(result.sync)  # time/weight_sync, time/weight_export, time/weight_load (vLLM)
    metrics.update(curriculum)
    return metrics


def _samples(step: int, records: Sequence[GroupRecord]) -> Iterator[tuple[Trajectory, dict[str, Any]]]:
    """Each consumed sample with where it sits: step, group, sample index and advantage."""
    for r in records:
        for i, (t, a) in enumerate(zip(r.group.trajectories, r.advantages, strict=True)):
            yield t, {"step": step, "group": r.group.index, "sample": i, "advantage": a}


def write_step(
    run_dir: Path,
    step: int,
    records: Sequence[GroupRecord],
    metrics: Mapping[str, float],
    curriculum_events: Sequence[Mapping[str, Any]] = (),
    env_names: Sequence[str] | None = None,
) -> None:
    """Append the step's samples, its metrics row and (when a curriculum moved) its events.

    ``env_names`` (a mixture's ``[[env]]`` names) adds each sample's environment as ``"env"``; a
    sample of a dropped group carries ``"dropped"`` (why its group never trained).

    Raises:
        ConfigError: a log's name is a symbolic link (nothing is written through it).
    """
    with open_append(run_dir / "trajectories.jsonl") as fh:  # never through a planted link
        for r in records:
            for i, (t, a) in enumerate(zip(r.group.trajectories, r.advantages, strict=True)):
                record: dict[str, Any] = {"step": step, "group": r.group.index, "sample": i, "advantage": a}
                record.update(trained=r.trained[i], trajectory=json.loads(t.to_json()))
                if r.dropped:
                    record["dropped"] = r.dropped
                if env_names:
                    record["env"] = env_names[r.group.env]
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
    with open_append(run_dir / "metrics.jsonl") as fh:
        fh.write(json.dumps(dict(metrics)) + "\n")
    if curriculum_events:
        with open_append(run_dir / "curriculum.jsonl") as fh:
            for event in curriculum_events:
                fh.write(json.dumps({**event, "step": step}) + "\n")


def track_step(
    trackers: Trackers, step: int, records: Sequence[GroupRecord], metrics: Mapping[str, float]
) -> None:
    """Send the step's metrics row and its samples (as a ``trajectories`` table) to ``trackers``."""
    if not trackers:
        return
    trackers.log_metrics(step, metrics)
    samples = list(_samples(step, records))
    columns, rows = trajectory_rows([t for t, _ in samples], [where for _, where in samples])
    trackers.log_table("trajectories", step, columns, rows)


def write_train_manifest(
    run_dir: Path,
    config: RunConfig,
    env_fingerprint: Mapping[str, Any],
    task_ids: Sequence[str],
    *,
    model_dir: str | Path | None,
    resuming: bool,
) -> Path:
    """Write the run's manifest; a resumed run must pose the same environment as the run it continues.

    The run's own files are checked first: a symbolic link at any of their names (planted, since toolgym
    creates none) stops the run here, at its start, rather than at the step that would write through it.

    Raises:
        ConfigError: a symbolic link stands at a run file's name; or ``resuming`` and the stored
            manifest's environment fields (data and index hashes,
            prompts and tool schemas, scoring) differ from today's: the checkpoint was trained on
            other tasks, and one run would mix two experiments.
    """
    for name in (*LOG_FILES, *RUN_FILES):
        refuse_link(run_dir / name)
    run = {"harness": config.env.harness, "max_total_tokens": config.env.max_total_tokens}
    run.update(task_ids=list(task_ids), sampling=to_dict(config.sampling), seed=config.train.seed)
    run["warm_start"] = to_dict(config.warm_start)
    if config.train.task_pool == "reference" or (
        config.warm_start.enabled and config.warm_start.source == "reference"
    ):
        # the scripted solver behind the demonstrations or the task pool, by name (an unknown one stops here)
        run["reference_rule"] = env_reference_rule(
            config.env.id, config.env.kwargs, config.env.reference_rule
        )[0]
    policy = {"kind": config.policy.kind, "model": config.policy.model}
    if model_dir is not None:
        policy["model_dir"] = str(model_dir)
    manifest = run_manifest(env=env_fingerprint, run=run, policy=policy, kind="train")
    old = read_run_manifest(run_dir) if resuming else None
    if old is not None:
        # a toolgym upgrade alone does not stop a resume; what the environment poses and scores does
        differences = manifest_differences(old, manifest, allow=("format", "toolgym"))
        if differences:
            raise ConfigError(
                f"{run_dir} was trained against another environment state: {'; '.join(differences)}. "
                "Resuming would train one run on two sets of tasks. Fix: train into a new --out (or "
                "restore the environment's data and index as they were)"
            )
    return write_run_manifest(run_dir, manifest)
