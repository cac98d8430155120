"""Kill a training run with SIGKILL mid-run, resume it, and get the uninterrupted run's results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from toolgym.procs import describe, process_record

HERE = Path(__file__).resolve().parent
OVERRIDES = [
    "env.id=toy_env:toolgym-test/Letters-v0",
    "env.kwargs.latency=0.02",
    "policy.kind=tiny",
    "policy.hidden=32",
    "sampling.max_tokens=10",
    "train.steps=6",
    "train.tasks_per_step=2",
    "train.group_size=3",
    "train.optim.lr=0.01",
    "train.rollouts.max_off_policy_steps=0",
    "train.checkpoint_every=1",
    "train.seed=3",
    'curriculum.stages=[["answer"], ["answer", "lookup"]]',
    "curriculum.min_stay=2",
    "curriculum.patience=1",
    "curriculum.min_attempts=1",
    "curriculum.success_threshold=0.99",
]
# The same run over a mixture of two environments (groups from each, a curriculum per environment,
# advantages scaled by each environment's reward history): the mixture's state must cross the kill.
LETTERS = 'id = "toy_env:toolgym-test/Letters-v0", kwargs = { latency = 0.02'
MIXTURE = [o for o in OVERRIDES if not o.startswith(("env.", "curriculum.stages"))] + [
    f'env=[{{ {LETTERS} }}, name = "wide", stages = [["answer"], ["answer", "lookup"]] }}, '
    f'{{ {LETTERS}, n_tasks = 3 }}, name = "narrow", weight = 2.0, stages = [["answer"], ["answer", "lookup"]] }}]',
    "mixture.window=2",
    "mixture.normalize=std",  # advantages depend on each environment's reward history: it must survive
]
SCRIPT = "import sys; from toolgym.training.commands import train_command; train_command(None, sys.argv[2:], sys.argv[1])"


def start(run_dir: Path, overrides: list[str] = OVERRIDES) -> subprocess.Popen:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(run_dir), *overrides], env=env, stderr=subprocess.PIPE, text=True
    )


def comparable(run_dir: Path) -> tuple[list[dict], list[tuple]]:
    metrics = [
        {k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    records = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    trajs = [
        (
            r["step"],
            r["group"],
            r["sample"],
            r["advantage"],
            tuple(r["trajectory"]["token_ids"]),
            r["trajectory"]["reward"],
        )
        for r in records
    ]
    return metrics, trajs


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [OVERRIDES, MIXTURE], ids=["one-env", "mixture"])
def test_sigkill_mid_run_then_resume_reproduces_the_uninterrupted_run(
    tmp_path: Path, overrides: list[str]
) -> None:
    full, killed = tmp_path / "full", tmp_path / "killed"
    proc = start(full, overrides)
    assert proc.wait(timeout=600) == 0, proc.stderr.read()

    proc = start(killed, overrides)
    metrics_file = killed / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run finished before it could be killed"
    killed_pid = proc.pid
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    steps_at_kill = len(metrics_file.read_text().splitlines())
    assert steps_at_kill < 6
    # The run lists the processes its policy started (none for the tiny policy) in its private record;
    # stand in a process for a vLLM engine a killed run leaves behind: the rerun must stop it.
    assert not (killed / "processes.json").exists()  # never in the run directory
    record = json.loads(process_record(killed).read_text())
    assert record["owner"]["pid"] == killed_pid and record["processes"] == []
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    record["processes"] = [describe(leftover.pid)]
    process_record(killed).write_text(json.dumps(record))

    proc = start(killed, overrides)  # same command: it resumes from killed/checkpoint.pt
    try:
        assert proc.wait(timeout=600) == 0, proc.stderr.read()
        assert leftover.wait(timeout=5) == -signal.SIGKILL
    finally:
        leftover.kill()

    full_metrics, full_trajs = comparable(full)
    resumed_metrics, resumed_trajs = comparable(killed)
    assert [m["step"] for m in resumed_metrics] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # no step lost or twice
    assert resumed_metrics == full_metrics
    assert resumed_trajs == full_trajs  # every trajectory exactly once, identical tokens and advantages
    assert len({(s, g, i) for s, g, i, *_ in resumed_trajs}) == len(resumed_trajs) == 6 * 2 * 3
    if overrides is OVERRIDES:
        assert any(m["curriculum/stage"] == 1.0 for m in full_metrics)  # the curriculum crossed the kill too
    else:  # both environments sampled, and each curriculum crossed the kill
        assert all(sum(m[f"env/{n}/groups"] for m in full_metrics) > 0 for n in ("wide", "narrow"))
        assert any(m["curriculum/wide/stage"] + m["curriculum/narrow/stage"] >= 1.0 for m in full_metrics)
