"""``toolgym report RUN_DIR``: one self-contained HTML file with curves and a trajectory viewer.

No network and no JavaScript libraries: plots are inline SVG drawn here, the viewer is plain HTML with
``<details>`` elements. The viewer shows each sampled episode's messages, tool calls and results, and
which spans were trained (mask 1, the assistant's sampled tokens) versus context (mask 0).

NOTE (escaping): every value read from a run file reaches the page through
:func:`~toolgym.training.experiments.html.text` (text, quotes included) or
:func:`~toolgym.training.experiments.html.num` (a number, or, when the field holds anything else,
that shown as text): a run
directory may come from anyone, and a field such as a trajectory's ``stop_reason`` is whatever its file
says. The page has no script and no inline JSON, so there is nothing else to escape. It is written
without following a link planted at its name (:func:`toolgym.run_files.write_atomic`).
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from toolgym.agents.eval.runs import load_eval_run
from toolgym.run_files import write_atomic
from toolgym.tool_use import tool_use_means
from toolgym.training.experiments.html import html_page, num, number, read_jsonl, svg_plot, text
from toolgym.training.heldout.curve import read_curve
from toolgym.training.heldout.table import read_heldout

__all__ = ["PLOTS", "mask_runs", "write_report"]

#: (title, metric keys or glob patterns such as ``tool/*/calls``); a mixture's per-environment series
#: (``env/NAME/...``) are drawn only at the steps that sampled that environment
PLOTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Reward", ("reward/mean", "reward/shaped_mean", "reward/success_rate")),
    ("Reward per environment", ("env/*/reward_mean",)),
    ("Sampling weight per environment", ("mixture/*/weight",)),
    ("Tool calls per episode", ("tool/*/calls",)),
    ("Response length (sampled tokens)", ("response/tokens_mean",)),
    ("Context segments per episode", ("env/segments_mean",)),
    ("Staleness (policy versions)", ("staleness/mean", "staleness/max")),
    ("Curriculum stage", ("curriculum/stage", "curriculum/*/stage")),
    ("Loss", ("loss/pg", "mismatch/kl")),
    ("Entropy of the sampled tokens' distributions", ("loss/entropy",)),
    ("Groups per step (drawn, informative)", ("groups/drawn", "groups/informative")),
    ("Learning rate", ("train/lr",)),
)
MAX_TRAJECTORIES = 48


def mask_runs(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """Runs of equal mask values as ``(mask, length)``, in order."""
    runs: list[tuple[int, int]] = []
    for m in loss_mask:
        if runs and runs[-1][0] == m:
            runs[-1] = (m, runs[-1][1] + 1)
        else:
            runs.append((int(m), 1))
    return runs


def _plots(metrics: list[dict[str, Any]]) -> str:
    steps = [number(m.get("step", i + 1)) for i, m in enumerate(metrics)]
    keys = sorted({str(k) for m in metrics for k in m})
    out = []
    for title, wanted in PLOTS:
        names: list[str] = []
        for key in wanted:
            names += (
                [k for k in keys if fnmatch.fnmatchcase(k, key)]
                if "*" in key
                else [key]
                if key in keys
                else []
            )
        if not names and all(key.startswith(("env/", "mixture/")) for key in wanted):
            continue  # a mixture's plot in a one-environment run
        if names == ["env/segments_mean"] and all(m.get(names[0], 1.0) == 1.0 for m in metrics):
            continue  # nothing was compacted
        gap = {name: math.nan if name.startswith("env/") else 0.0 for name in names}
        series = {name: [number(m.get(name, gap[name])) for m in metrics] for name in names}
        out.append(svg_plot(title, steps, series))
    return "\n".join(out)


def _segment_html(segment: dict[str, Any], index: int, summary_tokens: int) -> str:
    """The boundary where a compacted episode went on in a new token sequence."""
    what = (
        f"the policy's summary ({summary_tokens} sampled tokens in the previous segment) replaced "
        f"{segment['dropped_turns']} turn(s)"
        if segment.get("summary")
        else f"{segment['dropped_results']} tool result(s) replaced by a note, {segment['dropped_turns']} "
        "turn(s) left out"
    )
    label = f"segment {index + 1} · context compacted before turn {segment['start_turn']}: {what}"
    body = text(segment["summary"]) if segment.get("summary") else ""
    return f'<div class="msg segment"><div class="role">{text(label)}</div><pre>{body}</pre></div>'


def _trajectory_html(record: dict[str, Any]) -> str:
    t = record["trajectory"]
    segments = t.get("segments", [])
    masks = [t["loss_mask"], *(s["loss_mask"] for s in segments)]
    runs_by_segment = [[n for m, n in mask_runs(mask) if m == 1] for mask in masks]
    summary_tokens = [0] * len(masks)
    for k, segment in enumerate(segments):  # a summary is the last sampled run of the segment before
        if segment.get("summary") and runs_by_segment[k]:
            summary_tokens[k + 1] = runs_by_segment[k].pop()
    runs = [n for seg in runs_by_segment for n in seg]
    starts = {s["start_turn"]: k + 1 for k, s in enumerate(segments)}
    tools = t["allowed_tools"]
    head = (
        f"step {text(record['step'])} · task {text(t['task_id'])} · reward {num(t['reward'], '.3f')} · advantage "
        f"{num(record['advantage'], '+.3f')} · {text(t['status'])} · tools "
        f"{text(', '.join(map(str, tools)) if isinstance(tools, list) else tools)} · "
        f"{'trained' if record['trained'] else 'not trained'}"
        + (f" · {len(masks)} segments" if segments else "")
        + (f" · stopped: {text(t['stop_reason'])}" if t.get("stop_reason") else "")
    )
    rows = []
    sampled = iter(runs)
    turn = 0
    for message in t["messages"]:
        role = message["role"]
        if role == "assistant":
            turn += 1
            if turn in starts:
                k = starts[turn]
                rows.append(_segment_html(segments[k - 1], k, summary_tokens[k]))
            n = next(sampled, 0)
            label = (
                f"assistant · trained, {n} sampled tokens (mask 1)"
                if record["trained"]
                else f"assistant · {n} sampled tokens (mask 1, zero advantage)"
            )
            cls = "msg trained"
        else:
            label = f"{role}{' / ' + str(message['name']) if 'name' in message else ''} · context (mask 0)"
            cls = "msg context"
        rows.append(
            f'<div class="{cls}"><div class="role">{text(label)}</div><pre>{text(message["content"])}</pre></div>'
        )
    return f'<details class="trajectory"><summary>{head}</summary>{"".join(rows)}</details>'


def _heldout_html(run_dir: Path) -> str:
    """The held-out table: base, control (the warm start) and trained per track and pooled, with the
    paired differences and their intervals."""
    summary = read_heldout(run_dir)
    if summary is None:
        return ""
    control = any("control" in r for r in summary["tracks"])

    def cell(r: dict[str, Any], key: str, fmt: str = ".3f") -> str:
        return f"<td>{num(r[key], fmt)}</td>" if key in r else "<td></td>"

    def interval(r: dict[str, Any], key: str) -> str:
        if key not in r:
            return "<td></td>"
        low, high = r[key] if isinstance(r[key], list) and len(r[key]) == 2 else (r[key], "")
        return f"<td>[{num(low, '+.3f')}, {num(high, '+.3f')}]</td>"

    rows = "".join(
        f"<tr><td>{text(r['harness'])}</td>{cell(r, 'base')}"
        + (cell(r, "control") if control else "")
        + f"{cell(r, 'trained')}{cell(r, 'diff', '+.3f')}{interval(r, 'ci')}"
        + (f"{cell(r, 'rl_diff', '+.3f')}{interval(r, 'rl_ci')}" if control else "")
        + f"{cell(r, 'base_em')}{cell(r, 'trained_em')}{cell(r, 'base_tool_calls', '.2f')}"
        f"{cell(r, 'trained_tool_calls', '.2f')}</tr>"
        for r in summary["tracks"]
    )
    head = "<th>base</th>" + ("<th>control (warm start)</th>" if control else "") + "<th>trained</th>"
    head += "<th>trained &minus; base</th><th>95% CI</th>"
    head += "<th>RL: trained &minus; control</th><th>95% CI</th>" if control else ""
    reused = summary.get("reused") or {}
    note = (
        " Reused from earlier runs (same tasks, seeds, environment and weights): "
        + ", ".join(f"{text(k)} from {text(v)}" for k, v in reused.items())
        + "."
        if reused
        else ""
    )
    return f"""<h2>Held-out evaluation</h2>
