"""Running an arms set: every arm as an ordinary ``toolgym train`` run, one after another, resumable.

:func:`arms_command` is ``toolgym train --arms``: it plans the set (:func:`toolgym.training.experiments.arms.plan_arms`:
every refusal happens there, before any model loads), writes ``DIR/arms_plan.json``, trains the arms in
file order (:func:`run_arms`) and writes the paired results (:mod:`toolgym.training.experiments.arms_results`).

Arms run one after another by default: the first arm's warm start and held-out ``base``/``control``
evaluations are what the later arms load, and a single CPU machine gains nothing from running two
learners at once. Each arm runs in a fresh ``python -m toolgym train`` process
(:func:`train_arm_process`), its output passed through: an arm's memory (engine, learner, allocator
caches) goes back to the system when it ends, so a set needs the memory of one run, not of all its
arms together. ``--arm-workers N`` runs them side by side on Ray instead, up to ``N`` at once, after
the first when the others load from it (:mod:`toolgym.training.experiments.arms_ray`). An arm is finished when
its ``DIR/<arm>/arm.json`` says ``complete`` (written after ``toolgym train`` returned, with its wall
time and attempts); a finished arm is skipped, an unfinished one is ``toolgym train`` again with the
same overrides, which resumes it from its checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from toolgym.errors import ConfigError, RunStopped
from toolgym.procs import stop_leftovers
from toolgym.records.manifest import manifest_differences, read_run_manifest
from toolgym.run_files import write_atomic
from toolgym.training.commands import exit_cleanly_on_sigterm, train_command
from toolgym.training.config import to_dict
from toolgym.training.distributed.ray_cluster import user_sys_path
from toolgym.training.experiments.arms import PLAN, ArmsPlan, command_line, plan_arms
from toolgym.training.experiments.arms_ray import run_arms_on_ray
from toolgym.training.experiments.arms_results import write_arms_results
from toolgym.training.experiments.study import write_study

__all__ = ["ARM_RECORD", "arms_command", "run_arms", "train_arm_process"]

ARM_RECORD = "arm.json"
FORMAT = 1
#: Arms one after another run each in a process of its own (True), or in this one (False: only for
#: tests that replace toolgym's functions in this process, which a child process would not see).
ARM_PROCESS = True


def train_arm_process(config_path: str | None, overrides: Sequence[str], arm_dir: Path, name: str) -> None:
    """``toolgym train`` one arm into ``arm_dir`` in a child process (``python -m toolgym``), output
    passed through; the user's import-path entries go with it (``PYTHONPATH``).

    Interrupted (Ctrl-C, which reaches the child too, or a ``kill`` of this process), it stops the
    child cleanly (:func:`_stop`) before it re-raises: no engine or environment is left running, and
    the arm resumes from its last checkpoint.

    Raises:
        RunStopped: the child did not end with status 0 (its own error was printed above), named
            with its status and the command that resumes the set.
    """

    config = ["--config", config_path] if config_path else []
    argv = [sys.executable, "-m", "toolgym", "train", *config, "--out", str(arm_dir), *overrides]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*user_sys_path(), *filter(None, [env.get("PYTHONPATH")])])
    sys.stdout.flush()
    sys.stderr.flush()
    child = subprocess.Popen(argv, env=env)
    try:
        code = child.wait()
    except BaseException:  # Ctrl-C (it reached the child too) or SIGTERM here: stop the arm cleanly
        _stop(child)
        raise
    if code != 0:
        how = f"exited with status {code}"
        if code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
            if stopped := stop_leftovers(arm_dir):  # its engine outlived it
                how += f"; the {len(stopped)} process(es) its policy had started were stopped"
        raise RunStopped(
            f"arm {name!r} {how} (its output is above); the finished arms are kept: rerun the same "
            "command to resume the set"
        )


def _read_record(arm_dir: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((arm_dir / ARM_RECORD).read_text(encoding="utf-8")))
    except (OSError, json.JSONDecodeError, TypeError, ValueError):
        return {}


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    write_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def run_arms(
    plan: ArmsPlan, out_dir: str | Path, *, say: Callable[[str], None] = print, workers: int = 1
) -> Path:
    """Train every arm of ``plan`` into ``out_dir/<arm>/``, one after another, each in a process of
    its own (or, with ``workers`` > 1, up to that many at once on Ray: :mod:`toolgym.training.experiments.arms_ray`);
    skip finished arms.

    Returns ``out_dir``. Each arm is ``toolgym train`` (:func:`~toolgym.training.commands.train_command`)
    with the arm's overrides, so an interrupted arm resumes from its checkpoint. After an arm, its run
    manifest must pose the first arm's environment (unless ``allow = ["env"]``).

    Raises:
        ConfigError: an arm trained against another environment state than the first arm (named fields).
    """

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(
        out / PLAN,
        {
            "format": FORMAT,
            "arms_file": str(plan.spec.path),
            "config": plan.config_path,
            "baseline": plan.spec.baseline,
            "description": plan.spec.description,
            "allow": list(plan.spec.allow),
            "notes": list(plan.notes),
            "arms": [
                {
                    "name": arm.name,
                    "description": arm.description,
                    "set": list(arm.overrides),
                    "overrides": list(plan.overrides[arm.name]),
                    "command": command_line(plan, arm.name, out),
                    "config": to_dict(plan.configs[arm.name]),
                }
                for arm in plan.spec.arms
            ],
        },
    )
    names = plan.names
    tags = {name: f"arm {i}/{len(names)} {name!r}" for i, name in enumerate(names, 1)}
    todo: list[str] = []
    attempts: dict[str, int] = {}
    resumed: dict[str, bool] = {}
    for name in names:
        record = _read_record(out / name)
        if record.get("status") == "complete":
            say(f"{tags[name]}: finished earlier ({record.get('wall_s', 0):.0f} s), skipped")
        else:
            todo.append(name)
            attempts[name] = int(record.get("attempts", 0)) + 1

    def begin(name: str) -> None:
        arm_dir = out / name
        resumed[name] = (arm_dir / "checkpoint.pt").exists()
        say(f"{tags[name]}: {'resuming' if resumed[name] else 'training'} into {arm_dir}")
        arm_dir.mkdir(parents=True, exist_ok=True)
        _write_json(arm_dir / ARM_RECORD, {"name": name, "status": "running", "attempts": attempts[name]})

    def finish(name: str, wall: float) -> None:
        _check_same_environment(out, names[0], name, allow=plan.spec.allow)
        _write_json(
            out / name / ARM_RECORD,
            {
                "name": name,
                "status": "complete",
                "attempts": attempts[name],
                "wall_s": wall,
                "resumed": resumed[name],
            },
        )
        say(f"{tags[name]}: done in {wall:.0f} s")

    if workers > 1:
        run_arms_on_ray(plan, out, todo, workers, begin=begin, finish=finish, say=say)
        return out
    for name in todo:
        begin(name)
        started = time.perf_counter()
        if ARM_PROCESS:
            train_arm_process(plan.config_path, plan.overrides[name], out / name, name)
        else:
            train_command(plan.config_path, plan.overrides[name], out / name)
        finish(name, time.perf_counter() - started)
    return out


def _stop(child: subprocess.Popen[bytes]) -> None:
    """Let an interrupted arm unwind: a few seconds for its own Ctrl-C, then SIGTERM (``toolgym
    train`` unwinds on it as on Ctrl-C: its ``finally`` blocks close the engine), then SIGKILL."""
    for sig, grace in ((None, 10.0), (signal.SIGTERM, 60.0), (signal.SIGKILL, 30.0)):
        if sig is not None:
            child.send_signal(sig)
        try:
            child.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _check_same_environment(out: Path, first: str, name: str, *, allow: Sequence[str]) -> None:
    if name == first or "env" in allow:
        return
    ours, theirs = read_run_manifest(out / first), read_run_manifest(out / name)
    if ours is None or theirs is None:
        return
    differences = manifest_differences(ours, theirs, allow=("format", "toolgym"))
    if differences:
        raise ConfigError(
            f"arm {name!r} trained against another environment state than arm {first!r}: "
            f"{'; '.join(differences)}. The arms would not share their tasks: restore the environment's "
            "data and index, or train the set into a new --out"
        )


def arms_command(
    arms_path: str | Path,
    config_path: str | None,
    overrides: Sequence[str],
    out_dir: str | Path,
    *,
    say: Callable[[str], None] = print,
    workers: int = 1,
) -> Path:
    """``toolgym train --arms ARMS [--config BASE] --out DIR [--arm-workers N] [KEY=VALUE ...]``: plan,
    train (``workers`` > 1: side by side on Ray), compare.

    Prints one line per arm and, when the arms have a held-out evaluation, the paired table
    (Markdown; ``DIR/arms.md``, ``DIR/arms.tex`` and ``DIR/arms.json`` are written).
    """

    def line(text: str) -> None:
        say(f"[{time.strftime('%H:%M:%S')}] {text}")

    if workers < 1:
        raise ConfigError(f"--arm-workers must be >= 1 (1: one arm after another), got {workers}")

    exit_cleanly_on_sigterm()  # a kill of the set stops its running arm too (train_arm_process)
    plan = plan_arms(arms_path, config_path, overrides, out_dir)
    baseline = plan.spec.baseline
    line(f"arms: {', '.join(plan.names)} (baseline {baseline!r}), from {plan.spec.path}")
    for note in plan.notes:
        line(f"arms: {note}")
    run_arms(plan, out_dir, say=line, workers=workers)
    table = write_arms_results(out_dir)
    if table:
        say(table)
        rows = [{"name": n, "result": f"{n}/result.json", "evaluation": "trained"} for n in plan.names]
        heldout = json.loads((Path(out_dir) / "arms.json").read_text(encoding="utf-8"))["results"]["heldout"]
        write_study(out_dir, rows, baseline, plan.spec.description, heldout)
        line(f"arms: {out_dir}/study.json names the arms' result files: toolgym results table {out_dir}")
    else:
        line("arms: no held-out evaluation (heldout.n = 0): learning curves only (toolgym report DIR)")
    return Path(out_dir)
