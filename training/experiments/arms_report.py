"""``toolgym report DIR`` on an arms set: every arm's curves on shared plots, and the paired table.

One self-contained HTML file, ``DIR/report.html`` (inline SVG, no JavaScript, as the run report):
the paired table of ``DIR/arms.json`` (or a note that the set is not finished), one plot per metric
with one line per arm (training reward, the held-out curve, tool calls, curriculum stage, segments,
response length, entropy: each drawn when some arm logged it), each arm's settings, command and wall
time. Each arm's own run report is written too (``DIR/<arm>/report.html``) and linked.

NOTE (escaping): as in the run report, every value from the set's files reaches the page escaped
(:func:`~toolgym.training.experiments.html.text`, :func:`~toolgym.training.experiments.html.num`). An arm's name is checked
to be one toolgym gives (letters, digits, ``-``, ``_``) before anything is read or written: it is a
folder of the set and a relative link, so ``../elsewhere`` or ``javascript:...`` is refused.
"""

from __future__ import annotations

import fnmatch
import json
import math
from pathlib import Path
from typing import Any

from toolgym.errors import ConfigError
from toolgym.run_files import write_atomic
from toolgym.training.experiments.arms import _NAME
from toolgym.training.experiments.html import html_page, num, number, read_jsonl, svg_plot, text
from toolgym.training.experiments.report import write_report

__all__ = ["ARM_PLOTS", "is_arms_dir", "write_arms_report"]

#: (title, metric key or glob); one plot per matching key, one line per arm
ARM_PLOTS: tuple[tuple[str, str], ...] = (
    ("Training reward (reward/mean)", "reward/mean"),
    ("Held-out curve: {key}", "heldout_curve/*/reward"),
    ("Success rate (reward/success_rate)", "reward/success_rate"),
    ("Tool calls per episode: {key}", "tool/*/calls"),
    ("Curriculum stage", "curriculum/stage"),
    ("Context segments per episode", "env/segments_mean"),
    ("Response length (sampled tokens)", "response/tokens_mean"),
    ("Entropy of the sampled tokens' distributions", "loss/entropy"),
)


def is_arms_dir(path: str | Path) -> bool:
    """Whether ``path`` holds an arms set (``toolgym train --arms``) rather than one run."""
    return (Path(path) / "arms_plan.json").is_file()


def _plots(metrics: dict[str, list[dict[str, Any]]]) -> str:
    keys = sorted({k for rows in metrics.values() for row in rows for k in row})
    steps = sorted(
        {number(row.get("step", i + 1)) for rows in metrics.values() for i, row in enumerate(rows)}
    )
    out = []
    for title, pattern in ARM_PLOTS:
        for key in [k for k in keys if fnmatch.fnmatchcase(k, pattern)]:
            series = {}
            for arm, rows in metrics.items():
                by_step = {
                    number(r.get("step", i + 1)): number(r[key]) for i, r in enumerate(rows) if key in r
                }
                if by_step:
                    series[arm] = [by_step.get(s, math.nan) for s in steps]
            if key == "env/segments_mean" and all(
                v in (1.0,) or math.isnan(v) for ys in series.values() for v in ys
            ):
                continue  # nothing was compacted
            if series:
                out.append(svg_plot(title.format(key=key), steps, series))
    return "".join(out) or "<p>No arm has logged a step yet.</p>"


