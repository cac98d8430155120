"""Paired results of an arms set: every arm against the baseline arm, corrected for several comparisons.

Each arm's held-out evaluation (``DIR/<arm>/heldout/trained``, an ordinary ``toolgym eval`` directory)
is paired with the baseline arm's through :func:`toolgym.agents.eval.runs.compare_runs`, which refuses
evaluations of other tasks, seeds, tracks or environment state; per track and pooled over the tracks
(each task's mean over tracks, tasks resampled: :func:`~toolgym.agents.eval.runs.pooled_comparison`).

Several comparisons, one family. An arms set with ``k`` arms and ``T`` tracks reports
``m = (k - 1) * (T + 1)`` differences (``T`` alone with one track): every non-baseline arm on every
track and pooled. Reading each at 95% would find a "significant" effect by chance far more often than
1 in 20, so the table corrects over all ``m``:

* **p-values, Holm–Bonferroni.** Each difference gets a two-sided paired-bootstrap p-value (the share
  of resampled mean differences on the far side of zero, doubled, with the +1 correction of a Monte
  Carlo test); :func:`holm` adjusts them. Holm controls the family-wise error rate at ``alpha`` under
  any dependence between the comparisons (tracks share tasks, arms share the baseline: they are
  correlated), and it is uniformly more powerful than plain Bonferroni.
* **Intervals, Bonferroni-widened.** Holm has no matching simultaneous intervals, so the intervals are
  percentile-bootstrap intervals at level ``1 - alpha / m``: all ``m`` cover their true differences
  together with probability at least ``1 - alpha``. They are what a reader of a null result needs (how
  large an effect the data still allow). An interval touching zero beside a Holm p below ``alpha`` can
  happen (Holm is the sharper test), never the reverse.

The bootstrap draws the same resamples as ``toolgym compare`` (same generator, seed and count), so the
uncorrected 95% interval recorded beside the corrected one is ``compare_runs``'s own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from toolgym.agents.eval.evaluate import summarize
from toolgym.agents.eval.runs import (
    MeasureComparison,
    compare_runs,
    load_eval_run,
    paired_rewards,
    pooled_pairs,
)
from toolgym.agents.eval.stats import bootstrap_means
from toolgym.errors import ConfigError
from toolgym.run_files import write_atomic

__all__ = [
    "ALPHA",
    "ArmComparison",
    "ArmsResults",
    "RESAMPLES",
    "bootstrap_test",
    "compare_arms",
    "holm",
    "latex_table",
    "markdown_table",
    "write_arms_results",
]

ALPHA = 0.05
RESAMPLES = 10_000
POOLED = "pooled"


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm–Bonferroni adjusted p-values, in the input's order.

    The ``i``-th smallest of ``m`` p-values is multiplied by ``m - i + 1`` (``i`` from 1), capped at 1,
    and made non-decreasing along the sorted order; rejecting where the adjusted p is below ``alpha``
    is Holm's step-down procedure at family-wise error rate ``alpha``.
    """
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: (pvalues[i], i))
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(pvalues[i])))
        adjusted[i] = running
    return adjusted


