"""Harness-vs-no-harness evaluation: the same tasks and seeds on every track, paired statistics.

``evaluate`` picks ``n`` task ids with a seeded generator, runs each task once per track with the same
seed (task ``i`` gets seed ``seed + i``), and returns per-track summaries plus the paired difference of
each track against the first (bootstrap 95% interval over tasks). Episodes run concurrently, each on its
own environment instance; a policy that batches concurrent requests (HFPolicy) gets batch speed.

With ``out_dir`` the run is recorded, resumable and comparable (:mod:`toolgym.agents.eval.runs`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import gymnasium
import numpy as np

from toolgym.agents.eval.runs import (
    EvalSettings,
    append_episode,
    check_resumable,
    paired_rewards,
    prepare_run_dir,
    write_record,
)
from toolgym.agents.eval.stats import bootstrap_means, paired_bootstrap
from toolgym.agents.harness import get_harness
from toolgym.agents.rollout import run_episode
from toolgym.core import Policy, SamplingParams, TaskToolEnv, Trajectory
from toolgym.errors import ConfigError, did_you_mean
from toolgym.records.manifest import env_fingerprint, run_manifest, write_run_manifest
from toolgym.registry import env_creator, make
from toolgym.run_files import write_atomic
from toolgym.tool_use import tool_use_means

log = logging.getLogger(__name__)

__all__ = [
    "LEFT_OUT_WARNING",
    "EvalReport",
    "TrackSummary",
    "check_env_kwargs",
    "evaluate",
    "bootstrap_means",
    "left_out_warning",
    "paired_bootstrap",
    "pick_tasks",
    "summarize",
]


#: The share of a track's (or a training step's) episodes left out as ``infra_error`` above which its
#: numbers are reported with a warning: they are over the scored episodes only.
LEFT_OUT_WARNING = 0.05


def left_out_warning(what: str, left_out: int, total: int) -> str | None:
    """A warning when more than :data:`LEFT_OUT_WARNING` of ``total`` episodes ended in ``infra_error``
    (left out of every score and never trained on), else None."""
    if total <= 0 or left_out / total <= LEFT_OUT_WARNING:
        return None
    return (
        f"{what}: {left_out} of {total} episodes ({left_out / total:.0%}) ended in infra_error and are left "
        f"out: its success rate and rewards are over the other {total - left_out} only. These are faults of "
        "ours or of the infrastructure (the log names them), never the model's; fix them before reading "
        "the numbers"
    )


def _check_budget(
    results: Mapping[str, Sequence[Trajectory]], max_total_tokens: int, *, recorded: bool
) -> None:
    """A token budget that ends episodes before the model's first action is a configuration error,
    never a score of 0: refused when it ended every episode, a warning with the count otherwise.

    Raises:
        ConfigError: every scored episode ended on the budget before its first action (``recorded``:
            the episodes were written to an output folder, which the rerun must clear).
    """
    episodes = [t for trajs in results.values() for t in trajs if t.status != "infra_error"]
    starved = [t for t in episodes if t.metrics.get("env/no_first_action")]
    if not starved:
        return
    prompt = int(max(t.metrics.get("env/prompt_tokens", 0.0) for t in starved))
    what = (
        f"{len(starved)} of {len(episodes)} episodes ended on the token budget before the model's first "
        f"action: the prompt alone took {prompt} tokens (system text, tools, worked example, task) of the "
        f"budget of {max_total_tokens}"
    )
    if len(starved) == len(episodes):
        raise ConfigError(
            f"{what}, so nothing was evaluated. Fix: raise the budget (--max-total-tokens, or "
            "max_total_tokens) above the prompt plus the turns, then run again"
            + (" with --restart" if recorded else "")
        )
    log.warning("%s; they score 0. Raise the budget to evaluate them", what)


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
    #: track name -> (mean difference vs the first track, ci_low, ci_high); pairs with an
    #: ``infra_error`` on either side are left out (never scored)
    paired: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    #: the run's settings (:class:`~toolgym.agents.eval.runs.EvalSettings` as JSON), not in ``to_json``
    settings: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    #: episodes by track, in task order; not in ``to_json`` (the JSONL files hold them)
    trajectories: dict[str, list[Trajectory]] = field(default_factory=dict, repr=False, compare=False)
    #: the run manifest (:mod:`toolgym.records.manifest`), also written to ``out_dir/manifest.json``
    manifest: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def to_json(self) -> str:
        data = {
            "env_id": self.env_id,
            "policy": self.policy,
            "seed": self.seed,
            "task_ids": self.task_ids,
            "tracks": [asdict(t) for t in self.tracks],
            "paired": self.paired,
        }
        return json.dumps(data, indent=2)


def summarize(harness: str, trajectories: Sequence[Trajectory]) -> TrackSummary:
    scored = [t for t in trajectories if t.status != "infra_error"]
    # reward metrics, and how episodes ended when that varies: segments per compacted episode, cut turns
    shown = ("reward/", "episode/segments", "env/turn_truncated")
    keys = sorted({k for t in scored for k in t.metrics if k.startswith(shown)})
    mean = lambda xs: float(np.mean(xs)) if xs else 0.0  # noqa: E731
    return TrackSummary(
        harness=harness,
        n=len(trajectories),
        success=mean([float(t.reward >= 1.0 - 1e-9) for t in scored]),
        reward=mean([t.reward for t in scored]),
        # an episode that was never compacted is one segment; tool-use measures (toolgym.tool_use) are
        # means over the episodes that have them (absent: not measured)
        metrics={
            **{k: mean([t.metrics.get(k, float(k == "episode/segments")) for t in scored]) for k in keys},
            **tool_use_means(scored),
        },
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
    policy_label: str | None = None,
    policy_info: Mapping[str, Any] | None = None,
    restart: bool = False,
) -> EvalReport:
    """Run every track on the same ``n`` tasks and seeds (see the module docstring).

    ``policy_factory`` is called once per track with a fresh state (scripted policies keep a cursor);
    policies that hold a model should return the same shared instance.

    With ``out_dir`` the run is recorded there (:mod:`toolgym.agents.eval.runs`): each episode is
    appended as it finishes, a directory with the same settings is resumed (finished episodes are not
    run again), and one with other settings is refused unless ``restart`` clears it.

    Args:
        policy_label: the policy's name in the report and record (e.g. its spec); default its ``name``.
        policy_info: what the policy resolved to (model directory, export step), for the record.
    """
    harness_objs = [get_harness(h) for h in harnesses]
    if len({h.name for h in harness_objs}) != len(harness_objs):
        raise ConfigError(f"each harness may appear once, got {list(harnesses)}")
    if n < 1:
        raise ConfigError(f"n must be >= 1, got {n}")
    env_kwargs = dict(env_kwargs or {})
    check_env_kwargs(env_id, env_kwargs)
    probe = _make_env(env_id, env_kwargs)
    try:
        all_ids = cast(TaskToolEnv, probe.unwrapped).task_ids()
        fingerprint = env_fingerprint(probe, env_id, env_kwargs)
    finally:
        probe.close()
    picked = pick_tasks(all_ids, n, seed)
    sampling = sampling or SamplingParams(max_tokens=96, temperature=0.0)
    settings = EvalSettings(
        env_id=env_id,
        env_kwargs=env_kwargs,
        harnesses=tuple(h.name for h in harness_objs),
        task_ids=tuple(picked),
        seeds=tuple(seed + i for i in range(len(picked))),
        max_total_tokens=max_total_tokens,
        policy=policy_label or "",
        policy_info=dict(policy_info or {}),
        sampling=asdict(sampling),
    )
    manifest = run_manifest(
        env=fingerprint,
        run={**settings.to_dict(), "concurrency": concurrency},
        policy=dict(policy_info or {"spec": policy_label or ""}),
        kind="eval",
    )
    out = Path(out_dir) if out_dir is not None else None
    finished = prepare_run_dir(out, settings, restart=restart) if out is not None else {}
    if out is not None:
        check_resumable(out, manifest, resuming=bool(finished))
        write_run_manifest(out, manifest)
    done_keys = {(t.harness, t.task_id, t.seed) for trajs in finished.values() for t in trajs}
    total = len(picked) * len(harness_objs)
    done = len(done_keys)
    if progress is not None:
        progress(done, total)
    semaphore = asyncio.Semaphore(concurrency)
    pool: list[gymnasium.Env] = []

    async def one(harness: Any, policy: Policy, i: int, task_id: str) -> Trajectory:
        nonlocal done
        async with semaphore:
            env = pool.pop() if pool else make(env_id, **env_kwargs)
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
        if out is not None:
            append_episode(out, trajectory)
        done += 1
        if progress is not None:
            progress(done, total)
        return trajectory

    results: dict[str, list[Trajectory]] = {}
    policy_name = policy_label
    started = time.perf_counter()
    try:
        # NOTE: every track's episodes share one pool of `concurrency` slots, so the engine's batch
        # stays full across the end of one track and the start of the next.
        jobs = []
        for harness in harness_objs:
            todo = [(i, t) for i, t in enumerate(picked) if (harness.name, t, seed + i) not in done_keys]
            if todo:
                policy = policy_factory()
                policy_name = policy_name or getattr(policy, "name", type(policy).__name__)
                jobs += [one(harness, policy, i, t) for i, t in todo]
        new = await _all_or_none(jobs)
        for harness in harness_objs:
            mine = [*finished.get(harness.name, []), *(t for t in new if t.harness == harness.name)]
            # NOTE: episodes in task order whatever order they finished (or were resumed) in
            by_key = {(t.task_id, t.seed): t for t in mine}
            results[harness.name] = [by_key[(t, seed + i)] for i, t in enumerate(picked)]
    finally:
        for env in pool:
            env.close()
    _check_budget(results, max_total_tokens, recorded=out is not None)
    tracks = [summarize(name, trajs) for name, trajs in results.items()]
    names = list(results)
    paired = {}
    for name in names[1:]:
        a, b, _ = paired_rewards(results[names[0]], results[name])
        if a:
            paired[name] = paired_bootstrap(a, b, seed=seed)
    report = EvalReport(env_id, policy_name or "policy", seed, picked, tracks, paired)
    for track in tracks:
        if warning := left_out_warning(f"evaluation track {track.harness!r}", track.infra_errors, track.n):
            log.warning(warning)
    report.trajectories.update(results)
    report.settings.update(settings.to_dict())
    report.manifest.update(manifest)
    if out is not None:
        write_atomic(out / "summary.json", report.to_json())  # never through a planted link
        write_atomic(out / "elapsed_s.txt", f"{time.perf_counter() - started:.1f}\n")
        write_record(
            out,
            settings,
            "complete",
            {"tracks": [asdict(t) for t in tracks], "paired": {k: list(v) for k, v in paired.items()}},
        )
    return report


def pick_tasks(task_ids: Sequence[str], n: int, seed: int) -> list[str]:
    """The ``n`` tasks an evaluation with ``seed`` runs (all of them when ``n`` is at least their number)."""
    rng = np.random.default_rng(seed)
    return [task_ids[i] for i in rng.choice(len(task_ids), size=min(n, len(task_ids)), replace=False)]


async def _all_or_none(coros: Sequence[Any]) -> list[Trajectory]:
    """Run episodes concurrently; when one fails, cancel the rest before raising (so no episode of an
    abandoned run is still running, or still writing to its directory, afterwards)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _make_env(env_id: str, env_kwargs: Mapping[str, Any]) -> gymnasium.Env:
    """:func:`toolgym.registry.make`, with a constructor's ``TypeError`` (a bad argument) as a one-line ConfigError."""
    try:
        return make(env_id, **env_kwargs)
    except TypeError as exc:
        raise ConfigError(
            f"{env_id} rejected its arguments {dict(env_kwargs)} ({exc}); fix the --env-arg values"
        ) from exc


def check_env_kwargs(env_id: str, env_kwargs: Mapping[str, Any]) -> None:
    """Refuse keyword arguments the environment's constructor (and ``gymnasium.make``) does not take.

    Raises:
        ConfigError: an unknown id or argument name, with "did you mean" (and the accepted names).
    """
    import inspect

    # an unknown id says "did you mean"; a module:id imports its module; a served environment's
    # arguments are its client's (token, timeout)
    creator = env_creator(env_id)
    if creator is None:
        return  # no creator to inspect: gymnasium.make reports it
    try:
        params = inspect.signature(creator).parameters
    except (TypeError, ValueError):
        return  # a builtin or C creator: let it check its own arguments
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = {
        name
        for name, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    accepted |= set(inspect.signature(gymnasium.make).parameters) - {"id", "kwargs"}
    for key in env_kwargs:
        if key not in accepted:
            raise ConfigError(
                f"{env_id} takes no argument {key!r}.{did_you_mean(key, accepted)} "
                f"It accepts: {', '.join(sorted(accepted))}"
            )
