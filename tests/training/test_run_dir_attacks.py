"""A run directory is data, never code: what someone else planted in it runs nothing and writes nothing
outside it.

Each test plants one thing in a real (tiny) run's directory, as anyone who can write there (a shared
folder, a copied or downloaded run) could: a checkpoint that runs code when unpickled, a checkpoint of an
older toolgym, a processes record naming a process that is not the run's, or a symbolic link where the
trainer writes a file. The run refuses, naming what it refused, and nothing outside the directory moves.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from builders import tiny_overrides

from toolgym.cli import main
from toolgym.errors import CheckpointError, ConfigError
from toolgym.procs import start_time
from toolgym.training.checkpoint import CHECKPOINT_NAME, load_checkpoint
from toolgym.training.config import load_config
from toolgym.training.tiny_policy import TinyPolicy
from toolgym.training.trainer import Trainer

CONFIG = load_config(
    None, [*tiny_overrides(steps=1, tasks_per_step=1, group_size=2), "train.checkpoint_every=1"]
)
OUTSIDE = "the user's own file, outside the run directory\n"


def tiny() -> TinyPolicy:
    return TinyPolicy(hidden=CONFIG.policy.hidden, seed=CONFIG.train.seed)


async def _train(run_dir: Path, *, resume: bool = False) -> Trainer:
    trainer = Trainer(CONFIG, run_dir, policy=tiny())
    try:
        if resume:
            trainer.resume()
        await trainer.run()
    finally:
        trainer.close()
    return trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-step run with its checkpoint: each test works on a copy."""
    import asyncio

    run = tmp_path_factory.mktemp("trained") / "run"
    asyncio.run(_train(run))
    return run


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy, symlinks=True)
    return copy


class _Payload:
    """Unpickling this writes ``marker``: what a planted checkpoint could do (or anything else)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.write_text, (self.marker, "code from the checkpoint ran\n"))


def _plant_pickle(run: Path, marker: Path) -> None:
    torch.save(
        {"step": 1, "policy_version": 1, "model": {}, "payload": _Payload(marker)}, run / CHECKPOINT_NAME
    )
    # the payload is live: a plain unpickler runs it (here, on a copy, into another marker)
    live = marker.with_name("live-check")
    torch.save({"payload": _Payload(live)}, run.parent / "copy.pt")
    torch.load(run.parent / "copy.pt", weights_only=False)
    assert live.exists() and not marker.exists()


# ----------------------------------------------------------------------------- checkpoints
def test_a_planted_checkpoint_runs_no_code_on_resume(run: Path, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    _plant_pickle(run, marker)
    with pytest.raises(CheckpointError, match=r"refused .*checkpoint\.pt.*runs no code") as info:
        load_checkpoint(run)
    assert "Path.write_text" in str(info.value) or "pathlib" in str(info.value)  # names what it refused
    trainer = Trainer(CONFIG, run, policy=tiny())
    try:
        with pytest.raises(CheckpointError, match="refused"):
            trainer.resume()
    finally:
        trainer.close()
    assert not marker.exists()


def test_a_planted_checkpoint_runs_no_code_on_export(run: Path, tmp_path: Path, capsys) -> None:
    config = json.loads((run / "config.json").read_text())
    config["policy"]["kind"] = "hf"  # a run `toolgym export` would convert
    (run / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "marker"
    _plant_pickle(run, marker)
    assert main(["export", str(run)]) == 2
    assert "refused" in capsys.readouterr().err
    assert not marker.exists()


def _as_older_toolgym_wrote_it(run: Path) -> dict:
    """Rewrite ``run``'s checkpoint as toolgym wrote it before checkpoints were weights-only: NumPy's RNG
    state as NumPy's own tuple (an ndarray inside), pickled in full."""
    state = torch.load(run / CHECKPOINT_NAME, weights_only=True)
    rng = state["rng"]["numpy"]
    keys = np.array(rng["keys"], dtype=np.uint32)
    state["rng"]["numpy"] = ("MT19937", keys, rng["pos"], rng["has_gauss"], rng["gauss"])
    torch.save(state, run / CHECKPOINT_NAME)
    return state