def bootstrap_test(
    a: Sequence[float],
    b: Sequence[float],
    *,
    family: int = 1,
    alpha: float = ALPHA,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> tuple[float, tuple[float, float], tuple[float, float], float]:
    """Paired bootstrap of ``mean(b - a)``: the mean, its 95% and Bonferroni-widened intervals, and p.

    Resamples are :func:`toolgym.agents.eval.stats.bootstrap_means`, as ``paired_bootstrap``'s are, so
    the 95% interval equals its. The widened interval has level ``1 - alpha / family``; ``p`` is the
    two-sided bootstrap p-value ``min(1, 2 * (min(#{mean* <= 0}, #{mean* >= 0}) + 1) / (resamples + 1))``
    (1 when every difference is zero).
    """

    diff, means = bootstrap_means(a, b, resamples=resamples, seed=seed)
    low, high = np.percentile(means, [2.5, 97.5])
    tail = 100 * alpha / (2 * family)
    wide_low, wide_high = np.percentile(means, [tail, 100 - tail])
    below, above = int((means <= 0).sum()), int((means >= 0).sum())
    p = min(1.0, 2 * (min(below, above) + 1) / (resamples + 1))
    return float(diff.mean()), (float(low), float(high)), (float(wide_low), float(wide_high)), p


@dataclass(frozen=True)
class ArmComparison:
    """One arm against the baseline on one track (or ``pooled``): ``arm - baseline``, paired."""

    arm: str
    track: str
    n: int
    reward_baseline: float
    reward_arm: float
    diff: float
    ci95: tuple[float, float]  # uncorrected, as toolgym compare prints it
    ci: tuple[float, float]  # Bonferroni-widened over the family
    p: float  # raw two-sided paired-bootstrap p
    p_holm: float
    infra_dropped: int = 0


@dataclass(frozen=True)
class ArmsResults:
    """The set's paired table: rewards per arm and track, and every comparison with the baseline."""

    baseline: str
    arms: tuple[str, ...]
    tracks: tuple[str, ...]  # the harness tracks, then "pooled" when there are several
    rewards: Mapping[str, Mapping[str, float]]  # arm -> track -> held-out mean reward
    comparisons: tuple[ArmComparison, ...]
    heldout: Mapping[str, Any] = field(default_factory=dict)  # env_id, split, n, seed, metric
    description: str = ""
    alpha: float = ALPHA
    resamples: int = RESAMPLES
    #: every arm's tool-use measures against the baseline's, per track (``toolgym compare``'s pairing,
    #: uncorrected 95% intervals: descriptive, outside the family); empty when none is measured
    tool_use: tuple[MeasureComparison, ...] = ()

    @property
    def family(self) -> int:
        return len(self.comparisons)

    def comparison(self, arm: str, track: str) -> ArmComparison:
        return next(c for c in self.comparisons if c.arm == arm and c.track == track)


def _mean_reward(run: Any, track: str) -> float:
    if track != POOLED:
        return summarize(track, run.trajectories[track]).reward
    per_task: dict[tuple[str, int], list[float]] = {}
    for harness in run.settings.harnesses:
        for t in run.trajectories[harness]:
            if t.status != "infra_error":
                per_task.setdefault((t.task_id, t.seed), []).append(t.reward)
    full = [sum(v) / len(v) for v in per_task.values() if len(v) == len(run.settings.harnesses)]
    return sum(full) / len(full) if full else math.nan


def compare_arms(
    runs: Mapping[str, Any],
    baseline: str,
    *,
    seed: int = 0,
    alpha: float = ALPHA,
    resamples: int = RESAMPLES,
    heldout: Mapping[str, Any] | None = None,
    description: str = "",
) -> ArmsResults:
    """Pair every arm's evaluation run (:class:`~toolgym.agents.eval.runs.EvalRun`) with the baseline's.

    Raises:
        ConfigError: a run is incomplete, or two runs are not the same episodes (``compare_runs``'s
            refusals, naming the fields), or a track has no pair both runs scored.
    """

    base = runs[baseline]
    tracks = list(base.settings.harnesses) + ([POOLED] if len(base.settings.harnesses) > 1 else [])
    arms = [name for name in runs if name != baseline]
    family = len(arms) * len(tracks)
    raw: list[dict[str, Any]] = []
    tool_use: list[MeasureComparison] = []
    for arm in arms:
        comparison = compare_runs(base, runs[arm], seed=seed)  # refuses unpaired evaluations, by field
        tool_use += [replace(m, harness=f"{arm}: {m.harness}") for m in comparison.tool_use]
        by_track = {t.harness: t for t in comparison.tracks}
        if comparison.pooled is not None:
            by_track[POOLED] = comparison.pooled
        for track in tracks:
            if track == POOLED:
                ra, rb, dropped = pooled_pairs(base, runs[arm])
            else:
                ra, rb, dropped = paired_rewards(base.trajectories[track], runs[arm].trajectories[track])
            diff, _, ci, p = bootstrap_test(
                ra, rb, family=family, alpha=alpha, resamples=resamples, seed=seed
            )
            ours = by_track[track]
            raw.append(
                {
                    "arm": arm,
                    "track": track,
                    "n": ours.n,
                    "reward_baseline": ours.reward_a,
                    "reward_arm": ours.reward_b,
                    "diff": diff,
                    "ci95": (ours.low, ours.high),
                    "ci": ci,
                    "p": p,
                    "infra_dropped": dropped,
                }
            )
    adjusted = holm([r["p"] for r in raw])
    comparisons = tuple(ArmComparison(**r, p_holm=q) for r, q in zip(raw, adjusted, strict=True))
    rewards = {name: {track: _mean_reward(run, track) for track in tracks} for name, run in runs.items()}
    return ArmsResults(
        baseline=baseline,
        arms=tuple(runs),
        tracks=tuple(tracks),
        rewards=rewards,
        comparisons=comparisons,
        heldout=dict(heldout or {}),
        description=description,
        alpha=alpha,
        resamples=resamples,
        tool_use=tuple(tool_use),
    )


# ----------------------------------------------------------------------------- tables
def _p(value: float) -> str:
    return "<0.001" if value < 0.001 else f"{value:.3f}"


def _caption(results: ArmsResults) -> str:
    h = results.heldout
    where = (
        f"{h.get('env_id', '?')} split {h.get('split', '?')}, {h.get('n', '?')} tasks, seed {h.get('seed', '?')}, "
        if h
        else ""
    )
    level = 100 * (1 - results.alpha)
    return (
        f"{results.description + '. ' if results.description else ''}Held-out reward ({where}greedy; "
        f"reward: {h.get('metric', 'the environment reward')}) per arm and track; Δ = arm − {results.baseline} "
        f"on the same tasks and seeds, paired; pooled = each task's mean over tracks. Intervals: paired "
        f"bootstrap ({results.resamples} resamples), Bonferroni-widened to simultaneous {level:g}% over the "
        f"m = {results.family} comparisons; p: two-sided paired-bootstrap p-values, Holm–Bonferroni-adjusted over m."
    )


def markdown_table(results: ArmsResults) -> str:
    """The paired table as Markdown: one row per arm; per track the reward, Δ [corrected CI] and Holm p."""
    head = ["arm"]
    for track in results.tracks:
        head += [track, f"Δ {track} [CI]", "p (Holm)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in results.arms:
        label = f"{arm} (baseline)" if arm == results.baseline else arm
        cells = [label]
        for track in results.tracks:
            cells.append(f"{results.rewards[arm][track]:.3f}")
            if arm == results.baseline:
                cells += ["—", "—"]
            else:
                c = results.comparison(arm, track)
                cells += [f"{c.diff:+.3f} [{c.ci[0]:+.3f}, {c.ci[1]:+.3f}]", _p(c.p_holm)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + _caption(results) + "\n" + tool_use_table(results)


def tool_use_table(results: ArmsResults) -> str:
    """The arms' tool-use measures against the baseline's (Markdown; empty when none is measured): per
    arm, track and measure, the baseline's and the arm's means and Δ [uncorrected 95% CI]."""
    if not results.tool_use:
        return ""
    lines = [
        "",
        f"Tool use (toolgym.tool_use), arm − {results.baseline}, paired by task and seed; uncorrected 95% intervals:",
        "",
        f"| arm: track | measure | {results.baseline} | arm | Δ [95% CI] |",
        "|---|---|---|---|---|",
    ]
    for m in results.tool_use:
        lines.append(
            f"| {m.harness} | {m.measure.removeprefix('use/')} | {m.a:.3f} | {m.b:.3f} "
            f"| {m.diff:+.3f} [{m.low:+.3f}, {m.high:+.3f}] |"
        )
    return "\n".join(lines) + "\n"


_TEX = {
    "\\": r"\textbackslash{}",
    "_": r"\_",
    "&": r"\&",
    "%": r"\%",
    "#": r"\#",
    "$": r"\$",
    "{": r"\{",
    "}": r"\}",
}


def _tex(text: str) -> str:
    return (
        "".join(_TEX.get(ch, ch) for ch in text)
        .replace("Δ", r"$\Delta$")
        .replace("−", "$-$")
        .replace("–", "--")
    )


def _tex_num(value: float) -> str:
    return f"${value:+.3f}$"


def latex_table(results: ArmsResults, label: str = "arms") -> str:
    """The paired table as a LaTeX ``table`` (booktabs): a column group per track, caption and label."""
    tracks = results.tracks
    spec = "l" + "rrr" * len(tracks)
    groups = " & ".join(rf"\multicolumn{{3}}{{c}}{{{_tex(t)}}}" for t in tracks)
    rules = " ".join(rf"\cmidrule(lr){{{2 + 3 * i}-{4 + 3 * i}}}" for i in range(len(tracks)))
    sub = " & ".join(r"reward & $\Delta$ [CI] & $p$" for _ in tracks)
    rows = []
    for arm in results.arms:
        cells = [_tex(arm) + (" (baseline)" if arm == results.baseline else "")]
        for track in tracks:
            cells.append(f"{results.rewards[arm][track]:.3f}")
            if arm == results.baseline:
                cells += ["--", "--"]
            else:
                c = results.comparison(arm, track)
                cells += [
                    f"{_tex_num(c.diff)} [{_tex_num(c.ci[0])}, {_tex_num(c.ci[1])}]",
                    "$<$0.001" if c.p_holm < 0.001 else f"{c.p_holm:.3f}",
                ]
        rows.append(" & ".join(cells) + r" \\")
    body = "\n".join(rows)
    return (
        "\\begin{table}[t]\n\\centering\n\\small\n"
        f"\\begin{{tabular}}{{{spec}}}\n\\toprule\n & {groups} \\\\\n{rules}\narm & {sub} \\\\\n\\midrule\n"
        f"{body}\n\\bottomrule\n\\end{{tabular}}\n"
        f"\\caption{{{_tex(_caption(results))}}}\n\\label{{tab:{label}}}\n\\end{{table}}\n"
    )


# ----------------------------------------------------------------------------- the set's files
def results_dict(results: ArmsResults) -> dict[str, Any]:
    """``arms.json``'s results part: the table's numbers and how they were corrected."""
    return {
        "baseline": results.baseline,
        "arms": list(results.arms),
        "tracks": list(results.tracks),
        "heldout": dict(results.heldout),
        "rewards": {a: dict(r) for a, r in results.rewards.items()},
        "correction": {
            "p_values": "two-sided paired bootstrap, Holm-Bonferroni adjusted over the family",
            "intervals": "percentile paired bootstrap, Bonferroni-widened: simultaneous 1 - alpha over the family",
            "family": results.family,
            "alpha": results.alpha,
            "interval_level": 1 - results.alpha / max(results.family, 1),
            "resamples": results.resamples,
        },
        "comparisons": [asdict(c) for c in results.comparisons],
        "tool_use": [asdict(m) for m in results.tool_use],
    }


def write_arms_results(out_dir: str | Path) -> str:
    """Compare a finished set's arms (``DIR/arms_plan.json``) and write ``arms.json``, ``.md``, ``.tex``.

    Returns the Markdown table, or ``""`` when the arms have no held-out evaluation (``arms.json`` then
    records the arms and their wall times only).

    Raises:
        ConfigError: no plan in ``out_dir``, or an arm's held-out evaluation missing or unpaired.
    """

    out = Path(out_dir)
    try:
        plan = json.loads((out / "arms_plan.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"{out} holds no arms set (arms_plan.json: {exc}); run toolgym train --arms first"
        ) from None
    arms = [a["name"] for a in plan["arms"]]
    records = {}
    for name in arms:
        path = out / name / "arm.json"
        records[name] = (
            json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {"status": "not started"}
        )
    data: dict[str, Any] = {
        "format": 1,
        "description": plan.get("description", ""),
        "config": plan.get("config"),
        "notes": plan.get("notes", []),
        "arms": [
            {
                "name": a["name"],
                "description": a.get("description", ""),
                "set": a["set"],
                "command": a["command"],
                "status": records[a["name"]].get("status"),
                "wall_s": records[a["name"]].get("wall_s"),
                "attempts": records[a["name"]].get("attempts"),
            }
            for a in plan["arms"]
        ],
    }
    first = plan["arms"][0]["config"]
    hc = first["heldout"]
    table = ""
    if hc["n"]:
        runs = {name: load_eval_run(out / name / "heldout" / "trained") for name in arms}
        env_kwargs = {**first["env"]["kwargs"], **hc["kwargs"]}
        heldout = {
            "env_id": first["env"]["id"],
            "split": hc["split"],
            "n": len(runs[arms[0]].settings.task_ids),
            "seed": hc["seed"],
            "metric": str(env_kwargs.get("metric", "the environment's reward")),
        }
        results = compare_arms(
            runs, plan["baseline"], seed=hc["seed"], heldout=heldout, description=plan.get("description", "")
        )
        data["results"] = results_dict(results)
        data["untrained"] = _untrained(out / plan["arms"][0]["name"] / "heldout")
        table = markdown_table(results)
        write_atomic(out / "arms.md", table)
        write_atomic(out / "arms.tex", latex_table(results, label=f"arms-{out.name}"))
    write_atomic(out / "arms.json", json.dumps(data, indent=2) + "\n")
    return table


def _untrained(heldout_dir: Path) -> dict[str, dict[str, float]]:
    """The first arm's ``base`` (and ``control``) evaluations, shared by every arm: context for the table."""

    out: dict[str, dict[str, float]] = {}
    for label in ("base", "control"):
        if (heldout_dir / label / "eval.json").is_file():
            run = load_eval_run(heldout_dir / label)
            tracks = list(run.settings.harnesses) + ([POOLED] if len(run.settings.harnesses) > 1 else [])
            out[label] = {track: _mean_reward(run, track) for track in tracks}
    return out
