"""Experiment trackers (TensorBoard, W&B offline) fed by real training and evaluation runs, and the
resumed-run manifest check."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from toolgym.cli import main
from toolgym.errors import ConfigError
from toolgym.records.trackers import Trackers, check_trackers, open_trackers, parse_trackers
from toolgym.training.commands import train_command
from toolgym.training.config import load_config

TINY = [
    "env.id=toy_env:toolgym-test/Letters-v0",
    "policy.kind=tiny",
    "policy.hidden=32",
    "sampling.max_tokens=8",
    "train.rollouts.max_off_policy_steps=0",
    "train.tasks_per_step=2",
    "train.group_size=2",
]


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def texts(log_dir: Path, tag: str) -> list[tuple[int, str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")]


def wandb_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def wandb_tables(run: Path, name: str) -> list[dict[str, Any]]:
    files = sorted((run / "files" / "media" / "table").glob(f"{name}_*.table.json"))
    return [json.loads(f.read_text()) for f in files]


def test_names_are_checked_with_a_suggestion() -> None:
    assert parse_trackers("tensorboard, wandb,tensorboard") == ("tensorboard", "wandb")
    assert parse_trackers("") == ()
    with pytest.raises(ConfigError, match="Did you mean 'tensorboard'"):
        parse_trackers("tensorbord")
    with pytest.raises(ConfigError, match="unknown logger 'mlflow'"):
        load_config(None, ['train.loggers=["mlflow"]'])
    assert load_config(None, ['train.loggers=["wandb"]']).train.loggers == ("wandb",)


def test_a_missing_package_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'toolgym\[wandb\]'"):
        check_trackers(["wandb"])
    with pytest.raises(ConfigError, match=r"toolgym\[wandb\]"):  # before any training work
        train_command(None, [*TINY, 'train.loggers=["wandb"]'], tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    eval_argv = ["eval", "--env", "toolgym/SearchQA-v0", "--policy", "scripted", "--n", "2"]
    assert main([*eval_argv, "--logger", "tensorboard"]) == 2
    assert "--logger writes into the run directory: give --out DIR" in capsys.readouterr().err
    assert main([*eval_argv, "--logger", "wandb", "--out", str(tmp_path / "eval")]) == 2
    assert "toolgym[wandb]" in capsys.readouterr().err
    assert not (tmp_path / "eval" / "summary.json").exists()  # refused before the evaluation


class Broken:
    def __init__(self) -> None:
        self.closed = 0

    def log_config(self, config: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        raise OSError("disk full")

    def log_table(self, name: str, step: int, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        raise AssertionError("a dropped tracker is never called again")

    def close(self) -> None:
        self.closed += 1


class Recorder(Broken):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.seen.append((step, dict(metrics)))

    def log_table(self, name: str, step: int, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.seen.append((name, step, len(rows)))


def test_a_failing_tracker_is_dropped_and_the_others_go_on(caplog: pytest.LogCaptureFixture) -> None:
    broken, good = Broken(), Recorder()
    trackers = Trackers([("broken", broken), ("good", good)])
    trackers.log_metrics(1, {"a": 1.0})
    trackers.log_table("t", 1, ["x"], [[1], [2]])
    assert trackers.names == ("good",) and broken.closed == 1
    assert good.seen == [(1, {"a": 1.0}), ("t", 1, 2)]
    assert "logger 'broken' failed (OSError: disk full)" in caplog.text
    trackers.close()
    trackers.close()
    assert good.closed == 1 and not trackers


@pytest.mark.slow
def test_training_logs_every_step_to_tensorboard_and_wandb_and_resumes_them(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train_command(None, [*TINY, "train.steps=2", 'train.loggers=["tensorboard", "wandb"]'], run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    tb = scalars(run / "tensorboard")
    assert [s for s, _ in tb["reward/mean"]] == [1, 2]
    for key in ("reward/mean", "loss/pg", "time/learn"):
        assert [v for _, v in tb[key]] == pytest.approx([r[key] for r in rows], rel=1e-6)
    (config_text,) = texts(run / "tensorboard", "config")
    assert '"group_size": 2' in config_text[1]
    tables = texts(run / "tensorboard", "trajectories")
    assert [s for s, _ in tables] == [1, 2]
    assert all(text.count("\n| ") == 4 for _, text in tables)  # 2 groups x 2 samples, one row each
    (wb,) = wandb_runs(run)
    binary = next(wb.glob("run-*.wandb")).read_bytes()
    assert b"reward/mean" in binary and b"loss/grad_norm" in binary
    wtables = wandb_tables(wb, "trajectories")
    assert len(wtables) == 2 and all(len(t["data"]) == 4 for t in wtables)
    assert wtables[0]["columns"][:4] == ["step", "group", "sample", "advantage"]
    run_id = (run / "wandb" / "toolgym-run-id").read_text().strip()

    train_command(None, [*TINY, "train.steps=3", 'train.loggers=["tensorboard", "wandb"]'], run)
    tb = scalars(run / "tensorboard")
    assert [s for s, _ in tb["reward/mean"]] == [1, 2, 3]  # the resumed step only, once
    assert (run / "wandb" / "toolgym-run-id").read_text().strip() == run_id
    assert [p.name.endswith(run_id) for p in wandb_runs(run)] == [True, True]


def test_a_resumed_tensorboard_log_drops_the_steps_logged_again(tmp_path: Path) -> None:
    first = open_trackers(["tensorboard"], tmp_path, config={}, kind="train")
    for step in (1, 2, 3):  # an attempt that logged step 3, then died before checkpointing it
        first.log_metrics(step, {"reward/mean": float(step)})
    first.close()
    again = open_trackers(["tensorboard"], tmp_path, config={}, kind="train")
    again.log_metrics(3, {"reward/mean": 30.0})  # resumed from the step-2 checkpoint
    again.log_metrics(4, {"reward/mean": 40.0})
    again.close()
    assert scalars(tmp_path / "tensorboard")["reward/mean"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_resuming_against_another_environment_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train_command(None, [*TINY, "train.steps=1"], run)
    with pytest.raises(ConfigError, match=r"another environment state: .*env\.n_tasks: 6 vs 4"):
        train_command(None, [*TINY, "train.steps=2", "env.kwargs.n_tasks=4"], run)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    train_command(None, [*TINY, "train.steps=2"], run)  # the same environment resumes
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2


def test_eval_sends_its_summary_and_episodes_to_tensorboard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "eval"
    argv = ["eval", "--env", "toolgym/SearchQA-v0", "--policy", "scripted", "--n", "3", "--out", str(out)]
    assert main([*argv, "--logger", "tensorboard"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    tb = scalars(out / "tensorboard")
    for track in summary["tracks"]:
        assert tb[f"{track['harness']}/success"] == [(0, pytest.approx(track["success"]))]
        assert tb[f"{track['harness']}/reward"] == [(0, pytest.approx(track["reward"]))]
    assert "paired/scaffold-bare/diff" in tb
    ((_, table),) = texts(out / "tensorboard", "trajectories")
    assert table.count("\n| ") == 6  # 3 tasks x 2 tracks