<p>{text(summary["env_id"])}, split <b>{text(summary["split"])}</b> (never trained on),
{text(summary["n"])} tasks, greedy, same tasks and seeds for every policy. Reward: {text(summary["metric"])};
differences are paired, with bootstrap 95% intervals; <i>pooled</i> pairs each task across tracks
(its mean over tracks; tasks resampled).{" The control is the warm-start export: with train.optim.lr = 0 the run would end there, so trained &minus; control is RL's own share." if control else ""}{note}</p>
<table id="heldout"><tr><th>track</th>{head}
<th>base EM</th><th>trained EM</th><th>base tool calls</th><th>trained tool calls</th></tr>{rows}</table>"""


def _tool_use_html(run_dir: Path) -> str:
    """What each held-out evaluation's episodes did with their tools (``use/*`` means per track,
    :mod:`toolgym.tool_use`), when the environment measures it; "-": not measured."""
    rows = []
    for label in ("base", "control", "trained"):
        folder = run_dir / "heldout" / label
        if not (folder / "eval.json").is_file():
            continue
        evaluation = load_eval_run(folder)
        for harness, episodes in evaluation.trajectories.items():
            rows.append((label, harness, tool_use_means(t for t in episodes if t.status != "infra_error")))
    keys = sorted({k for _, _, means in rows for k in means})
    if not keys:
        return ""
    head = "".join(f"<th>{text(k.removeprefix('use/'))}</th>" for k in keys)
    body = "".join(
        f"<tr><td>{text(label)}</td><td>{text(harness)}</td>"
        + "".join(f"<td>{num(means[k], '.3f')}</td>" if k in means else "<td>-</td>" for k in keys)
        + "</tr>"
        for label, harness, means in rows
    )
    return f"""<h2>Held-out tool use</h2>
