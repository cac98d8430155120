"""Held-out evaluation at the end of a training run: the base model against the trained export.

Why in the trainer. "Did training generalise?" is the question a run exists to answer, so a config
may carry a ``[heldout]`` section: after the last step the run evaluates, on the environment's *test*
split (tasks the run never sampled), both the policy it started from and its own latest inference
export, on the same tasks, seeds and harness tracks, and writes the paired difference with a 95%
bootstrap interval. ``toolgym report`` shows the table beside the training curves.

Layout: ``RUN/heldout/base/``, ``RUN/heldout/control/`` (the warm-start export, when the run warm-
started: RL's control arm) and ``RUN/heldout/trained/`` are ordinary ``toolgym eval`` output
directories (so ``toolgym compare`` works on them), ``RUN/heldout/summary.json`` holds the table. The
evaluation itself is :func:`toolgym.training.heldout.run.run_heldout`.

Honesty rules, enforced here: the evaluated tasks come from a split that is disjoint from the
training tasks (a training task id among them is an error); which tasks are evaluated is fixed by the
seed before anything is run, never by results; greedy decoding, so the numbers are reproducible.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from toolgym.errors import ConfigError

__all__ = ["heldout_table", "read_heldout"]

log = logging.getLogger(__name__)


def heldout_table(summary: Mapping[str, Any]) -> str:
    """A plain-text table of a held-out ``summary.json`` (what the trainer prints).

    With a control arm (the warm-start export) each track also shows it and RL's own share,
    ``trained - control``, with its interval; the ``pooled`` row pairs each task across tracks.
    """
    rows = summary["tracks"]
    control = any("control" in r for r in rows)
    lines = [
        f"held-out evaluation: {summary['env_id']} split={summary['split']}, n={summary['n']} tasks, "
        f"greedy, seed {summary['seed']}",
        f"{'track':<10} {'base':>8} "
        + (f"{'control':>8} " if control else "")
        + f"{'trained':>8} {'diff':>8}   95% CI            "
        + ("RL - control  95% CI            " if control else "")
        + "base EM  trained EM",
    ]
    for row in rows:
        lo, hi = row["ci"]
        text = f"{row['harness']:<10} {row['base']:>8.3f} "
        if control:
            text += f"{row.get('control', float('nan')):>8.3f} "
        text += f"{row['trained']:>8.3f} {row['diff']:>+8.3f}   [{lo:+.3f}, {hi:+.3f}]   "
        if control:
            rl_lo, rl_hi = row.get("rl_ci", (float("nan"), float("nan")))
            text += f"{row.get('rl_diff', float('nan')):>+12.3f}  [{rl_lo:+.3f}, {rl_hi:+.3f}]   "
        text += f"{row['base_em']:>7.3f}  {row['trained_em']:>10.3f}"
        lines.append(text)
    return "\n".join(lines)


def read_heldout(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's held-out summary, or ``None`` when it has none."""
    path = Path(run_dir) / "heldout" / "summary.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def check_disjoint(train_ids: Sequence[str], heldout_ids: Sequence[str]) -> None:
    """Refuse a held-out set that shares a task with the training tasks."""
    shared = sorted(set(train_ids) & set(heldout_ids))
    if shared:
        raise ConfigError(
            f"the held-out tasks include {len(shared)} training task(s) (e.g. {shared[:3]}): set "
            "heldout.split to a split the run does not train on (train on split='train', evaluate 'test')"
        )
