"""The HTML report: built from a real (tiny) training run and opened in headless Chromium."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from toolgym.training.commands import report_command
from toolgym.training.config import load_config
from toolgym.training.report import mask_runs
from toolgym.training.trainer import Trainer


def test_mask_runs() -> None:
    assert mask_runs([0, 0, 1, 1, 1, 0, 1]) == [(0, 2), (1, 3), (0, 1), (1, 1)]
    assert mask_runs([]) == []


def test_report_without_a_run_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        report_command(tmp_path)


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
            "policy.tiny_hidden=32",
            "sampling.max_tokens=8",
            "train.steps=2",
            "train.max_off_policy_steps=0",
            'curriculum.stages=[["answer"], ["answer", "lookup"]]',
            "curriculum.min_stay=1",
            "curriculum.patience=1",
            "curriculum.min_attempts=1",
            "curriculum.success_threshold=0.99",
        ],
    )
    run = tmp_path / "run"
    await Trainer(config, run).run()
    page = report_command(run)
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

    from toolgym.training.report import write_report

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