<p>What the held-out episodes did with their tools, as the environment measures them (means over
episodes; reformulated: a query's word overlap with the question below 0.8; answer shown: a tool result
showed a gold answer).</p>
<table id="tool-use"><tr><th>policy</th><th>track</th>{head}</tr>{body}</table>"""


def _curve_html(run_dir: Path) -> str:
    """The held-out curve during training (``heldout.every``), when the run has one."""

    points = read_curve(run_dir)
    if not points:
        return ""
    keys = sorted({k for p in points for k in p if k.startswith("heldout_curve/")})
    series = {k.removeprefix("heldout_curve/"): [number(p.get(k, math.nan)) for p in points] for k in keys}
    steps = [number(p["step"]) for p in points]
    plot = svg_plot("Held-out reward and EM during training (greedy)", steps, series)
    rows = "".join(
        f"<tr><td>{num(p['step'], '.0f')}</td>"
        + "".join(f"<td>{num(p.get(k, math.nan), '.3f')}</td>" for k in keys)
        + "</tr>"
        for p in points
    )
    head = "".join(f"<th>{text(k.removeprefix('heldout_curve/'))}</th>" for k in keys)
    return f"""<h2>Held-out curve</h2><div class="plots">{plot}</div>
<table id="heldout-curve"><tr><th>step</th>{head}</tr>{rows}</table>"""


def _prompts_html(run_dir: Path, metrics: list[dict[str, Any]], events: list[dict[str, Any]]) -> str:
    """Which tools each phase's prompt offered: warm start, RL (by curriculum stage) and held-out."""
    rows = []
    warm = run_dir / "warm_start.json"
    if warm.is_file():
        tools = json.loads(warm.read_text(encoding="utf-8")).get("tools") or ["every tool of the environment"]
        rows.append(("warm start", ", ".join(map(str, tools))))
    config = (
        json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
        if (run_dir / "config.json").exists()
        else {}
    )
    stages = config.get("curriculum", {}).get("stages") or []
    last = number(metrics[-1].get("step")) if metrics else math.nan
    if stages and metrics and math.isfinite(last):
        changes = [(0, 0)]
        for e in events:  # an event that is not one toolgym writes (not numbers, no such stage) moves nothing
            step, to = number(e.get("step", 0)), e.get("to")
            if "env" not in e and math.isfinite(step) and isinstance(to, int) and 0 <= to < len(stages):
                changes.append((int(step), to))
        for (begin, stage), (end, _) in zip(changes, [*changes[1:], (int(last), 0)], strict=True):
            if begin < end:
                rows.append(
                    (f"RL steps {begin + 1}-{end} (stage {stage})", ", ".join(map(str, stages[stage])))
                )
    elif metrics:
        rows.append((f"RL steps 1-{num(metrics[-1].get('step'), '.0f')}", "every tool of the environment"))
    summary = read_heldout(run_dir)
    if summary is not None:
        rows.append(
            ("held-out", ", ".join(map(str, summary.get("tools") or ["every tool of the environment"])))
        )
    if not rows:
        return ""
    body = "".join(f"<tr><td>{text(a)}</td><td>{text(b)}</td></tr>" for a, b in rows)
    informative = sum(number(m.get("groups/informative", 0.0)) for m in metrics)
    drawn = sum(number(m.get("groups/drawn", 0.0)) for m in metrics)
    groups = (
        f'<p id="groups">{informative:.0f} of {drawn:.0f} groups drawn had reward variance and trained.</p>'
        if drawn > 0
        else ""
    )
    return f"""<h2>Prompts by phase</h2><p>The tools each phase's system prompt offered.</p>
<table id="prompts"><tr><th>phase</th><th>tools</th></tr>{body}</table>{groups}"""