def test_a_checkpoint_of_an_older_toolgym_is_refused_with_the_command_that_converts_it(
    run: Path, capsys
) -> None:
    old = _as_older_toolgym_wrote_it(run)
    command = f"toolgym checkpoint upgrade {run}"
    with pytest.raises(CheckpointError, match="older toolgym") as info:
        load_checkpoint(run)
    assert command in str(info.value)
    assert main(["checkpoint", "upgrade", str(run)]) == 0
    assert "upgraded" in capsys.readouterr().out
    state = torch.load(run / CHECKPOINT_NAME, weights_only=True)  # tensors and plain values only
    assert state["step"] == old["step"] == 1
    kind, keys, pos, has_gauss, gauss = old["rng"]["numpy"]
    assert state["rng"]["numpy"] == {
        "kind": kind,
        "keys": [int(k) for k in keys],
        "pos": pos,
        "has_gauss": has_gauss,
        "gauss": gauss,
    }
    assert main(["checkpoint", "upgrade", str(run)]) == 0  # already current: nothing to do
    assert "already" in capsys.readouterr().out
    trainer = Trainer(CONFIG, run, policy=tiny())
    try:
        assert trainer.resume() and trainer.step == 1
        restored = np.random.get_state()
        assert restored[0] == kind and np.array_equal(restored[1], keys) and restored[2] == pos
    finally:
        trainer.close()


def test_upgrade_refuses_a_pickle_that_no_toolgym_wrote(run: Path, tmp_path: Path, capsys) -> None:
    marker = tmp_path / "marker"
    _plant_pickle(run, marker)
    before = (run / CHECKPOINT_NAME).read_bytes()
    assert main(["checkpoint", "upgrade", str(run)]) == 2
    err = capsys.readouterr().err
    assert "no toolgym wrote" in err and "pathlib" in err
    assert not marker.exists() and (run / CHECKPOINT_NAME).read_bytes() == before


def test_a_checkpoint_holds_only_tensors_and_plain_values(trained: Path) -> None:
    state = torch.load(trained / CHECKPOINT_NAME, weights_only=True)
    assert state["step"] == 1 and isinstance(state["rng"]["numpy"]["keys"], list)


def test_the_rng_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    from toolgym.training.checkpoint import capture_rng, restore_rng, save_checkpoint

    random.seed(7)
    np.random.seed(7)
    np.random.standard_normal()  # NumPy caches a second gaussian: the cache is state too
    torch.manual_seed(7)
    save_checkpoint(tmp_path, {"step": 1, "rng": capture_rng()})
    expected = (random.random(), np.random.standard_normal(), torch.rand(1).item())
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    state = load_checkpoint(tmp_path)
    assert state is not None
    restore_rng(state["rng"])
    assert (random.random(), np.random.standard_normal(), torch.rand(1).item()) == expected


def test_a_state_with_other_objects_is_refused_when_saved_naming_where(tmp_path: Path) -> None:
    from toolgym.training.checkpoint import save_checkpoint

    with pytest.raises(TypeError, match=r"state\['curriculum'\]\['counts'\] .*ndarray"):
        save_checkpoint(tmp_path, {"step": 1, "curriculum": {"counts": np.zeros(3)}})
    assert not (tmp_path / CHECKPOINT_NAME).exists()


# ----------------------------------------------------------------------------- processes record
def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_a_planted_processes_record_signals_no_process(tmp_path: Path) -> None:
    """A record in the run directory naming a live process of ours, with its real start time and a dead
    owner: the next run must not kill it (the record is not the run's)."""
    run = tmp_path / "run"
    run.mkdir()
    victim = _sleeper()
    try:
        planted = {
            "owner": {"pid": 999_999_999, "started": 1},
            "processes": [{"pid": victim.pid, "started": start_time(victim.pid)}],
        }
        (run / "processes.json").write_text(json.dumps(planted))
        Trainer(CONFIG, run).close()  # builds its policy: where leftovers of a killed run are stopped
        assert victim.poll() is None, "the planted record made toolgym kill a process that is not the run's"
    finally:
        victim.kill()
        victim.wait()
    assert victim.returncode == -signal.SIGKILL


# ----------------------------------------------------------------------------- symbolic links
@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "outside.txt"
    path.write_text(OUTSIDE)
    return path


@pytest.mark.parametrize(
    "name", ["config.json", "metrics.jsonl", "trajectories.jsonl", f".{CHECKPOINT_NAME}.tmp"]
)
async def test_a_planted_link_is_never_written_through(tmp_path: Path, outside: Path, name: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / name).symlink_to(outside)
    with pytest.raises(ConfigError, match="symbolic link") as info:
        await _train(run)
    assert str(run / name) in str(info.value) and str(outside) in str(info.value)
    assert outside.read_text() == OUTSIDE
    assert (run / name).is_symlink()  # left for the user to look at


