"""The HTML report: built from a real (tiny) training run and opened in headless Chromium."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from toolgym.training.config import load_config
from toolgym.training.experiments.report import mask_runs, write_report
from toolgym.training.trainer import Trainer


def test_mask_runs() -> None:
    assert mask_runs([0, 0, 1, 1, 1, 0, 1]) == [(0, 2), (1, 3), (0, 1), (1, 1)]
    assert mask_runs([]) == []


def test_report_without_a_run_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        write_report(tmp_path)


def chromium() -> str:
    if os.environ.get("TOOLGYM_SKIP_CHROMIUM") == "1":
        pytest.skip("TOOLGYM_SKIP_CHROMIUM=1")
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, (
        "Chromium is required for this test: apt-get install -y chromium (or set TOOLGYM_SKIP_CHROMIUM=1)"
    )
    return exe


async def test_report_renders_plots_and_trajectories_in_chromium(tmp_path: Path) -> None:
    exe = chromium()
    config = load_config(
        None,
        [
            "env.id=toy_env:toolgym-test/Letters-v0",
            "policy.kind=tiny",
            "policy.hidden=32",
            "sampling.max_tokens=8",
            "train.steps=2",
            "train.rollouts.max_off_policy_steps=0",
            'curriculum.stages=[["answer"], ["answer", "lookup"]]',
            "curriculum.min_stay=1",
            "curriculum.patience=1",
            "curriculum.min_attempts=1",
            "curriculum.success_threshold=0.99",
        ],
    )
    run = tmp_path / "run"
    await Trainer(config, run).run()
    page = write_report(run)
    assert page == run / "report.html"
    assert "http://" not in page.read_text().replace(
        'xmlns="http://www.w3.org/2000/svg"', ""
    )  # self-contained
    profile = tmp_path / "profile"
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--no-first-run",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
    ]
    dom = subprocess.run(
        [exe, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120
    ).stdout
    assert dom.count("<svg") == 9  # six curves, entropy, groups per step, learning rate
    assert (
        'data-key="reward/mean"' in dom
        and 'data-key="curriculum/stage"' in dom
        and 'data-key="tool/answer/calls"' in dom
        and 'data-key="loss/entropy"' in dom
        and 'data-key="groups/informative"' in dom
    )
    assert 'id="prompts"' in dom and "RL steps 1-1 (stage 0)" in dom and "RL steps 2-2 (stage 1)" in dom
    assert dom.count('class="trajectory"') == 2 * 2 * 4
    assert "sampled tokens (mask 1" in dom and "context (mask 0)" in dom
    assert "Say a word with" in dom  # a task prompt made it into the viewer
    assert "answer, lookup" in dom  # the stage change is listed
    shot = tmp_path / "shot.png"
    subprocess.run(
        [exe, *flags, f"--screenshot={shot}", "--window-size=1200,900", page.as_uri()],
        capture_output=True,
        timeout=120,
    )
    assert shot.is_file() and shot.stat().st_size > 10_000  # a rendered page, not a blank one


def test_report_shows_the_heldout_table_and_the_warm_start(tmp_path: Path) -> None:
    import json

    from toolgym.training.experiments.report import write_report

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1.0, "reward/mean": 0.1}) + "\n")
    (tmp_path / "heldout").mkdir()
    row = {"n": 100, "base": 0.02, "trained": 0.17, "diff": 0.15, "ci": [0.1, 0.2], "base_em": 0.0}
    row |= {"trained_em": 0.09, "base_tool_calls": 0.4, "trained_tool_calls": 1.0, "infra_dropped": 0}
    summary = {"env_id": "toolgym/SearchQA-v0", "split": "test", "metric": "f1", "n": 100, "seed": 0}
    summary["tracks"] = [{"harness": "bare", **row}, {"harness": "scaffold", **row, "diff": -0.01}]
    (tmp_path / "heldout" / "summary.json").write_text(json.dumps(summary))
    warm = {"sampled": 64, "kept": 27, "tasks_with_success": 27, "tasks": 64, "mean_reward": 0.4}
    warm |= {"mean_kept_reward": 1.0, "epoch_losses": [1.5, 0.75], "tokens": 2000, "seconds": 90.0}
    (tmp_path / "warm_start.json").write_text(json.dumps(warm))
    page = write_report(tmp_path).read_text()
    table = page[page.index('<table id="heldout">') : page.index("</table>", page.index('id="heldout"'))]
    assert (
        table.count("<tr>") == 3 and "+0.150" in table and "-0.010" in table and "[+0.100, +0.200]" in table
    )
    assert "split <b>test</b>" in page and page.index("Held-out evaluation") < page.index("<h2>Curves</h2>")
    assert "27 kept from\n27 tasks" in page and "1.500, 0.750" in page
    # the sentence says where the demonstrations came from, as the run's records say
    assert "sampled from the untrained policy" not in page and "no config.json says" in page
    (tmp_path / "config.json").write_text(json.dumps({"warm_start": {"source": "reference", "reuse": ""}}))
    (tmp_path / "manifest.json").write_text(json.dumps({"run": {"reference_rule": "reformulate"}}))
    assert "the environment's reference rule (reformulate)" in write_report(tmp_path).read_text()
    (tmp_path / "config.json").write_text(json.dumps({"warm_start": {"source": "self", "reuse": ""}}))
    page = write_report(tmp_path).read_text()
    assert "sampled from the untrained policy" in page and "reference rule" not in page
    (tmp_path / "config.json").write_text(json.dumps({"warm_start": {"source": "self", "reuse": "runs/a"}}))
    assert "loaded from the warm start of runs/a" in write_report(tmp_path).read_text()


SCRIPT = "<script>alert(1)</script>"


def _planted_run(run: Path) -> None:
    """A run directory whose every text field the report shows holds markup (planted, or just odd)."""
    import json

    run.mkdir(parents=True, exist_ok=True)
    metrics = {"step": 1.0, "reward/mean": SCRIPT, "groups/drawn": 2.0, "groups/informative": SCRIPT}
    (run / "metrics.jsonl").write_text(json.dumps(metrics) + "\n")
    trajectory = {
        "task_id": SCRIPT,
        "reward": SCRIPT,
        "status": SCRIPT,
        "allowed_tools": [SCRIPT, "answer"],
        "stop_reason": SCRIPT,
        "loss_mask": [0, 1],
        "segments": [],
        "messages": [
            {"role": "user", "name": SCRIPT, "content": SCRIPT},
            {"role": "assistant", "content": SCRIPT},
        ],
    }
    record = {"step": SCRIPT, "advantage": SCRIPT, "trained": True, "trajectory": trajectory}
    (run / "trajectories.jsonl").write_text(json.dumps(record) + "\n")
    event = {"step": SCRIPT, "from": SCRIPT, "to": 0, "signal": SCRIPT, "tools": [SCRIPT]}
    (run / "curriculum.jsonl").write_text(json.dumps(event) + "\n")
    (run / "config.json").write_text(json.dumps({"curriculum": {"stages": [[SCRIPT]]}, "x": SCRIPT}))
    warm = {"sampled": SCRIPT, "kept": SCRIPT, "tasks_with_success": SCRIPT, "tasks": SCRIPT}
    warm |= {"mean_reward": SCRIPT, "mean_kept_reward": 1.0, "epoch_losses": [SCRIPT], "tokens": SCRIPT}
    (run / "warm_start.json").write_text(json.dumps({**warm, "seconds": SCRIPT, "tools": [SCRIPT]}))
    (run / "heldout").mkdir(exist_ok=True)
    row = {"harness": SCRIPT, "base": SCRIPT, "trained": 0.1, "diff": 0.1, "ci": [SCRIPT, 0.2]}
    summary = {"env_id": SCRIPT, "split": SCRIPT, "metric": SCRIPT, "n": SCRIPT, "tracks": [row]}
    summary |= {"tools": [SCRIPT], "reused": {SCRIPT: SCRIPT}}
    (run / "heldout" / "summary.json").write_text(json.dumps(summary))
    curve = {"step": SCRIPT, "heldout_curve/bare/reward": SCRIPT}
    (run / "heldout_curve.jsonl").write_text(json.dumps(curve) + "\n")


def test_every_field_the_report_shows_is_escaped(tmp_path: Path) -> None:
    """Each run-file value reaches the page as text: planted markup never becomes markup."""
    from toolgym.training.experiments.report import write_report

    run = tmp_path / "<u>run"  # the folder's name is shown too
    _planted_run(run)
    page = write_report(run).read_text()
    assert "<script" not in page and "<u>" not in page and "&lt;u&gt;run" in page
    shown = page.count("&lt;script&gt;alert(1)&lt;/script&gt;")
    # stop_reason, allowed_tools, status, task, reward, step, advantage, a message's name and content
    # (twice), curriculum step/from/signal/tools, stages, warm start fields, held-out fields, config
    assert shown >= 25, shown
    viewer = page[page.index('<div id="trajectories">') :]
    for field in ("stopped: &lt;script&gt;", "tools &lt;script&gt;alert(1)&lt;/script&gt;, answer"):
        assert field in viewer
    assert viewer.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 9


def test_every_field_the_arms_report_shows_is_escaped(tmp_path: Path) -> None:
    import json

    from toolgym.errors import ConfigError
    from toolgym.training.experiments.arms_report import write_arms_report

    out = tmp_path / "arms"
    _planted_run(out / "a")
    arm = {"name": "a", "description": SCRIPT, "set": [SCRIPT], "command": SCRIPT}
    plan = {"arms": [arm], "baseline": SCRIPT, "description": SCRIPT, "config": SCRIPT, "notes": [SCRIPT]}
    (out / "arms_plan.json").write_text(json.dumps(plan))
    comparison = {"arm": "a", "track": SCRIPT, "diff": SCRIPT, "ci": [SCRIPT, 0.1], "p_holm": SCRIPT}
    results = {
        "tracks": [SCRIPT],
        "arms": ["a"],
        "baseline": SCRIPT,
        "comparisons": [comparison],
        "rewards": {"a": {SCRIPT: SCRIPT}},
        "correction": {"resamples": SCRIPT, "interval_level": SCRIPT, "family": SCRIPT, "alpha": SCRIPT},
        "heldout": {"env_id": SCRIPT, "split": SCRIPT, "n": SCRIPT, "seed": SCRIPT, "metric": SCRIPT},
    }
    arms = {"results": results, "arms": [{"name": "a", "status": SCRIPT, "wall_s": SCRIPT}]}
    (out / "arms.json").write_text(json.dumps({**arms, "untrained": {SCRIPT: {SCRIPT: SCRIPT}}}))
    page = write_arms_report(out).read_text()
    assert "<script" not in page
    assert page.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 25
    assert "<td>&lt;script&gt;alert(1)&lt;/script&gt;</td>" in page  # the arm's status
    assert "<script" not in (out / "a" / "report.html").read_text()
    # an arm name that is a path or a URL is refused before anything is written
    for name in ("../elsewhere", "javascript:alert(1)"):
        (out / "arms_plan.json").write_text(json.dumps({**plan, "arms": [{**arm, "name": name}]}))
        with pytest.raises(ConfigError, match="names an arm"):
            write_arms_report(out)
    assert not (tmp_path / "elsewhere").exists()


async def test_the_report_shows_what_the_held_out_episodes_did_with_their_tools(tmp_path: Path) -> None:
    import json

    from toolgym.agents.eval.evaluate import evaluate
    from toolgym.agents.policies.base import RulePolicy
    from toolgym.core import SamplingParams
    from toolgym.envs.search_qa import baseline_rule
    from toolgym.training.experiments.report import write_report

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1.0, "reward/mean": 0.1}) + "\n")
    await evaluate(
        "toolgym/SearchQA-v0",
        lambda: RulePolicy(baseline_rule(), name="scripted"),
        ("bare",),
        n=3,
        seed=0,
        out_dir=tmp_path / "heldout" / "trained",
        env_kwargs={"split": "test"},
        sampling=SamplingParams(max_tokens=2048),
        max_total_tokens=1 << 17,
    )
    page = write_report(tmp_path).read_text()
    table = page[page.index('<table id="tool-use">') : page.index("</table>", page.index('id="tool-use"'))]
    assert "<th>searches</th>" in table and "<th>reformulated</th>" in table
    assert table.count("<tr>") == 2 and "<td>trained</td><td>bare</td>" in table
    headers = re.findall(r"<th>(.*?)</th>", table)
    cells = re.findall(r"<td>(.*?)</td>", table)
    assert cells[headers.index("searches")] == "1.000"  # the scripted baseline searches once per episode