def _demonstrations(run_dir: Path) -> str:
    """Where the warm start's episodes came from, as the run's own records say (its config's
    ``warm_start.source`` and ``reuse``, its manifest's reference rule)."""
    try:
        config = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
        manifest = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config, manifest = {}, {}
    ws = config.get("warm_start") if isinstance(config, dict) else None
    ws = ws if isinstance(ws, dict) else {}
    run = manifest.get("run") if isinstance(manifest, dict) else None
    rule = run.get("reference_rule") if isinstance(run, dict) else None
    if ws.get("reuse"):
        return f"loaded from the warm start of {text(ws['reuse'])}, whose"
    if ws.get("source") == "reference":
        named = f" ({text(rule)})" if rule else ""
        return f"demonstrations written by the environment's reference rule{named} (a scripted solver), tokenised for this policy:"
    if ws.get("source") == "self":
        return "sampled from the untrained policy:"
    return "from the run's records (no config.json says where its episodes came from):"


def _warm_start_html(run_dir: Path) -> str:
    path = run_dir / "warm_start.json"
    if not path.is_file():
        return ""
    w = json.loads(path.read_text(encoding="utf-8"))
    losses = ", ".join(num(x, ".3f") for x in w["epoch_losses"])
    return f"""<h2>Warm start</h2>
<p id="warm-start">Fine-tune before RL on the episodes the verifier rewarded, {_demonstrations(run_dir)} {text(w["sampled"])} episodes
on {text(w["tasks"])} training tasks (mean reward {num(w["mean_reward"], ".3f")}); {text(w["kept"])} kept from
{text(w["tasks_with_success"])} tasks (mean reward {num(w["mean_kept_reward"], ".3f")}), {text(w["tokens"])} sampled tokens;
loss per epoch {losses}; {num(w["seconds"], ".0f")} s.</p>"""


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Render ``run_dir``'s logs into ``report.html`` (or ``out``) and return the file's path."""
    run_dir = Path(run_dir)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    if not metrics:
        raise FileNotFoundError(
            f"{run_dir} has no metrics.jsonl lines: is it a toolgym training run directory?"
        )
    records = read_jsonl(run_dir / "trajectories.jsonl")
    events = read_jsonl(run_dir / "curriculum.jsonl")
    config = (
        (run_dir / "config.json").read_text(encoding="utf-8") if (run_dir / "config.json").exists() else "{}"
    )
    if len(records) > MAX_TRAJECTORIES:  # the first and the last episodes show what changed
        half = MAX_TRAJECTORIES // 2
        records = records[:half] + records[-half:]
    stage_rows = "".join(
        f"<tr><td>{text(e.get('step', ''))}</td><td>{text(e['from'])} → {text(e['to'])}</td><td>{text(str(e['env']) + ': ' if 'env' in e else '')}{text(e['signal'])}</td><td>{text(', '.join(map(str, e['tools'])))}</td></tr>"
        for e in events
    )
    heldout = _heldout_html(run_dir) + _tool_use_html(run_dir) + _curve_html(run_dir)
    warm = _warm_start_html(run_dir) + _prompts_html(run_dir, metrics, events)
    last = metrics[-1]
    summary = ", ".join(
        f"{k} = {num(last[k], '.3f')}"
        for k in ("reward/mean", "reward/shaped_mean", "curriculum/stage")
        if k in last
    )
    skipped = [m for m in metrics if m.get("train/skipped") == 1.0]
    guard = (
        f"""<p id="skipped" class="warning">{len(skipped)} step(s) skipped: a trained logprob, the loss or
