"""Evaluation run directories: the run record, resuming an interrupted run, comparing two runs.

``toolgym eval --out DIR`` writes:

* ``DIR/eval.json`` — the run record: the settings that decide which episodes run (environment id and
  kwargs, harness tracks, task ids, seeds, episode token budget, the policy spec and what it resolved
  to, sampling), ``status`` (``running`` until every episode is recorded, then ``complete``), and
  once complete the per-track summaries and the within-run paired differences.
* ``DIR/trajectories-<track>.jsonl`` — one line per finished episode, appended as it finishes, so an
  interrupted run loses only the episodes in flight.
* ``DIR/summary.json`` — the :class:`~toolgym.agents.eval.evaluate.EvalReport` (kept for scripts).

Resume rule: a directory whose record has the same settings is resumed (finished ``(track, task, seed)``
episodes are skipped, the rest run); a directory with other settings, or with trajectories but no
record, is refused with the fields that differ, unless ``restart`` clears it. Results of two settings
are never mixed.

Compare rule: two complete runs are compared only when their environment id and kwargs, tracks, task
ids and seeds agree (:data:`COMPARE_FIELDS`); policy, sampling and token caps may differ (that is
usually the point) and are shown. For each track the paired difference ``B - A`` of the reward over the
shared ``(task, seed)`` episodes gets a bootstrap 95% interval; a pair where either side is an
``infra_error`` is left out (never scored) and counted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from toolgym.agents.eval.stats import paired_bootstrap
from toolgym.agents.rollout import write_trajectories
from toolgym.core import Trajectory
from toolgym.errors import ConfigError
from toolgym.records.manifest import RUN_MANIFEST, manifest_differences, read_run_manifest
from toolgym.registry import explicit_kwargs
from toolgym.run_files import write_atomic

__all__ = [
    "COMPARE_FIELDS",
    "RECORD",
    "Comparison",
    "EvalRun",
    "EvalSettings",
    "TrackComparison",
    "check_resumable",
    "check_same_episodes",
    "compare_runs",
    "in_planned_order",
    "load_eval_run",
    "paired_rewards",
    "pooled_comparison",
    "pooled_pairs",
    "prepare_run_dir",
    "settings_differences",
]

logger = logging.getLogger(__name__)

RECORD = "eval.json"
#: The directory's result file (:mod:`toolgym.agents.eval.results`), removed with the rest on a restart.
RESULT_FILE = "result.json"
FORMAT = 1
#: Fields that must agree for two runs to be compared (what makes the episodes the same episodes).
COMPARE_FIELDS = ("env_id", "env_kwargs", "harnesses", "task_ids", "seeds")
_TRAJECTORY_PREFIX = "trajectories-"


@dataclass(frozen=True)
class EvalSettings:
    """Everything that decides which episodes an evaluation runs and how (JSON-ready values).

    Attributes:
        env_id, env_kwargs: the environment and its constructor arguments.
        harnesses: the tracks, in order (the first is the within-run baseline).
        task_ids, seeds: episode ``i`` of every track runs ``task_ids[i]`` with ``seeds[i]``.
        max_total_tokens: the episode's token budget.
        policy: the policy spec; policy_info: what it resolved to (model directory, export step).
        sampling: the per-turn sampling parameters.
    """

    env_id: str
    env_kwargs: Mapping[str, Any]
    harnesses: tuple[str, ...]
    task_ids: tuple[str, ...]
    seeds: tuple[int, ...]
    max_total_tokens: int
    policy: str
    policy_info: Mapping[str, Any]
    sampling: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """JSON form (tuples as lists, kwargs through JSON so a ``Path`` becomes its string)."""
        return json.loads(json.dumps(asdict(self), default=str, sort_keys=True))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvalSettings:
        try:
            return cls(
                env_id=data["env_id"],
                env_kwargs=dict(data["env_kwargs"]),
                harnesses=tuple(data["harnesses"]),
                task_ids=tuple(data["task_ids"]),
                seeds=tuple(data["seeds"]),
                max_total_tokens=int(data["max_total_tokens"]),
                policy=data["policy"],
                policy_info=dict(data.get("policy_info") or {}),
                sampling=dict(data["sampling"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not a toolgym evaluation record (missing or bad field {exc})") from None


def settings_differences(a: EvalSettings, b: EvalSettings, fields: Sequence[str] | None = None) -> list[str]:
    """One short line per field where ``a`` and ``b`` differ (all fields when ``fields`` is None)."""
    da, db = a.to_dict(), b.to_dict()
    out = []
    for name in fields or list(da):
        va, vb = da[name], db[name]
        if va == vb:
            continue
        if isinstance(va, list) and isinstance(vb, list):
            first = next(
                (i for i, (x, y) in enumerate(zip(va, vb, strict=False)) if x != y), min(len(va), len(vb))
            )
            at = f"; first difference at #{first}: {_short(va, first)} vs {_short(vb, first)}"
            out.append(f"{name} ({len(va)} vs {len(vb)} values{at})")
        else:
            out.append(f"{name} ({json.dumps(va, sort_keys=True)} vs {json.dumps(vb, sort_keys=True)})")
    return out


def _defaults_dropped(settings: EvalSettings) -> EvalSettings:
    """``settings`` with the environment arguments given at their default left out (:func:`explicit_kwargs`)."""
    return dataclasses.replace(settings, env_kwargs=explicit_kwargs(settings.env_id, settings.env_kwargs))


def _short(values: list[Any], i: int) -> str:
    return json.dumps(values[i]) if i < len(values) else "(none)"


@dataclass(frozen=True)
class EvalRun:
    """An evaluation run as read back: its settings, status, and episodes by track."""

    path: Path | None
    settings: EvalSettings
    status: str
    trajectories: Mapping[str, Sequence[Trajectory]]
    #: ``manifest.json`` (:mod:`toolgym.records.manifest`); ``None`` for a run from before manifests
    manifest: Mapping[str, Any] | None = None

    @property
    def label(self) -> str:
        return str(self.path) if self.path is not None else "this evaluation"


def _trajectory_files(out: Path) -> list[Path]:
    return sorted(out.glob(f"{_TRAJECTORY_PREFIX}*.jsonl"))


def _read_episodes(path: Path, *, repair: bool) -> list[Trajectory]:
    """Read a track's JSONL. A torn last line (a kill mid-write) is cut off when ``repair``, else skipped."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    complete, tail = lines[:-1], lines[-1]
    out = []
    for lineno, line in enumerate(complete, 1):
        if not line.strip():
            continue
        try:
            out.append(Trajectory.from_json(line.decode("utf-8")))
        except (json.JSONDecodeError, TypeError, KeyError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"{path}:{lineno} is not a trajectory record ({exc}); the directory was edited by hand. "
                "Fix: --restart, or a new --out"
            ) from None
    if tail.strip():
        logger.warning("%s ends with a half-written episode (interrupted run); it will run again", path)
        if repair:
            with path.open("r+b") as fh:
                fh.truncate(len(data) - len(tail))
    return out


