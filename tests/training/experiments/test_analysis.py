"""First-fifth versus last-fifth analysis: exact values on hand-written runs, and a real tiny run."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from toolgym.errors import ConfigError
from toolgym.training.config import load_config, resolve_config_path
from toolgym.training.experiments.analysis import bootstrap_difference, learning_summary, stage_changes
from toolgym.training.trainer import Trainer


def write_run(
    run_dir: Path,
    rewards_per_step: Sequence[Sequence[float]],
    *,
    statuses: dict[tuple[int, int], str] | None = None,
) -> None:
    """A run directory as the trainer writes it, with the given verifier rewards per step."""
    statuses = statuses or {}
    with (run_dir / "metrics.jsonl").open("w") as metrics, (run_dir / "trajectories.jsonl").open("w") as traj:
        for step, rewards in enumerate(rewards_per_step, 1):
            ok = [r for i, r in enumerate(rewards) if statuses.get((step, i), "ok") != "infra_error"]
            metrics.write(json.dumps({"step": float(step), "reward/mean": sum(ok) / len(ok)}) + "\n")
            for i, r in enumerate(rewards):
                trajectory = {"reward": r, "status": statuses.get((step, i), "ok")}
                traj.write(json.dumps({"step": step, "sample": i, "trajectory": trajectory}) + "\n")


def test_fifths_means_and_difference(tmp_path: Path) -> None:
    # 10 steps -> a fifth is 2 steps
    write_run(tmp_path, [[0.0, 0.0]] * 2 + [[0.5, 0.5]] * 6 + [[1.0, 0.5], [1.0, 1.0]])
    s = learning_summary(tmp_path, resamples=2000)
    assert s.first_steps == (1, 2) and s.last_steps == (9, 10)
    assert s.first_mean == 0.0 and s.last_mean == pytest.approx(0.875)
    assert s.difference == pytest.approx(0.875)
    assert s.step_means == (0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.75, 1.0)
    # the last fifth's bootstrap means lie in [0.5, 1.0]; the first fifth's are all 0
    assert 0.5 <= s.ci_low <= s.difference <= s.ci_high <= 1.0
    assert s.learned


def test_no_change_gives_an_interval_around_zero(tmp_path: Path) -> None:
    write_run(tmp_path, [[0.0, 1.0, 0.0, 1.0]] * 10)
    s = learning_summary(tmp_path)
    assert s.difference == 0.0
    assert s.ci_low < 0.0 < s.ci_high
    assert not s.learned


def test_a_drop_is_not_learning(tmp_path: Path) -> None:
    write_run(tmp_path, [[1.0, 1.0]] * 5 + [[0.0, 0.0]] * 5)
    s = learning_summary(tmp_path)
    assert s.difference == -1.0 and s.ci_high == -1.0
    assert not s.learned


def test_infra_errors_are_left_out(tmp_path: Path) -> None:
    write_run(tmp_path, [[0.0, 0.0], [1.0, 0.0]], statuses={(2, 1): "infra_error"})
    s = learning_summary(tmp_path, resamples=100)
    assert s.last_rewards == (1.0,)
    assert s.last_mean == 1.0


def test_small_runs_use_one_step_per_fifth(tmp_path: Path) -> None:
    write_run(tmp_path, [[0.0], [0.2], [0.4]])
    s = learning_summary(tmp_path, resamples=100)
    assert s.first_steps == (1,) and s.last_steps == (3,)


def test_the_bootstrap_is_seeded_and_widens_with_confidence() -> None:
    first, last = [0.0, 0.2, 0.1, 0.0, 0.3], [0.4, 0.1, 0.5, 0.2, 0.6]
    assert bootstrap_difference(first, last, seed=3) == bootstrap_difference(first, last, seed=3)
    low90, high90 = bootstrap_difference(first, last, confidence=0.90)
    low99, high99 = bootstrap_difference(first, last, confidence=0.99)
    assert low99 < low90 < high90 < high99


def test_bad_inputs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        learning_summary(tmp_path)
    write_run(tmp_path, [[0.5]])
    with pytest.raises(ValueError, match="at least 2"):
        learning_summary(tmp_path)
    write_run(tmp_path, [[0.5], [0.5]])
    (tmp_path / "trajectories.jsonl").write_text("")
    with pytest.raises(ValueError, match="no usable trajectory"):
        learning_summary(tmp_path)
    with pytest.raises(ValueError, match="at least one reward"):
        bootstrap_difference([], [1.0])


def test_stage_changes_absent_is_empty(tmp_path: Path) -> None:
    assert stage_changes(tmp_path) == []


async def test_summary_of_a_real_tiny_run(tmp_path: Path) -> None:
    """The analysis reads what the trainer writes (a tiny model on the toy env, with an unlock)."""
    config = load_config(
        None,
        [
            "env.id=toy_env:toolgym-test/Letters-v0",
            "policy.kind=tiny",
            "policy.hidden=32",
            "sampling.max_tokens=12",
            "train.steps=5",
            "train.tasks_per_step=1",
            "train.group_size=2",
            "train.rollouts.max_off_policy_steps=0",
            'curriculum.stages=[["answer"], ["answer", "lookup"]]',
            "curriculum.min_stay=1",
            "curriculum.patience=1",
            "curriculum.min_attempts=1",
            "curriculum.success_threshold=0.99",
            "curriculum.unsolved_threshold=0.5",
        ],
    )
    history = await Trainer(config, tmp_path).run()
    s = learning_summary(tmp_path, resamples=500)
    assert s.steps == (1, 2, 3, 4, 5)
    assert s.step_means == tuple(m["reward/mean"] for m in history)
    assert len(s.first_rewards) == len(s.last_rewards) == 2
    assert s.ci_low <= s.difference <= s.ci_high
    changes = stage_changes(tmp_path)
    assert changes and changes[0]["tools"] == ["answer", "lookup"] and changes[0]["step"] >= 1


def test_the_shipped_demo_config_resolves_by_name_and_is_valid() -> None:
    path = resolve_config_path("demo")
    assert path is not None and path.name == "demo.toml" and path.is_file()
    config = load_config(path)
    assert config.env.id == "toolgym/SearchQA-v0" and dict(config.env.kwargs)["metric"] == "f1"
    stages = config.curriculum.stages
    assert len(stages) >= 2 and set(stages[0]) < set(stages[1])  # a later stage unlocks a tool
    # trains on the train split and measures on the test split, never the same questions
    assert dict(config.env.kwargs)["split"] == "train" and config.heldout.split == "test"
    assert config.heldout.n >= 100 and set(config.heldout.harnesses) == {"bare", "scaffold"}
    with pytest.raises(ConfigError, match="Did you mean 'demo'"):
        resolve_config_path("dmeo")
