"""Studies kept as result files: a folder of them, the paired table built from it, and the documents
whose tables are built from such folders.

A study folder (``training/results/<study>/`` for the shipped ones, ``DIR`` of ``toolgym train --arms``)
holds result files (:mod:`toolgym.agents.eval.results`) and ``study.json``, which names its rows::

    {"format": 1, "description": "...", "baseline": "base",
     "rows": [{"name": "base", "result": "demo.json", "evaluation": "base"},
              {"name": "trained", "result": "demo.json", "evaluation": "trained"}]}

``result`` is relative to the folder (a result file, or a folder holding ``result.json``);
``evaluation`` picks one of its evaluations (default: the file's own, ``trained`` for a run). A row
with ``results`` (a list of such files) in place of ``result`` is their mean (:func:`mean_evaluation`:
one arm run with several seeds, each episode's reward and tool-use measures averaged over them), so
the table pairs the seed-averaged arm with the baseline task by task. :func:`study_table` pairs every row with the baseline row on the
same held-out tasks, as the arms table does (:func:`~toolgym.training.experiments.arms_results.compare_arms`:
paired bootstrap per track and pooled, Holm-adjusted p, Bonferroni-widened intervals), refusing a
study with a row's result missing (never a partial table), results of other tasks, seeds, tracks or
environment state, and result files whose episodes no longer give their own summary.

A document (``training/RESULTS.md``) holds built tables between the lines ``<!-- study: NAME -->``
and ``<!-- /study -->`` (each a line of its own); :func:`build_document` rebuilds each from ``results/NAME`` beside the
document, so a table there is the files' table and nothing else (``toolgym results build``; a test
rebuilds the shipped document and compares).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from toolgym.agents.eval.results import RESULT_FILE, load_evaluation
from toolgym.agents.eval.runs import EvalRun, check_same_episodes
from toolgym.core import Trajectory
from toolgym.errors import ConfigError
from toolgym.run_files import write_atomic
from toolgym.training.experiments.arms_results import compare_arms, markdown_table

__all__ = ["STUDY_FILE", "build_document", "load_study", "mean_evaluation", "study_table", "write_study"]

STUDY_FILE = "study.json"
FORMAT = 1
_BLOCK = re.compile(
    r"(^<!-- study: ([A-Za-z0-9_.-]+) -->\n)(.*?)(^<!-- /study -->)", re.DOTALL | re.MULTILINE
)


def write_study(
    folder: str | Path,
    rows: Sequence[Mapping[str, str]],
    baseline: str,
    description: str = "",
    heldout: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``study.json`` into ``folder`` (rows: ``name``, ``result`` relative to it, ``evaluation``;
    ``heldout``: the caption's env_id, split, n, seed and metric, else read from the baseline's settings)."""
    path = Path(folder) / STUDY_FILE
    data = {
        "format": FORMAT,
        "description": description,
        "baseline": baseline,
        "rows": [dict(r) for r in rows],
        **({"heldout": dict(heldout)} if heldout else {}),
    }
    write_atomic(path, json.dumps(data, indent=2) + "\n")
    return path


