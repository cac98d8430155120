"""A training run's result file: what its tables and curves need, without its weights.

``toolgym train`` writes ``RUN/result.json`` when it ends (every arm of ``toolgym train --arms`` too:
``DIR/<arm>/result.json``), and ``toolgym results write RUN`` writes it again from a run directory. It
is a :mod:`toolgym.agents.eval.results` file (``what: "run"``) whose evaluations are the held-out ones
(``base``, ``control`` when the run warm-started, ``trained``), and which also holds:

* ``config``: the run's whole config (``config.json``), seeds included;
* ``heldout``: the held-out table's numbers (``heldout/summary.json``);
* ``warm_start``: the warm start's record (``warm_start.json``: episodes kept, losses, the weights'
  hash), so a later run can rebuild that warm start from this file alone and check it
  (``warm_start.reuse = FILE``);
* ``steps``: every step's ``metrics.jsonl`` row (rewards, tool calls, losses, timings, curriculum);
* ``curve``: the held-out curve's points (``heldout_curve.jsonl``);
* ``versions``: toolgym's version and commit and the libraries', from the run manifest;
* ``wall_s``: the wall time of the ``toolgym train`` invocation that wrote it, plus the ``wall_s`` of
  the result an earlier invocation wrote (an interrupted attempt that wrote none is not counted).

Kilobytes for a run whose directory is gigabytes, with the machine's paths written portably
(:func:`toolgym.agents.eval.results.write_result`), so it can be kept in a repository and read anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from toolgym.agents.eval.results import RESULT_FILE, evaluation_result, read_result, write_result
from toolgym.agents.eval.runs import load_eval_run
from toolgym.data import read_jsonl
from toolgym.errors import ConfigError
from toolgym.records.manifest import read_run_manifest
from toolgym.training.heldout.curve import read_curve

__all__ = ["HELDOUT_EVALUATIONS", "run_result", "write_run_result"]

#: The held-out evaluations a run result carries, when the run has them.
HELDOUT_EVALUATIONS = ("base", "control", "trained")


def run_result(run_dir: str | Path, *, wall_s: float | None = None) -> dict[str, Any]:
    """The result file's contents for the run in ``run_dir`` (see the module docstring).

    Raises:
        ConfigError: not a training run (no ``config.json``), or a held-out evaluation unreadable.
    """
    run = Path(run_dir)
    try:
        config = json.loads((run / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{run} is not a training run ({exc}); pass the --out of `toolgym train`") from None
    evaluations = {}
    for name in HELDOUT_EVALUATIONS:
        folder = run / "heldout" / name
        if (folder / "eval.json").is_file():
            evaluations[name] = evaluation_result(load_eval_run(folder))
    summary = run / "heldout" / "summary.json"
    warm = run / "warm_start.json"
    steps = run / "metrics.jsonl"
    manifest = read_run_manifest(run) or {}
    data = {
        "what": "run",
        "config": config,
        "evaluations": evaluations,
        "heldout": _json(summary) if summary.is_file() else None,
        "warm_start": _json(warm) if warm.is_file() else None,
        "steps": list(read_jsonl(steps, kind="step row")) if steps.is_file() else [],
        "curve": read_curve(run),
        "versions": {
            "toolgym": manifest.get("toolgym"),
            "libraries": (manifest.get("machine") or {}).get("libraries"),
        },
        "wall_s": wall_s,
    }
    return data


def write_run_result(run_dir: str | Path, *, wall_s: float | None = None) -> Path:
    """Write ``RUN/result.json``; ``wall_s`` (None: none measured, as ``toolgym results write``) is added
    to the wall time an earlier result recorded."""
    run = Path(run_dir)
    path = run / RESULT_FILE
    earlier = None
    if path.is_file():
        try:
            earlier = read_result(path).get("wall_s")
        except ConfigError:
            earlier = None
    if isinstance(earlier, int | float):
        wall_s = float(earlier) + (wall_s or 0.0)
    return write_result(path, run_result(run, wall_s=None if wall_s is None else round(wall_s, 1)))


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is unreadable ({exc}); the run's result file cannot be written") from None