async def test_a_planted_link_is_never_truncated_on_resume(run: Path, outside: Path) -> None:
    """Resuming cuts each log back to its length at the checkpoint: never through a link."""
    outside.write_text(OUTSIDE * 1000)  # longer than the log the checkpoint recorded
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(outside)
    trainer = Trainer(CONFIG, run, policy=tiny())
    try:
        with pytest.raises(ConfigError, match="symbolic link"):
            trainer.resume()
    finally:
        trainer.close()
    assert outside.read_text() == OUTSIDE * 1000


def test_a_planted_link_for_the_processes_record_is_never_written_through(
    tmp_path: Path, outside: Path
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "processes.json").symlink_to(outside)
    Trainer(CONFIG, run).close()  # lists the processes its policy started: never through the link
    assert outside.read_text() == OUTSIDE


def test_the_report_is_never_written_through_a_planted_link(run: Path, outside: Path) -> None:
    (run / "report.html").symlink_to(outside)
    assert main(["report", str(run)]) == 2
    assert outside.read_text() == OUTSIDE


# the write sites themselves, each on its own (the trainer also refuses every link at its start)
def test_a_checkpoint_is_never_written_through_a_link_at_its_temporary_name(
    tmp_path: Path, outside: Path
) -> None:
    from toolgym.training.checkpoint import save_checkpoint

    save_checkpoint(tmp_path, {"step": 1})
    (tmp_path / f".{CHECKPOINT_NAME}.tmp").symlink_to(outside)
    with pytest.raises(ConfigError, match=f"{tmp_path / f'.{CHECKPOINT_NAME}.tmp'} is a symbolic link"):
        save_checkpoint(tmp_path, {"step": 2})
    assert outside.read_text() == OUTSIDE
    state = load_checkpoint(tmp_path)
    assert state is not None and state["step"] == 1  # the previous checkpoint is untouched


@pytest.mark.parametrize("name", ["metrics.jsonl", "trajectories.jsonl"])
def test_a_steps_logs_are_never_appended_through_a_link(tmp_path: Path, outside: Path, name: str) -> None:
    from toolgym.training.step_log import write_step

    (tmp_path / name).symlink_to(outside)
    with pytest.raises(ConfigError, match=f"{tmp_path / name} is a symbolic link"):
        write_step(tmp_path, 1, [], {"step": 1.0})
    assert outside.read_text() == OUTSIDE


@pytest.mark.parametrize("how", ["open_append", "open_write", "open_update", "create_new", "write_atomic"])
def test_no_run_file_writer_follows_a_link(tmp_path: Path, outside: Path, how: str) -> None:
    from toolgym import run_files

    link = tmp_path / "file"
    link.symlink_to(outside)
    with pytest.raises(ConfigError, match=f"{link} is a symbolic link \\(to {outside}\\)"):
        if how == "write_atomic":
            run_files.write_atomic(link, "overwritten")
        else:
            with getattr(run_files, how)(link) as fh:
                fh.write(b"overwritten" if "b" in fh.mode else "overwritten")
    assert outside.read_text() == OUTSIDE and link.is_symlink()
    # the temporary file of an atomic write is checked too; a leftover regular one is replaced
    (tmp_path / ".plain.tmp").symlink_to(outside)
    with pytest.raises(ConfigError, match=r"\.plain\.tmp is a symbolic link"):
        run_files.write_atomic(tmp_path / "plain", "new")
    (tmp_path / ".plain.tmp").unlink()
    (tmp_path / ".plain.tmp").write_text("an interrupted write's leftover")
    run_files.write_atomic(tmp_path / "plain", "new")
    assert (tmp_path / "plain").read_text() == "new" and not (tmp_path / ".plain.tmp").exists()
    assert outside.read_text() == OUTSIDE


@pytest.mark.parametrize("how", ["parent", "absolute", "other file", "bad size"])
def test_a_checkpoints_log_names_never_reach_outside_the_run(run: Path, tmp_path: Path, how: str) -> None:
    """A checkpoint that passes the safe load is still data: the logs it names are truncated on resume,
    so only the trainer's own log names are accepted (an absolute path or ``../`` used to truncate any
    file the user can write)."""
    from toolgym.training.checkpoint import save_checkpoint

    victim = tmp_path / "victim.txt"
    victim.write_text(OUTSIDE)
    state = load_checkpoint(run)
    name = {
        "parent": "../victim.txt",
        "absolute": str(victim),
        "other file": "config.json",
        "bad size": "metrics.jsonl",
    }[how]
    state["log_sizes"] = {name: -1 if how == "bad size" else 0}
    save_checkpoint(run, state)
    config = (run / "config.json").read_text()
    trainer = Trainer(CONFIG, run, policy=tiny())
    try:
        with pytest.raises(
            CheckpointError, match="not a byte count" if how == "bad size" else "none of the files"
        ):
            trainer.resume()
    finally:
        trainer.close()
    assert victim.read_text() == OUTSIDE and (run / "config.json").read_text() == config


