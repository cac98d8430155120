"""Arms side by side on Ray: ``toolgym train --arms ARMS --arm-workers N``.

Each arm is the same ``toolgym train`` run as one after another
(:func:`~toolgym.training.commands.train_command` with the arm's overrides, into ``DIR/<arm>``), run
as a Ray task in a worker process of its own; up to ``N`` at once. The driver keeps the bookkeeping
(``DIR/<arm>/arm.json``, the environment check after each arm), so the set stays resumable as a
whole: a finished arm is skipped, an interrupted one resumes from its checkpoint.

Order. When the later arms load something from the first (its warm start, ``warm_start.reuse``, or
its held-out ``base``/``control`` evaluations, ``heldout.reuse``), the first arm runs alone before
the others start; otherwise every arm may start at once. An arm that fails does not stop the others:
the set ends with one error naming every failed arm and its log.

Resources. Each arm asks Ray for one CPU, or one GPU when its learner is on CUDA; on a local
instance (started here, sized to ``N`` CPUs) that allows ``N`` arms at once. A running Ray
(``ray.init`` called, or ``RAY_ADDRESS``) is joined and left running. An arm's output goes to
``DIR/<arm>/train.log``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from toolgym.errors import RunStopped
from toolgym.training.commands import train_command
from toolgym.training.distributed.ray_cluster import acquire_ray, adopt_sys_path, release_ray, user_sys_path

__all__ = ["ARM_LOG", "run_arms_on_ray", "train_arm"]

ARM_LOG = "train.log"


def train_arm(config_path: str | None, overrides: list[str], arm_dir: str, sys_path: list[str]) -> float:
    """In a Ray worker: ``toolgym train`` one arm into ``arm_dir`` (output to its ``train.log``);
    returns the wall seconds."""
    adopt_sys_path(sys_path)
    Path(arm_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(arm_dir) / ARM_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    started = time.perf_counter()
    try:
        train_command(config_path, overrides, arm_dir)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    return time.perf_counter() - started


def run_arms_on_ray(
    plan: Any,
    out: Path,
    todo: Sequence[str],
    workers: int,
    *,
    begin: Callable[[str], None],
    finish: Callable[[str, float], None],
    say: Callable[[str], None],
) -> None:
    """Train the arms ``todo`` (file order) on Ray, up to ``workers`` at once; see the module.

    ``begin(name)`` runs in the driver before an arm is submitted, ``finish(name, wall_s)`` after it
    returned (it may raise: the arm then counts as failed).

    Raises:
        RunStopped: one or more arms failed (each named with its log); the others finished.
    """
    ray = acquire_ray(workers)
    try:
        remote = ray.remote(max_calls=1)(train_arm)  # a fresh worker per arm: its memory goes back
        first = plan.names[0]
        loads_first = plan.warm_start_from is not None or any(
            plan.configs[name].heldout.n for name in plan.names
        )
        queue = list(todo)
        running: dict[Any, str] = {}
        failed: dict[str, str] = {}
        while queue or running:
            alone = loads_first and first in running  # the others wait for what it makes
            while queue and len(running) < workers and not alone:
                name = queue.pop(0)
                cuda = str(plan.configs[name].policy.learner_device).startswith("cuda")
                begin(name)
                task = remote.options(num_cpus=0 if cuda else 1, num_gpus=1 if cuda else 0, max_retries=0)
                ref = task.remote(
                    plan.config_path, list(plan.overrides[name]), str(out / name), user_sys_path()
                )
                running[ref] = name
                say(f"arm {name!r}: started on Ray (log {out / name / ARM_LOG})")
                alone = loads_first and name == first
            done, _ = ray.wait(list(running), num_returns=1)
            name = running.pop(done[0])
            try:
                finish(name, float(ray.get(done[0])))
            except Exception as exc:  # noqa: BLE001 (the arm failed; the others go on)
                cause = getattr(exc, "cause", None) if isinstance(exc, ray.exceptions.RayTaskError) else exc
                first_line = (str(cause or exc).splitlines() or [""])[0]
                failed[name] = f"{type(cause or exc).__name__}: {first_line}"
                say(f"arm {name!r}: failed ({failed[name]})")
                if name == first and loads_first:  # the others would load what it did not make
                    failed.update({n: "not started: the first arm failed" for n in queue})
                    queue = []
    finally:
        release_ray()
    if failed:
        raise RunStopped(
            "arms failed: "
            + "; ".join(f"{n!r} ({why}; log {out / n / ARM_LOG})" for n, why in failed.items())
            + ". The finished arms are kept: rerun the same command to resume the others"
        )