def _read_record(out: Path) -> dict[str, Any]:
    try:
        record = json.loads((out / RECORD).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{out / RECORD} is unreadable ({exc}). Fix: --restart, or a new --out") from None
    if not isinstance(record, dict) or "settings" not in record:
        raise ConfigError(
            f"{out / RECORD} is not a toolgym evaluation record. Fix: --restart, or a new --out"
        )
    return record


def write_record(
    out: Path, settings: EvalSettings, status: str, extra: Mapping[str, Any] | None = None
) -> None:
    """Write ``eval.json`` atomically (temporary file + rename)."""
    record = {"format": FORMAT, "status": status, "settings": settings.to_dict(), **(extra or {})}
    write_atomic(out / RECORD, json.dumps(record, indent=2))  # never through a planted link


def clear_run_dir(out: Path) -> None:
    """Remove what an evaluation wrote in ``out`` (only those files: ``out`` may hold other things)."""
    for path in [
        out / RECORD,
        out / "summary.json",
        out / "elapsed_s.txt",
        out / RESULT_FILE,
        *_trajectory_files(out),
    ]:
        path.unlink(missing_ok=True)


def prepare_run_dir(
    out: str | Path, settings: EvalSettings, *, restart: bool = False
) -> dict[str, list[Trajectory]]:
    """Make ``out`` ready for an evaluation with ``settings`` and return the episodes it already has.

    Returns:
        Finished episodes by track (empty lists for a fresh run); the caller runs the rest.

    Raises:
        ConfigError: ``out`` holds an evaluation with other settings, or trajectories without a record;
            the message lists the differing fields and suggests ``--restart`` or a new ``--out``.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if restart:
        clear_run_dir(out)
    done: dict[str, list[Trajectory]] = {h: [] for h in settings.harnesses}
    if (out / RECORD).exists():
        previous = EvalSettings.from_dict(_read_record(out)["settings"])
        diff = settings_differences(previous, settings)
        if diff:
            raise ConfigError(
                f"{out} holds an evaluation with other settings, which must not be mixed with this one: "
                f"differs in {'; '.join(diff)}. Fix: a new --out, or --restart to clear {out}"
            )
        for harness in settings.harnesses:
            path = out / f"{_TRAJECTORY_PREFIX}{harness}.jsonl"
            if path.exists():
                done[harness] = _read_episodes(path, repair=True)
        resumed = sum(len(v) for v in done.values())
        if resumed:
            logger.info("resuming %s: %d episodes already finished", out, resumed)
    elif _trajectory_files(out):
        raise ConfigError(
            f"{out} holds trajectories but no {RECORD} (written by another tool or an older toolgym), so "
            "their settings are unknown. Fix: a new --out, or --restart to clear it"
        )
    write_record(out, settings, "running")
    return done


def append_episode(out: str | Path, trajectory: Trajectory) -> None:
    """Record one finished episode (a line, flushed) in its track's file."""
    write_trajectories(Path(out) / f"{_TRAJECTORY_PREFIX}{trajectory.harness}.jsonl", [trajectory])


def load_eval_run(path: str | Path) -> EvalRun:
    """Read an evaluation directory written by ``toolgym eval --out``.

    Raises:
        ConfigError: not a directory, no ``eval.json`` (not an evaluation, or from an older toolgym), or
            an unreadable record.
    """
    out = Path(path)
    if not out.is_dir():
        raise ConfigError(f"{str(out)!r} is not a directory; pass the --out of a `toolgym eval` run")
    if not (out / RECORD).is_file():
        hint = " (it looks like a training run)" if (out / "checkpoint.pt").exists() else ""
        raise ConfigError(
            f"{out} has no {RECORD}{hint}: pass the --out of `toolgym eval` (runs from before {RECORD} "
            "existed must be evaluated again)"
        )
    record = _read_record(out)
    settings = EvalSettings.from_dict(record["settings"])
    trajectories = {}
    for harness in settings.harnesses:
        file = out / f"{_TRAJECTORY_PREFIX}{harness}.jsonl"
        episodes = _read_episodes(file, repair=False) if file.exists() else []
        trajectories[harness] = in_planned_order(episodes, settings)
    return EvalRun(out, settings, str(record.get("status", "running")), trajectories, read_run_manifest(out))


def in_planned_order(episodes: Sequence[Trajectory], settings: EvalSettings) -> list[Trajectory]:
    """``episodes`` in the evaluation's planned order (episode ``i`` runs ``task_ids[i]`` with
    ``seeds[i]``), whatever order they finished in: a track's file is written as episodes end, which
    concurrency makes vary from run to run, and the paired intervals resample pairs in this order, so
    the same rewards give the same interval. An episode the plan does not name goes last, in file order."""
    planned: dict[tuple[str, int | None], int] = {
        key: i for i, key in enumerate(zip(settings.task_ids, settings.seeds, strict=False))
    }
    return sorted(episodes, key=lambda t: planned.get((t.task_id, t.seed), len(planned)))


def check_resumable(out: Path, manifest: Mapping[str, Any], *, resuming: bool) -> None:
    """Refuse to add episodes to ``out`` when its environment's data, prompts or scoring changed since."""
    old = read_run_manifest(out) if resuming else None
    if old is None:
        return
    differences = manifest_differences(old, manifest)
    if differences:
        raise ConfigError(
            f"{out} holds episodes run against another environment state: {'; '.join(differences)}. Mixing "
            "them would give one number from two tasks. Fix: --restart (run every episode again) or a new --out"
        )


def paired_rewards(a: Sequence[Trajectory], b: Sequence[Trajectory]) -> tuple[list[float], list[float], int]:
    """Rewards of the ``(task, seed)`` episodes both sides have, in ``a``'s order, and the pairs dropped
    because either side is an ``infra_error`` (never scored)."""
    by_key = {(t.task_id, t.seed): t for t in b}
    ra, rb, dropped = [], [], 0
    for t in a:
        other = by_key.get((t.task_id, t.seed))
        if other is None:
            continue
        if t.status == "infra_error" or other.status == "infra_error":
            dropped += 1
            continue
        ra.append(t.reward)
        rb.append(other.reward)
    return ra, rb, dropped


@dataclass(frozen=True)
class TrackComparison:
    """``B - A`` on one track: mean rewards, the paired difference and its bootstrap 95% interval."""

    harness: str
    n: int
    reward_a: float
    reward_b: float
    diff: float
    low: float
    high: float
    infra_dropped: int


@dataclass(frozen=True)
class MeasureComparison:
    """``B - A`` of one tool-use measure (``use/*``, :mod:`toolgym.tool_use`) on one track, over the
    episode pairs where both sides have it: the means, the paired difference, its bootstrap 95% interval."""

    harness: str
    measure: str
    n: int
    a: float
    b: float
    diff: float
    low: float
    high: float


@dataclass(frozen=True)
class Comparison:
    a: str
    b: str
    tracks: list[TrackComparison]
    #: fields that may differ between compared runs and do (policy, sampling, token caps)
    notes: list[str] = field(default_factory=list)
    #: every track at once (two or more tracks): per task, the mean over tracks of ``B - A``; the
    #: bootstrap resamples tasks, so a task's episodes on its several tracks stay together
    pooled: TrackComparison | None = None
    #: what the episodes did with their tools, paired like the rewards (empty: the environment measures none)
    tool_use: list[MeasureComparison] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def compare_runs(a: EvalRun, b: EvalRun, *, seed: int = 0, allow: Sequence[str] = ()) -> Comparison:
    """The paired difference ``B - A`` per track (see the module docstring for the refusal rules).

    ``allow`` lists manifest fields (dotted, a prefix allows what is under it) that may differ; ``manifest``
    allows runs without a manifest, compared on their recorded settings alone.

    Raises:
        ConfigError: a run is incomplete or has no manifest, or the runs' episodes are not the same
            episodes (settings or manifest task fields); the message lists every field that differs.
    """

    check_same_episodes(a, b, allow)
    tracks = []
    for harness in a.settings.harnesses:
        ra, rb, dropped = paired_rewards(a.trajectories[harness], b.trajectories[harness])
        if not ra:
            raise ConfigError(
                f"track {harness}: no episode pair where both runs were scored (all infra errors)"
            )
        mean, low, high = paired_bootstrap(ra, rb, seed=seed)
        tracks.append(
            TrackComparison(harness, len(ra), sum(ra) / len(ra), sum(rb) / len(rb), mean, low, high, dropped)
        )
    notes = settings_differences(a.settings, b.settings, ("policy", "sampling", "max_total_tokens"))
    pooled = pooled_comparison(a, b, seed=seed) if len(a.settings.harnesses) > 1 else None
    return Comparison(a.label, b.label, tracks, notes, pooled, tool_use_comparisons(a, b, seed=seed))


def check_same_episodes(a: EvalRun, b: EvalRun, allow: Sequence[str] = ()) -> None:
    """Refuse two evaluations that are not complete runs of the same episodes: the same environment,
    tracks, tasks and seeds (arguments at their defaults aside) and the same manifest task fields
    (``allow``: as :func:`compare_runs` takes it).

    Raises:
        ConfigError: a run is incomplete or has no manifest, or a field differs (every one named).
    """
    for run in (a, b):
        if run.status != "complete":
            n = sum(len(v) for v in run.trajectories.values())
            total = len(run.settings.task_ids) * len(run.settings.harnesses)
            raise ConfigError(
                f"{run.label} is incomplete ({n} of {total} episodes); finish it first by running the same "
                "`toolgym eval` command again (it resumes)"
            )
    diff = settings_differences(_defaults_dropped(a.settings), _defaults_dropped(b.settings), COMPARE_FIELDS)
    if diff:
        raise ConfigError(
            f"cannot compare {a.label} and {b.label}: their episodes differ in {'; '.join(diff)}. "
            "Fix: evaluate both with the same --env, --env-arg, --harness, --n and --seed"
        )
    _check_manifests(a, b, allow)


def tool_use_comparisons(a: EvalRun, b: EvalRun, *, seed: int = 0) -> list[MeasureComparison]:
    """``B - A`` of every tool-use measure both runs have, per track, paired by ``(task, seed)`` over the
    episodes both sides scored and measured (a measure one side lacks is not compared: not measured)."""
    out = []
    for harness in a.settings.harnesses:
        side_b = {(t.task_id, t.seed): t for t in b.trajectories.get(harness, [])}
        pairs = [
            (t, side_b[(t.task_id, t.seed)])
            for t in a.trajectories.get(harness, [])
            if (t.task_id, t.seed) in side_b
            and t.status != "infra_error"
            and side_b[(t.task_id, t.seed)].status != "infra_error"
        ]
        measures = sorted({k for t, u in pairs for k in t.metrics if k.startswith("use/") and k in u.metrics})
        for key in measures:
            xa = [t.metrics[key] for t, u in pairs if key in t.metrics and key in u.metrics]
            xb = [u.metrics[key] for t, u in pairs if key in t.metrics and key in u.metrics]
            mean, low, high = paired_bootstrap(xa, xb, seed=seed)
            out.append(
                MeasureComparison(
                    harness, key, len(xa), sum(xa) / len(xa), sum(xb) / len(xb), mean, low, high
                )
            )
    return out


def pooled_comparison(a: EvalRun, b: EvalRun, *, seed: int = 0) -> TrackComparison:
    """``B - A`` over every track at once, clustered by task (see :attr:`Comparison.pooled`).

    A task counts when both runs scored it on every track (an ``infra_error`` anywhere drops it).
    """

    ra, rb, dropped = pooled_pairs(a, b)
    if not ra:
        raise ConfigError("pooled: no task that both runs scored on every track")
    mean, low, high = paired_bootstrap(ra, rb, seed=seed)
    return TrackComparison("pooled", len(ra), sum(ra) / len(ra), sum(rb) / len(rb), mean, low, high, dropped)


def pooled_pairs(a: EvalRun, b: EvalRun) -> tuple[list[float], list[float], int]:
    """Per task, each side's reward averaged over every track, in ``a``'s order, and how many tasks
    were dropped: a task counts when both runs scored it on every track (no ``infra_error``)."""
    per_track = []
    for harness in a.settings.harnesses:
        side_b = {(t.task_id, t.seed): t for t in b.trajectories[harness]}
        per_track.append(
            {(t.task_id, t.seed): (t, side_b.get((t.task_id, t.seed))) for t in a.trajectories[harness]}
        )
    ra, rb, dropped = [], [], 0
    for key in [k for k in per_track[0] if all(k in track for track in per_track)]:
        pairs = [track[key] for track in per_track]
        if any(y is None or x.status == "infra_error" or y.status == "infra_error" for x, y in pairs):
            dropped += 1
            continue
        ra.append(sum(x.reward for x, _ in pairs) / len(pairs))
        rb.append(sum(y.reward for _, y in pairs if y is not None) / len(pairs))
    return ra, rb, dropped


def early_differences(
    run: EvalRun, env_id: str, env_kwargs: Mapping[str, Any], harnesses: Sequence[str], seed: int
) -> list[str]:
    """The compare fields a planned evaluation already differs in from ``run`` (checked before any
    episode runs, so ``eval --baseline`` refuses a mismatch up front; task ids are checked after)."""
    planned = {
        "env_id": env_id,
        "env_kwargs": json.loads(json.dumps(dict(env_kwargs), default=str, sort_keys=True)),
        "harnesses": list(harnesses),
        "first seed": seed,
    }
    theirs = run.settings.to_dict()
    theirs["first seed"] = theirs["seeds"][0] if theirs["seeds"] else None
    return [f"{k} ({json.dumps(theirs[k])} vs {json.dumps(v)})" for k, v in planned.items() if theirs[k] != v]


def _check_manifests(a: EvalRun, b: EvalRun, allow: Sequence[str]) -> None:
    if "manifest" in allow:
        return
    for run in (a, b):
        if run.manifest is None:
            raise ConfigError(
                f"{run.label} has no {RUN_MANIFEST} (it ran before toolgym recorded run manifests), so nothing says "
                "its data, index, prompts and verifier match the other run's. Fix: evaluate it again with "
                "`--restart`, or pass `--allow manifest` to compare on the recorded settings alone"
            )
    differences = manifest_differences(a.manifest or {}, b.manifest or {}, allow=allow)
    if differences:
        fields = sorted({d.split(":", 1)[0] for d in differences})
        raise ConfigError(
            f"cannot compare {a.label} and {b.label}: what decides the task or its scoring differs: "
            f"{'; '.join(differences)}. If that difference cannot change the numbers, say so explicitly: "
            + " ".join(f"--allow {f}" for f in fields)
        )