def _table(arms_json: dict[str, Any]) -> str:
    results = arms_json.get("results")
    if not results:
        return "<p>No paired table: the set is not finished, or its arms have no held-out evaluation.</p>"
    tracks = results["tracks"]
    by = {(c["arm"], c["track"]): c for c in results["comparisons"]}
    head = "".join(f'<th colspan="3">{text(t)}</th>' for t in tracks)
    sub = "<th>reward</th><th>&Delta; [CI]</th><th>p (Holm)</th>" * len(tracks)
    rows = []
    for arm in results["arms"]:
        cells = [f"<td>{text(arm)}{' (baseline)' if arm == results['baseline'] else ''}</td>"]
        for track in tracks:
            cells.append(f"<td>{num(results['rewards'][arm][track], '.3f')}</td>")
            c = by.get((arm, track))
            if c is None:
                cells.append("<td>&mdash;</td><td>&mdash;</td>")
            else:
                p = "&lt;0.001" if number(c["p_holm"]) < 0.001 else num(c["p_holm"], ".3f")
                low, high = c["ci"]
                cells.append(
                    f"<td>{num(c['diff'], '+.3f')} [{num(low, '+.3f')}, {num(high, '+.3f')}]</td><td>{p}</td>"
                )
        rows.append("<tr>" + "".join(cells) + "</tr>")
    corr = results["correction"]
    untrained = arms_json.get("untrained") or {}
    names = {"base": "the untrained base model", "control": "the warm-start export (RL's control)"}
    context = "".join(
        f"<li>{text(names.get(label, label))}, shared by every arm: "
        + ", ".join(f"{text(t)} {num(v, '.3f')}" for t, v in values.items())
        + "</li>"
        for label, values in untrained.items()
    )
    h = results["heldout"]
    simultaneous = (
        num(1 - corr["alpha"], ".0%") if isinstance(corr["alpha"], int | float) else text(corr["alpha"])
    )
    return f"""<p>{text(h.get("env_id"))}, split <b>{text(h.get("split"))}</b>, {text(h.get("n"))} tasks,
seed {text(h.get("seed"))}, greedy; reward: {text(h.get("metric"))}. &Delta; = arm &minus; baseline on the same
tasks and seeds. Intervals: paired bootstrap ({text(corr["resamples"])} resamples) at level {num(corr["interval_level"], ".4f")}
(Bonferroni over the m = {text(corr["family"])} comparisons: simultaneous {simultaneous}); p: two-sided
paired-bootstrap p-values, Holm&ndash;Bonferroni-adjusted over m.</p>
<table id="arms"><tr><th rowspan="2">arm</th>{head}</tr><tr>{sub}</tr>{"".join(rows)}</table>
{f"<ul>{context}</ul>" if context else ""}"""


def write_arms_report(out_dir: str | Path) -> Path:
    """Render ``out_dir``'s arms set into ``out_dir/report.html`` (and each arm's own report); return its path."""
    out = Path(out_dir)
    plan = json.loads((out / "arms_plan.json").read_text(encoding="utf-8"))
    arms_json = (
        json.loads((out / "arms.json").read_text(encoding="utf-8")) if (out / "arms.json").is_file() else {}
    )
    for arm in plan["arms"]:  # a name is a folder of the set: never a path out of it
        if not isinstance(arm.get("name"), str) or not _NAME.fullmatch(arm["name"]):
            raise ConfigError(
                f"{out / 'arms_plan.json'} names an arm {arm.get('name')!r}, not a name toolgym gives an arm "
                "(letters, digits, '-', '_'); the file was changed outside toolgym"
            )
    records = {a["name"]: a for a in arms_json.get("arms", [])}
    metrics = {a["name"]: read_jsonl(out / a["name"] / "metrics.jsonl") for a in plan["arms"]}
    settings = []
    for arm in plan["arms"]:
        name = arm["name"]
        link = ""
        if metrics[name]:
            write_report(out / name)
            link = f' (<a href="{text(name)}/report.html">run report</a>)'
        record = records.get(name, {})
        wall = record.get("wall_s")
        status = record.get("status") or ("trained" if metrics[name] else "not started")
        settings.append(
            f"<tr><td>{text(name)}{link}</td><td>{text(arm.get('description') or '')}</td>"
            f"<td>{text(', '.join(map(str, arm['set'])) or '(the base settings)')}</td>"
            f"<td>{text(status)}</td><td>{'' if wall is None else num(wall, '.0f') + ' s'}</td>"
            f"<td><code>{text(arm['command'])}</code></td></tr>"
        )
    notes = "".join(f"<li>{text(n)}</li>" for n in plan.get("notes", []))
    page = html_page(
        f"toolgym arms report: {out.name}",
        "#arms td {{ white-space: nowrap; }}",
        f"""<h1>Arms {text(out.name)}</h1>
<p id="description">{text(str(plan.get("description") or "").rstrip(".") + ".")} Baseline arm: <b>{text(plan["baseline"])}</b>;
base config: {text(plan.get("config") or "the defaults")}.</p>
{f"<ul>{notes}</ul>" if notes else ""}
<h2>Held-out, paired with the baseline arm</h2>
{_table(arms_json)}
<h2>Curves, every arm</h2>
<div class="plots">{_plots(metrics)}</div>
<h2>Arms</h2>
<table id="arm-settings"><tr><th>arm</th><th>description</th><th>its settings</th><th>status</th><th>wall time</th><th>command</th></tr>
{"".join(settings)}</table>""",
    )
    path = out / "report.html"
    write_atomic(path, page)  # never through a link planted at its name
    return path
