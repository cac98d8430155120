"""The HTML report: built from a real (tiny) training run and opened in headless Chromium."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from toolgym.training.config import load_config
from toolgym.training.report import mask_runs
from toolgym.training.trainer import Trainer, report_command


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
    assert dom.count("<svg") == 6
    assert (
        'data-key="reward/mean"' in dom
        and 'data-key="curriculum/stage"' in dom
        and 'data-key="tool/answer/calls"' in dom
    )
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