def load_study(folder: str | Path) -> tuple[dict[str, Any], dict[str, EvalRun]]:
    """A study's ``study.json`` and its rows' evaluations, by row name, in its order.

    Raises:
        ConfigError: no readable ``study.json``, a baseline that is not a row, or rows whose result file
            is missing (every one is named) or refused.
    """
    folder = Path(folder)
    try:
        study = json.loads((folder / STUDY_FILE).read_text(encoding="utf-8"))
        rows = [
            (
                str(r["name"]),
                _row_results(r),
                r.get("evaluation"),
            )
            for r in study["rows"]
        ]
        baseline = str(study["baseline"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ConfigError(f"{folder} is not a study folder ({STUDY_FILE}: {exc})") from None
    names = [name for name, _, _ in rows]
    if baseline not in names:
        raise ConfigError(f"{folder / STUDY_FILE}: the baseline {baseline!r} is not one of its rows {names}")
    missing = [
        f"{name} ({result})"
        for name, results, _ in rows
        for result in results
        if not _result_path(folder / result).is_file()
    ]
    if missing:
        raise ConfigError(
            f"{folder}: the result of {len(missing)} of {len(rows)} rows is missing: {', '.join(missing)}; "
            "a table without them would be partial. Fix: run those arms (or copy their result.json here)"
        )
    runs = {}
    for name, results, evaluation in rows:
        loaded = [
            load_evaluation(f"{folder / result}#{evaluation}" if evaluation else folder / result)
            for result in results
        ]
        runs[name] = (
            loaded[0] if len(loaded) == 1 else mean_evaluation(loaded, f"{folder / STUDY_FILE}: {name}")
        )
    return study, runs


def _row_results(row: dict[str, Any]) -> list[str]:
    """A row's result files: ``results`` (a non-empty list, whose evaluations are averaged) or ``result``."""
    if "results" not in row:
        return [str(row["result"])]
    results = row["results"]
    if not isinstance(results, list) or not results or not all(isinstance(f, str) for f in results):
        raise TypeError(
            f"row {row.get('name')!r}: results must be a non-empty list of files, not {results!r}"
        )
    return results


def mean_evaluation(runs: Sequence[EvalRun], label: str) -> EvalRun:
    """The mean of evaluations of the same episodes (one arm trained with several seeds, say): each
    ``(track, task, seed)`` episode of the first run with its reward, and each measure all runs have,
    averaged over the runs; an episode any run lost to an ``infra_error`` stays one (left out of pairs).

    Raises:
        ConfigError: no runs, or runs that :func:`~toolgym.agents.eval.runs.check_same_episodes` refuses
            (incomplete, or of other episodes or another environment state; named, with ``label``).
    """
    if not runs:
        raise ConfigError(f"{label}: a mean of no evaluations")
    first = runs[0]
    for other in runs[1:]:
        try:
            check_same_episodes(first, other)
        except ConfigError as exc:
            raise ConfigError(
                f"{label}: {other.label} cannot be averaged with {first.label}: {exc}"
            ) from None
    tracks: dict[str, list[Trajectory]] = {}
    for harness, episodes in first.trajectories.items():
        by_run = [{(t.task_id, t.seed): t for t in run.trajectories.get(harness, [])} for run in runs]
        mean = []
        for t in episodes:
            same = [episodes_of.get((t.task_id, t.seed)) for episodes_of in by_run]
            if any(u is None for u in same):
                raise ConfigError(
                    f"{label}: episode {t.task_id} (seed {t.seed}, {harness}) is missing from a run"
                )
            kept = [u for u in same if u is not None]
            if any(u.status == "infra_error" for u in kept):
                mean.append(dataclasses.replace(t, status="infra_error"))
                continue
            keys = set.intersection(*(set(u.metrics) for u in kept))
            mean.append(
                dataclasses.replace(
                    t,
                    reward=sum(u.reward for u in kept) / len(kept),
                    metrics={k: sum(float(u.metrics[k]) for u in kept) / len(kept) for k in sorted(keys)},
                )
            )
        tracks[harness] = mean
    return dataclasses.replace(first, path=None, trajectories=tracks)


def _result_path(path: Path) -> Path:
    return path / RESULT_FILE if path.is_dir() else path


def study_table(folder: str | Path) -> str:
    """The study's paired table as Markdown (see the module docstring)."""
    study, runs = load_study(folder)
    base = runs[study["baseline"]]
    kwargs = dict(base.settings.env_kwargs)
    heldout = study.get("heldout") or {
        "env_id": base.settings.env_id,
        "split": kwargs.get("split", "?"),
        "n": len(base.settings.task_ids),
        "seed": base.settings.seeds[0] if base.settings.seeds else 0,
        "metric": str(kwargs.get("metric", "the environment's reward")),
    }
    results = compare_arms(
        runs,
        study["baseline"],
        seed=int(heldout["seed"]),
        heldout=heldout,
        description=str(study.get("description", "")),
    )
    return markdown_table(results)


def build_document(path: str | Path, *, check: bool = False) -> list[str]:
    """Rebuild every study table in the Markdown file ``path`` from ``results/NAME`` beside it.

    Returns the names of the tables that changed (with ``check`` nothing is written).

    Raises:
        ConfigError: the file unreadable, or a study refused (see :func:`load_study`).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    changed: list[str] = []

    def rebuild(match: re.Match[str]) -> str:
        name = match.group(2)
        table = study_table(path.parent / "results" / name)
        if table != match.group(3):
            changed.append(name)
        return match.group(1) + table + match.group(4)

    new = _BLOCK.sub(rebuild, text)
    if changed and not check:
        write_atomic(path, new)
    return changed
