"""The end-of-run held-out evaluation: base, control (the warm-start export) and trained, paired.

:func:`run_heldout` evaluates, on the same held-out tasks, seeds and tracks, the policy the run started
from (``base``), the warm-start export (``control``, when the run warm-started and ``heldout.control``:
with ``train.optim.lr = 0`` the run would end there, so ``trained - control`` is RL's own share) and the
run's latest export (``trained``), and writes the table (:mod:`toolgym.training.heldout.table` documents the
layout and the honesty rules). Each evaluation is an ordinary resumable ``toolgym eval`` directory;
``heldout.reuse`` lets a matching earlier one stand in (:func:`find_reusable`). The ``pooled`` row of
the table pairs each task across tracks (:func:`~toolgym.agents.eval.runs.pooled_comparison`).

With vLLM all policies share one engine: it starts on the base weights, and before each later
evaluation the export's safetensors are loaded into it in place (which also clears the prefix cache):
an engine start saved per policy (about 40 s on 2 cores), and the same greedy tokens as an engine
started on the export (a test compares the two).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

from toolgym.agents.eval.evaluate import evaluate, pick_tasks, summarize
from toolgym.agents.eval.runs import EvalSettings, compare_runs, load_eval_run
from toolgym.agents.policies.factory import PolicyFactory, policy_factory
from toolgym.agents.policies.run_exports import resolve_run_export
from toolgym.agents.policies.spec import parse_policy_spec
from toolgym.agents.policies.vllm_log import ENGINE_LOG
from toolgym.core import SamplingParams, TaskToolEnv
from toolgym.errors import ConfigError
from toolgym.records.manifest import env_fingerprint, manifest_differences, weights_sha256
from toolgym.run_files import run_folder, write_atomic
from toolgym.training.config import RunConfig
from toolgym.training.heldout.table import check_disjoint

__all__ = ["can_share_engine", "find_reusable", "run_heldout"]

log = logging.getLogger(__name__)

#: Settings an earlier evaluation must share to stand in for one of this run's.
_SAME = ("env_id", "env_kwargs", "harnesses", "task_ids", "seeds", "max_total_tokens", "sampling")


def _factories(
    specs: Mapping[str, str],
    engine: str,
    config: RunConfig,
    *,
    seed: int,
    max_model_len: int,
    served: Any = None,
    log_file: Path | None = None,
) -> dict[str, Any]:
    """The policy factories of the held-out evaluations (one shared engine with vLLM; see the module).

    ``served``: the training run's own vLLM policy, still running (:func:`can_share_engine`); the
    base model's weights are loaded into it first, and it serves every arm instead of a new engine.
    """

    def make(spec: str) -> Any:
        return policy_factory(
            spec,
            env_id=config.heldout_env.id,
            seed=seed,
            max_model_len=max_model_len,
            device=config.policy.learner_device,
            chat_format=config.policy.chat_format,  # an export's recorded format wins under auto
            log_file=log_file,
        )

    base: Any  # a PolicyFactory whose policy, with vLLM, is the engine every arm shares
    if served is not None and engine == "vllm":
        base_spec = parse_policy_spec(specs["base"])

        def base_weights() -> Any:
            weights = Path(base_spec.describe()["model_dir"]) / "model.safetensors"
            served.load_weights(weights, version=served.policy_version + 1)
            return served

        base = PolicyFactory(base_spec, base_weights)
    else:
        base = make(specs["base"])
    if engine != "vllm":
        return {"base": base, **{label: make(spec) for label, spec in specs.items() if label != "base"}}

    def on_base_engine(spec: str) -> PolicyFactory:
        parsed = parse_policy_spec(spec)

        def load() -> Any:
            export = resolve_run_export(parsed.path or "", parsed.step)
            policy = base()  # the base engine (started here when the base evaluation was already complete)
            policy.load_weights(export / "model.safetensors", version=policy.policy_version + 1)
            return policy

        return PolicyFactory(parsed, load)

    return {"base": base, **{label: on_base_engine(spec) for label, spec in specs.items() if label != "base"}}


def find_reusable(
    candidates: Sequence[str | Path], settings: Mapping[str, Any], spec: str, env: Mapping[str, Any]
) -> Path | None:
    """The first candidate evaluation that may stand in for one of ``spec`` with ``settings`` (or ``None``).

    It must be complete, share the episodes' settings (:data:`_SAME`), have been run against the same
    environment state (manifest ``env``), on the same engine, with weights of the same sha256 as
    ``spec``'s; anything else is skipped with a log line saying why.
    """

    info = parse_policy_spec(spec).describe()
    ours = weights_sha256(info["model_dir"]) if info.get("model_dir") else None
    for candidate in candidates:
        try:
            run = load_eval_run(candidate)
        except ConfigError as exc:
            log.info("heldout.reuse: %s skipped: %s", candidate, exc)
            continue
        theirs = run.settings.to_dict()
        why = [f for f in _SAME if theirs.get(f) != settings.get(f)]
        manifest = run.manifest or {}
        if run.status != "complete":
            why.append("incomplete")
        if manifest_differences({"env": manifest.get("env")}, {"env": dict(env)}):
            why.append("environment state")
        policy = manifest.get("policy", {})
        if ours is None or policy.get("weights_sha256") != ours or policy.get("engine") != info.get("engine"):
            why.append("policy weights or engine")
        if why:
            log.info("heldout.reuse: %s does not match (%s)", candidate, ", ".join(why))
            continue
        return Path(candidate)
    return None


def can_share_engine(config: RunConfig, policy: Any) -> bool:
    """Whether the training run's vLLM ``policy`` may serve the held-out evaluation in place of a new
    engine: it must be the engine the evaluation would start (the same base model, float32, the
    evaluation's context length, every core serving, no extra engine settings), so the numbers are
    the ones a fresh engine gives (a test compares them)."""
    hc, pc = config.heldout, config.policy
    engine = hc.engine or ("vllm" if pc.kind == "vllm" else "hf")
    budget = hc.max_total_tokens or config.heldout_env.max_total_tokens
    return (
        bool(hc.n)
        and pc.kind == "vllm"
        and engine in ("vllm", "auto")
        and pc.dtype == "float32"
        and pc.max_model_len == budget
        and pc.cpu_reserved == 0
        and not pc.kv_cache_gib
        and not pc.engine_kwargs
        and getattr(policy, "max_model_len", None) == budget
    )


def _updater(bar: Any) -> Callable[[int, int], None]:
    """``evaluate``'s ``progress(done, total)`` as updates of a :class:`~toolgym.training.progress.RunProgress` phase."""

    def update(done: int, total: int) -> None:
        bar.update(done, total=total)

    return update


async def run_heldout(
    config: RunConfig,
    run_dir: str | Path,
    train_task_ids: Sequence[str],
    *,
    warm_started: bool = False,
    served: Any = None,
    progress: Any = None,
) -> dict[str, Any]:
    """Evaluate base, control (when the run warm-started) and trained; write and return the table.

    A run killed during its held-out evaluation picks up where it stopped when ``toolgym train`` is
    run again (each evaluation directory resumes). ``served``: the training run's vLLM policy, when
    :func:`can_share_engine` allows it; the evaluation takes it over (and closes it), which saves an
    engine start. ``progress`` (a :class:`~toolgym.training.progress.RunProgress`) shows each
    evaluation's episodes as they finish (lines in a log: every tenth and every 30 s).
    """
    import contextlib

    import gymnasium

    hc, env = config.heldout, config.heldout_env  # in a mixture: heldout.env, else the first
    run_dir = Path(run_dir)
    env_kwargs = {**dict(env.kwargs), **dict(hc.kwargs), "split": hc.split}
    budget = hc.max_total_tokens or env.max_total_tokens
    engine = hc.engine or ("vllm" if config.policy.kind == "vllm" else "hf")
    if engine == "auto":
        import importlib.util

        engine = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    model = config.policy.model
    prefix = "vllm:" if engine == "vllm" else ""
    specs = {
        "base": f"vllm:{model or 'smollm2'}" if engine == "vllm" else (f"hf:{model}" if model else "smollm2")
    }
    if warm_started and hc.control:
        specs["control"] = f"{prefix}run:{run_dir}@0"
    specs["trained"] = f"{prefix}run:{run_dir}"
    probe = gymnasium.make(env.id, **env_kwargs)
    try:
        all_ids = cast(TaskToolEnv, probe.unwrapped).task_ids()
        check_disjoint(train_task_ids, all_ids)
        fingerprint = env_fingerprint(probe, env.id, env_kwargs)
        tools = sorted(t["function"]["name"] for t in probe.unwrapped.reset(seed=0)[1]["tools"])
    finally:
        probe.close()
    sampling = SamplingParams(max_tokens=hc.max_tokens, temperature=0.0)
    picked = pick_tasks(all_ids, hc.n, hc.seed)
    reused: dict[str, str] = {}
    for label, spec in specs.items():
        out = run_folder(run_folder(run_dir, "heldout"), label, create=False)  # never a planted link
        if hc.reuse and not (out / "eval.json").exists():
            wanted = EvalSettings(
                env_id=env.id,
                env_kwargs=env_kwargs,
                harnesses=tuple(hc.harnesses),
                task_ids=tuple(picked),
                seeds=tuple(hc.seed + i for i in range(len(picked))),
                max_total_tokens=budget,
                policy=spec,
                policy_info={},
                sampling=asdict(sampling),
            ).to_dict()
            source = find_reusable(hc.reuse, wanted, spec, fingerprint)
            if source is not None:
                shutil.copytree(source, out)
                write_atomic(out / "reused_from.txt", f"{source}\n")
                reused[label] = str(source)
                log.info("held-out evaluation of %s: reused %s", label, source)
    if served is not None and engine != "vllm":
        served.close()  # no engine to share: the evaluation runs on transformers
        served = None
    factories = _factories(
        specs,
        engine,
        config,
        seed=hc.seed,
        max_model_len=budget,
        served=served,
        log_file=run_dir / ENGINE_LOG,
    )
    try:
        for label, spec in specs.items():
            if label in reused:
                continue
            log.info("held-out evaluation of %s (%s)", label, spec)
            shown = progress.task(f"held-out {label}") if progress is not None else contextlib.nullcontext()
            with shown as bar:
                await evaluate(
                    env.id,
                    factories[label],
                    hc.harnesses,
                    n=hc.n,
                    seed=hc.seed,
                    concurrency=hc.concurrency,
                    sampling=sampling,
                    max_total_tokens=budget,
                    out_dir=run_dir / "heldout" / label,
                    env_kwargs=env_kwargs,
                    policy_label=spec,
                    policy_info=parse_policy_spec(spec).describe(),
                    progress=None if bar is None else _updater(bar),
                )
            if engine != "vllm":
                factories[label].close()  # two transformers models need not be held at once
    finally:
        for factory in factories.values():
            factory.close()
    runs = {label: load_eval_run(run_dir / "heldout" / label) for label in specs}
    summary = {
        "env_id": env.id,
        "split": hc.split,
        "metric": str(env_kwargs.get("metric", "the environment's reward")),
        "n": len(picked),
        "seed": hc.seed,
        "policies": specs,
        "tools": tools,
        "reused": reused,
        "tracks": _rows(runs, compare_runs, seed=hc.seed),
    }
    write_atomic(run_dir / "heldout" / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def _rows(runs: Mapping[str, Any], compare_runs: Any, *, seed: int) -> list[dict[str, Any]]:
    """One row per track and a ``pooled`` row: means, EM, tool calls, and the paired differences."""

    pairs = {"": ("base", "trained"), "rl_": ("control", "trained"), "warm_": ("base", "control")}
    comparisons = {
        key: compare_runs(runs[a], runs[b], seed=seed)
        for key, (a, b) in pairs.items()
        if a in runs and b in runs
    }
    rows = []
    for harness in runs["base"].settings.harnesses:
        summaries = {label: summarize(harness, run.trajectories[harness]) for label, run in runs.items()}
        row: dict[str, Any] = {"harness": harness}
        for key, comparison in comparisons.items():
            track = next(t for t in comparison.tracks if t.harness == harness)
            row.update({f"{key}diff": track.diff, f"{key}ci": [track.low, track.high]})
            if not key:
                row.update(n=track.n, infra_dropped=track.infra_dropped)
        for label, s in summaries.items():
            row[label] = s.reward
            row[f"{label}_em"] = s.metrics.get("reward/em", s.success)
            row[f"{label}_tool_calls"] = s.tool_calls
        rows.append(row)
    if len(rows) > 1:
        pooled: dict[str, Any] = {"harness": "pooled"}
        for key, comparison in comparisons.items():
            track = comparison.pooled
            pooled.update({f"{key}diff": track.diff, f"{key}ci": [track.low, track.high]})
            if not key:
                pooled.update(
                    n=track.n, infra_dropped=track.infra_dropped, base=track.reward_a, trained=track.reward_b
                )
            elif key == "rl_":
                pooled["control"] = track.reward_a
        for label in runs:
            pooled[f"{label}_em"] = sum(r[f"{label}_em"] for r in rows) / len(rows)
        rows.append(pooled)
    return rows
