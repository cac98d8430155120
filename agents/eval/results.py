"""Result files: what a paired table needs from an evaluation, in one small self-contained JSON file.

A run directory holds weights, checkpoints and every token (gigabytes); it stays on the machine that
made it. A result file holds what the tables are built from (kilobytes): for each evaluation its
settings (environment, kwargs, tracks, task ids, seeds, policy, sampling), its run manifest (the
environment's data, index, prompts and verifier hashes, library versions), and one row per episode
(task, seed, reward, status, how it ended, its metrics: rewards, tool calls, tokens), with each
track's summary. A training run's result adds its config, its step curve and its wall time
(:mod:`toolgym.training.run_result`). Result files are kept in the repository
(``training/results/<study>/``), so a study outlives its machine and can be continued elsewhere.

Layout (``format`` 1)::

    {"format": 1, "kind": "toolgym-result", "what": "evaluation" | "run",
     "evaluations": {NAME: {"status", "settings", "manifest",
                            "episodes": {TRACK: [{"task", "seed", "reward", "status", "stop",
                                                  "seconds", "metrics"}, ...]},
                            "summary": {TRACK: TrackSummary as JSON}}},
     ...}

An evaluation read back from a result file is an :class:`~toolgym.agents.eval.runs.EvalRun` like one
read from an evaluation directory, so ``toolgym compare``, the held-out tables and the arms tables
pair result files with the same refusals (other tasks, seeds, tracks, environment state). A file whose
episodes no longer give its own summary (edited by hand, or truncated) is refused, naming the track and
the figure.

Where a result file is named on the command line, ``FILE#NAME`` picks one of its evaluations; without
``#NAME`` it is ``trained`` when the file has one (a training run), else its only evaluation.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from toolgym.agents.eval.evaluate import summarize
from toolgym.agents.eval.runs import RECORD, RESULT_FILE, EvalRun, EvalSettings, load_eval_run
from toolgym.core import Trajectory
from toolgym.errors import ConfigError
from toolgym.run_files import write_atomic

__all__ = [
    "RESULT_FILE",
    "evaluation_result",
    "load_evaluation",
    "portable",
    "read_result",
    "result_evaluation",
    "write_evaluation_result",
    "write_result",
]

FORMAT = 1
KIND = "toolgym-result"
DEFAULT_EVALUATION = "trained"
#: A figure of a summary recomputed from its episodes may differ from the stored one by float noise only.
_TOLERANCE = 1e-9


def _row(t: Trajectory) -> dict[str, Any]:
    return {
        "task": t.task_id,
        "seed": t.seed,
        "reward": t.reward,
        "status": t.status,
        "stop": t.stop_reason,
        "seconds": round(float(t.timings.get("time/total", 0.0)), 3),
        "metrics": dict(sorted(t.metrics.items())),
    }


def _trajectory(row: Mapping[str, Any], env_id: str, harness: str) -> Trajectory:
    return Trajectory(
        env_id=env_id,
        task_id=str(row["task"]),
        seed=None if row["seed"] is None else int(row["seed"]),
        harness=harness,
        allowed_tools=(),
        messages=(),
        token_ids=(),
        loss_mask=(),
        logprobs=(),
        reward=float(row["reward"]),
        metrics={str(k): float(v) for k, v in dict(row["metrics"]).items()},
        status=row["status"],
        timings={"time/total": float(row.get("seconds", 0.0))},
        stop_reason=str(row.get("stop", "")),
    )


def _summary(harness: str, episodes: list[Trajectory]) -> dict[str, Any]:
    return asdict(summarize(harness, episodes))


def evaluation_result(run: EvalRun) -> dict[str, Any]:
    """One evaluation as a result file's ``evaluations`` entry (see the module docstring)."""
    episodes = {track: [_row(t) for t in run.trajectories[track]] for track in run.settings.harnesses}
    rebuilt = _episodes(episodes, run.settings)
    return {
        "status": run.status,
        "settings": run.settings.to_dict(),
        "manifest": dict(run.manifest) if run.manifest is not None else None,
        "episodes": episodes,
        "summary": {track: _summary(track, rebuilt[track]) for track in run.settings.harnesses},
    }


def _episodes(episodes: Mapping[str, Any], settings: EvalSettings) -> dict[str, list[Trajectory]]:
    return {
        track: [_trajectory(row, settings.env_id, track) for row in episodes.get(track, [])]
        for track in settings.harnesses
    }


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return set(a) != set(b) or any(_differs(a[k], b[k]) for k in a)
    if isinstance(a, int | float) and isinstance(b, int | float):
        if math.isnan(a) and math.isnan(b):
            return False
        return not math.isclose(a, b, rel_tol=_TOLERANCE, abs_tol=_TOLERANCE)
    return bool(a != b)


