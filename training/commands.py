"""The ``toolgym train`` and ``toolgym report`` commands: a whole run, from config to held-out table.

:func:`train_command` loads the config, opens the run's experiment trackers (``train.loggers``,
:mod:`toolgym.records.trackers`), resumes from the run directory's checkpoint if it has one, trains, and runs
the held-out evaluation (``[heldout]``); the trackers receive every step and the held-out table. It ends
by writing ``RUN/result.json`` (:mod:`toolgym.training.run_result`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from toolgym.records.trackers import Trackers, check_trackers, open_trackers
from toolgym.training.config import load_config, to_dict
from toolgym.training.distributed.learners import exit_worker, torchrun_rank, worker_main
from toolgym.training.heldout.run import can_share_engine, run_heldout
from toolgym.training.heldout.table import heldout_table
from toolgym.training.progress import RunProgress
from toolgym.training.run_result import write_run_result
from toolgym.training.trainer import Trainer

__all__ = ["exit_cleanly_on_sigterm", "heldout_metrics", "train_command"]


def train_command(config_path: str | Path | None, overrides: Sequence[str], out_dir: str | Path) -> Path:
    """``toolgym train --config FILE|NAME [key=value ...] --out DIR``; resumes if DIR holds a checkpoint.

    Under ``torchrun`` every rank runs this command: rank 0 trains, the others become learner
    processes (:func:`toolgym.training.distributed.learners.worker_main`) until rank 0 is done, and then end
    the process (:func:`toolgym.training.distributed.learners.exit_worker`): they never return.
    """
    started = time.monotonic()
    config = load_config(config_path, overrides)

    ranked = torchrun_rank()
    if ranked is not None and ranked[0] > 0:  # a learner process: it ends here, with its exit code
        exit_worker(worker_main(config.train.learners.backend, config.train.learners.timeout))
    check_trackers(config.train.loggers)  # a missing package stops the run before any work
    exit_cleanly_on_sigterm()
    trackers = Trackers()
    progress = RunProgress()
    served: Any = None  # the run's vLLM engine, when the held-out evaluation takes it over
    try:
        progress.line(f"loading the policy ({config.policy.kind}) and {len(config.envs)} environment(s)")
        trainer = Trainer(
            config, out_dir, progress=progress
        )  # a wrong env or policy stops it before a tracker run exists
        try:
            trainer.trackers = trackers = open_trackers(
                config.train.loggers, out_dir, config=to_dict(config), kind="train"
            )
            if trainer.resume():
                progress.line(f"resumed {out_dir} at step {trainer.step}")
            asyncio.run(trainer.run())
            train_ids = trainer.heldout_train_ids  # the warm start samples these too
            step, warm_started = trainer.step, trainer.warm_started

            if can_share_engine(config, trainer.policy):
                served = trainer.policy
        finally:
            trainer.close(keep_policy=served is not None)
        del trainer  # the learner's model and optimizer state go before the held-out policies load
        if config.heldout.n:
            progress.line(
                f"held-out evaluation: up to {config.heldout.n} tasks of split {config.heldout.split!r}"
                + (" (on the training run's engine)" if served is not None else "")
            )
            summary = asyncio.run(
                run_heldout(
                    config, out_dir, train_ids, warm_started=warm_started, served=served, progress=progress
                )
            )
            served = None  # the evaluation closed it
            print(heldout_table(summary))
            _track_heldout(trackers, step, summary)
        result = write_run_result(out_dir, wall_s=time.monotonic() - started)
        progress.line(f"result (kilobytes, no weights; keep it to compare on any machine): {result}")
    finally:
        if served is not None:
            served.close()
        trackers.close()
    return Path(out_dir)


def exit_cleanly_on_sigterm() -> None:
    """``kill`` (SIGTERM) unwinds the run like Ctrl-C: the ``finally`` blocks close the vLLM engine's
    processes and the environments, instead of leaving them running. A resume picks up from the last
    checkpoint either way. A learner step under way (in a worker thread) is not interrupted: the
    process ends when it returns (minutes, for long sequences on CPU)."""
    import signal
    import threading

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)


def heldout_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """The held-out ``summary.json`` as flat metrics: ``heldout/<track>/{base,trained,diff,...}``."""
    out: dict[str, float] = {}
    for row in summary["tracks"]:
        prefix = f"heldout/{row['harness']}"
        for key in ("base", "control", "trained", "diff", "rl_diff", "base_em", "control_em", "trained_em"):
            if key in row:
                out[f"{prefix}/{key}"] = float(row[key])
        for key in ("ci", "rl_ci"):
            if key in row:
                name = key.replace("ci", "")
                out[f"{prefix}/{name}ci_low"], out[f"{prefix}/{name}ci_high"] = (float(v) for v in row[key])
    return out


def _track_heldout(trackers: Trackers, step: int, summary: Mapping[str, Any]) -> None:
    if not trackers:
        return
    trackers.log_metrics(step, heldout_metrics(summary))
    columns = ["track", "n", "base", "trained", "diff", "ci_low", "ci_high", "base_em", "trained_em"]
    rows = [
        [r["harness"], r["n"], r["base"], r["trained"], r["diff"], *r["ci"], r["base_em"], r["trained_em"]]
        for r in summary["tracks"]
    ]
    trackers.log_table("heldout", step, columns, rows)