# ----------------------------------------------------------------------------- links on folders
@pytest.fixture
def other_run(tmp_path: Path) -> Path:
    """Another run's folder, with a file of its own in it: a folder link in the attacked run points here."""
    folder = tmp_path / "other"
    folder.mkdir()
    (folder / "latest.json").write_text(OUTSIDE)
    return folder


def _linked(tmp_path: Path, name: str, target: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / name).symlink_to(target, target_is_directory=True)
    return run


def _untouched(folder: Path) -> None:
    assert sorted(p.name for p in folder.iterdir()) == ["latest.json"]
    assert (folder / "latest.json").read_text() == OUTSIDE


def test_an_export_never_goes_through_a_linked_export_folder(tmp_path: Path, other_run: Path) -> None:
    """``RUN/export`` linked to another run's exports: exporting used to prune that run's exports and
    repoint its ``latest.json``; it is refused before anything is written."""
    from toolgym.training.export import export_model

    run = _linked(tmp_path, "export", other_run)
    with pytest.raises(ConfigError, match=r"export is a symbolic link"):
        export_model(run, None, None, step=1)
    _untouched(other_run)


def test_the_skipped_steps_folder_and_the_trackers_folders_refuse_links(
    tmp_path: Path, other_run: Path, caplog
) -> None:
    """A kept skipped step, TensorBoard's event files and W&B's folder never go through a linked folder
    (a tracker that fails drops out of the run with a warning; the run's own files are complete)."""
    from builders import trajectory

    from toolgym.records.trackers import open_trackers
    from toolgym.training.learn.step_guard import NONFINITE_DIR, StepGuard

    run = _linked(tmp_path, NONFINITE_DIR, other_run)
    with pytest.raises(ConfigError, match="symbolic link"):
        StepGuard(run, 3).observe(1, "loss", [[trajectory([1, 2, 3], [0, 1, 1])]])
    shutil.rmtree(run)
    run = _linked(tmp_path, "tensorboard", other_run)
    trackers = open_trackers(["tensorboard"], run, config={"a": 1}, kind="train")
    trackers.log_metrics(1, {"x": 1.0})
    trackers.close()
    assert "tensorboard is a symbolic link" in caplog.text and not trackers
    shutil.rmtree(run)
    run = _linked(tmp_path, "wandb", other_run)
    with pytest.raises(ConfigError, match="wandb is a symbolic link"):
        open_trackers(["wandb"], run, config={"a": 1}, kind="train")
    _untouched(other_run)


def test_the_wandb_id_file_is_never_read_or_written_through_a_link(tmp_path: Path, outside: Path) -> None:
    """A link at ``RUN/wandb/toolgym-run-id`` used to make a private file's content the W&B run id."""
    from toolgym.records.trackers import open_trackers

    run = tmp_path / "run"
    (run / "wandb").mkdir(parents=True)
    (run / "wandb" / "toolgym-run-id").symlink_to(outside)
    with pytest.raises(ConfigError, match="toolgym-run-id is a symbolic link"):
        open_trackers(["wandb"], run, config={}, kind="train")
    assert outside.read_text() == OUTSIDE


def test_run_folder_refuses_a_link_or_a_file_at_any_component(tmp_path: Path, other_run: Path) -> None:
    from toolgym.run_files import run_folder

    run = tmp_path / "run"
    run.mkdir()
    assert (
        run_folder(run, "heldout", "base") == run / "heldout" / "base" and (run / "heldout" / "base").is_dir()
    )
    assert run_folder(run, "learners", create=False) == run / "learners" and not (run / "learners").exists()
    (run / "heldout" / "control").symlink_to(other_run)
    with pytest.raises(ConfigError, match="control is a symbolic link"):
        run_folder(run, "heldout", "control", create=False)
    (run / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="dangling is a symbolic link"):
        run_folder(run, "dangling", "x")
    assert not (tmp_path / "nowhere").exists(), "a dangling link makes nothing outside the run"
    (run / "afile").write_text("x")
    with pytest.raises(ConfigError, match="is not a folder"):
        run_folder(run, "afile")
    with pytest.raises(ValueError, match="folder names one by one"):
        run_folder(run, "../x")
    _untouched(other_run)