the gradient norm was not finite, so the optimizer update was dropped and every weight kept (steps
{text(", ".join(str(int(m["step"])) if isinstance(m.get("step"), int | float) else "?" for m in skipped))};
their groups are in <code>nonfinite/</code>).</p>"""
        if skipped
        else ""
    )
    page = html_page(
        f"toolgym run report: {run_dir.name}",
        """.msg {{ margin: .3em 0 .3em 1em; padding: .2em .5em; border-left: 4px solid #bbb; }}
.msg.trained {{ border-color: #2ca02c; background: #f1faf1; }}
.msg.context {{ background: #f7f7f7; }}
.msg.segment {{ border-color: #ff7f0e; background: #fff6ec; }}
.role {{ font-size: .8em; color: #555; }}
pre {{ white-space: pre-wrap; margin: .2em 0; }}
.warning {{ border-left: 4px solid #d62728; background: #fdf0f0; padding: .3em .6em; }}""",
        f"""<h1>Run {text(run_dir.name)}</h1>
<p id="summary">{len(metrics)} steps. Last step: {summary}.</p>
{guard}
{heldout}
<h2>Curves</h2>
<div class="plots">{_plots(metrics)}</div>
{warm}
<h2>Curriculum</h2>
<table id="stages"><tr><th>step</th><th>stage</th><th>signal</th><th>tools</th></tr>{stage_rows}</table>
<h2>Trajectories</h2>
<p>Green: the assistant's sampled tokens (loss mask 1), trained with the shown advantage. Grey: prompt,
tool results and harness text (mask 0), never trained. Orange: a compacted episode went on in a new
token sequence (segment); every segment trains with the episode's advantage.</p>
<div id="trajectories">{"".join(_trajectory_html(r) for r in records)}</div>
<h2>Config</h2><pre id="config">{text(config)}</pre>""",
    )
    path = Path(out) if out is not None else run_dir / "report.html"
    write_atomic(path, page)  # never through a link planted at its name
    return path