def result_evaluation(data: Mapping[str, Any], name: str, label: str) -> EvalRun:
    """The evaluation ``name`` of a result file's contents, as an :class:`EvalRun` labelled ``label``.

    Raises:
        ConfigError: no such evaluation (the message lists them), a malformed entry, or episodes that no
            longer give the entry's own summary.
    """
    evaluations = data.get("evaluations")
    if not isinstance(evaluations, Mapping) or name not in evaluations:
        have = sorted(evaluations) if isinstance(evaluations, Mapping) else []
        raise ConfigError(f"{label} has no evaluation {name!r}; it has {have or 'none'}")
    entry = evaluations[name]
    try:
        settings = EvalSettings.from_dict(entry["settings"])
        runs = _episodes(entry["episodes"], settings)
        stored = entry["summary"]
        status = str(entry["status"])
        manifest = entry.get("manifest")
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{label} is not a toolgym result file (bad evaluation {name!r}: {exc})") from None
    for track in settings.harnesses:
        recomputed = _summary(track, runs[track])
        mine = stored.get(track) if isinstance(stored, Mapping) else None
        if not isinstance(mine, Mapping):
            raise ConfigError(f"{label}: evaluation {name!r} has no summary of track {track!r}")
        wrong = [k for k in recomputed if k not in mine or _differs(recomputed[k], mine[k])]
        if wrong:
            shown = "; ".join(f"{k}: summary {mine.get(k)!r}, episodes give {recomputed[k]!r}" for k in wrong)
            raise ConfigError(
                f"{label}: evaluation {name!r}, track {track!r}: its episodes no longer give its own summary "
                f"({shown}); the file was edited by hand or cut short, so none of its numbers can be "
                "trusted. Fix: write it again from the run (toolgym results write RUN)"
            )
    return EvalRun(Path(label), settings, status, runs, manifest)


def read_result(path: str | Path) -> dict[str, Any]:
    """A result file's contents, checked to be one (format and kind).

    Raises:
        ConfigError: unreadable, not JSON, not a toolgym result, or written by a newer toolgym.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not a readable result file ({exc})") from None
    if not isinstance(data, dict) or data.get("kind") != KIND or not isinstance(data.get("format"), int):
        raise ConfigError(f"{path} is not a toolgym result file (no kind {KIND!r} with an integer format)")
    if data["format"] > FORMAT:
        raise ConfigError(
            f"{path} was written by a newer toolgym (result format {data['format']}, this one reads "
            f"{FORMAT}). Fix: upgrade toolgym to read it"
        )
    return data


def portable(value: Any, roots: Mapping[str, str]) -> Any:
    """``value`` with every path under one of ``roots`` (a folder -> its stand-in) rewritten, in any
    string (a policy spec such as ``vllm:run:/x/y`` included); ``roots`` longest first."""
    if isinstance(value, Mapping):
        return {k: portable(v, roots) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [portable(v, roots) for v in value]
    if isinstance(value, str):
        for root, name in roots.items():
            if value == root:
                return name
            value = value.replace(root + os.sep, name + os.sep)
    return value


def machine_roots(folder: Path) -> dict[str, str]:
    """This machine's folders a result file must not name, and their stand-ins: the folder the file is
    written in (``<here>``) and the one above it (``<here>/..``: an arm's siblings), the working directory (``.``), Python's prefix (``<python>``), the home
    directory (``~``); longest first, so the innermost wins."""
    roots = {
        str(folder.resolve()): "<here>",
        str(folder.resolve().parent): "<here>/..",
        str(Path.cwd().resolve()): ".",
        str(Path(sys.prefix).resolve()): "<python>",
        str(Path.home().resolve()): "~",
    }
    return dict(sorted(((k, v) for k, v in roots.items() if k != os.sep), key=lambda kv: -len(kv[0])))


def write_result(path: str | Path, data: Mapping[str, Any]) -> Path:
    """Write a result file atomically (never through a planted link) with this machine's paths written
    portably (:func:`machine_roots`); returns its path."""
    path = Path(path)
    body = portable({"format": FORMAT, "kind": KIND, **data}, machine_roots(path.parent))
    write_atomic(path, json.dumps(body, indent=1) + "\n")
    return path


def write_evaluation_result(out_dir: str | Path) -> Path:
    """Write ``DIR/result.json`` for the ``toolgym eval`` directory ``out_dir`` (its one evaluation, ``eval``)."""
    out = Path(out_dir)
    entry = evaluation_result(load_eval_run(out))
    return write_result(out / RESULT_FILE, {"what": "evaluation", "evaluations": {"eval": entry}})


def _default(data: Mapping[str, Any], label: str) -> str:
    names = list(data.get("evaluations") or {})
    if DEFAULT_EVALUATION in names:
        return DEFAULT_EVALUATION
    if len(names) == 1:
        return names[0]
    raise ConfigError(f"{label} holds the evaluations {names}: name one as {label}#NAME")


def load_evaluation(where: str | Path) -> EvalRun:
    """An evaluation from an evaluation directory, a result file (``FILE`` or ``FILE#NAME``), or a
    directory holding a ``result.json`` (a training run, an arm).

    Raises:
        ConfigError: nothing readable there, or a result file that is refused (see :func:`result_evaluation`).
    """
    text = str(where)
    name = None
    if "#" in text and not Path(text).exists():
        text, name = text.rsplit("#", 1)
    path = Path(text)
    if path.is_dir() and (path / RECORD).is_file() and name is None:
        return load_eval_run(path)
    if path.is_dir() and (path / RESULT_FILE).is_file():
        path = path / RESULT_FILE
    if not path.is_file():
        return load_eval_run(path)  # its refusal names what an evaluation directory needs
    data = read_result(path)
    return result_evaluation(data, name or _default(data, text), f"{text}#{name}" if name else text)
