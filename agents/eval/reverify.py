"""Re-verification: score stored trajectories again with today's environment, without the policy.

A trajectory records every action the policy took (its assistant messages, exactly as sampled) and the
episode's environment id, task, seed, harness and allowed tools; the run directory records the
environment's constructor arguments. :func:`replay` resets a fresh environment with the same task and
seed, steps it with the same actions and takes the reward, termination and metrics it answers *now*.
Nothing is sampled, so a verifier fix (or a changed index, corpus or sandbox image) shows up as
changed rewards, and a changed observation (a tool answering differently than it did) is reported
beside it: the old reward may then no longer be what today's environment would have given the same
policy, since the policy saw other text.

Sources a run directory may hold, all re-scored by :func:`reverify_run`:

* an evaluation (``toolgym eval --out``): ``eval.json`` + ``trajectories-<track>.jsonl``;
* a training run: ``config.json`` + ``trajectories.jsonl`` (each line a consumed sample), and its
  held-out evaluations ``heldout/base`` and ``heldout/trained``.

An episode played in another call syntax than ``hermes`` (a model with its own chat format,
:mod:`toolgym.call_formats`) is replayed in that syntax: the one whose opening messages are the stored
ones (the syntax shapes the tool list the environment writes).

NOTE (data, not code): the environment id comes from the stored files, and gymnasium's ``module:id``
form imports that module, which runs its code. A run directory may come from anyone, so such an id is
refused unless the caller allows it (``allow_import=True``, ``toolgym reverify --allow-import``), before
any environment is built; a registered id (``toolgym/SearchQA-v0``) imports nothing the file chooses.

Episodes that ended as ``infra_error`` were never scored and are skipped (counted). An environment
that raises anything but an :class:`~toolgym.errors.InfraError` while replaying is a verifier or
environment bug: it is reported per episode as an error (never as reward 0) and the rest go on.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from toolgym.agents.eval.runs import load_eval_run
from toolgym.agents.harness import get_harness
from toolgym.call_formats import CALL_FORMATS
from toolgym.core import Trajectory
from toolgym.data import iter_jsonl
from toolgym.errors import ConfigError, InfraError
from toolgym.parsing import HERMES
from toolgym.registry import is_remote_id, make
from toolgym.run_files import write_atomic

__all__ = ["Replay", "ReverifyReport", "SourceReport", "refuse_stored_import", "replay", "reverify_run"]

RESULT = "reverify.json"
#: rewards closer than this are the same reward (float rounding in a metric)
TOLERANCE = 1e-9


@dataclass(frozen=True)
class Replay:
    """What today's environment answers to one stored trajectory's actions."""

    reward: float
    status: str
    metrics: Mapping[str, float]
    #: the first message where today's observations differ from the stored ones ("" when none)
    observation_diff: str = ""


def _reset(env: Any, trajectory: Trajectory, call_format: str = HERMES.name) -> tuple[Any, dict[str, Any]]:
    options: dict[str, Any] = {"task_id": trajectory.task_id}
    if call_format != HERMES.name:
        options["call_format"] = call_format
    obs, info = env.reset(seed=trajectory.seed, options=options)
    if tuple(info.get("allowed_tools", ())) != tuple(trajectory.allowed_tools):
        # a curriculum stage restricted the tools when the episode was sampled
        options["tools"] = sorted(trajectory.allowed_tools)
        obs, info = env.reset(seed=trajectory.seed, options=options)
    return obs, info


def _diff(where: str, stored: Sequence[Mapping[str, Any]], now: Sequence[Mapping[str, Any]]) -> str:
    for i, (a, b) in enumerate(zip(stored, now, strict=False)):
        if dict(a) != dict(b):
            return f"{where}, message {i}: stored {str(a.get('content'))[:80]!r}, now {str(b.get('content'))[:80]!r}"
    return f"{where}: stored {len(stored)} message(s), now {len(now)}"


def replay(env: Any, trajectory: Trajectory) -> Replay:
    """Step ``env`` (a fresh or reusable environment of the trajectory's id) with the stored actions.

    Raises:
        InfraError: the environment's infrastructure failed (the episode cannot be re-scored now).
        Exception: anything else the environment raises (a bug; the caller reports it).
    """
    harness = get_harness(trajectory.harness)
    max_turns = env.unwrapped.max_turns
    stored = [dict(m) for m in trajectory.messages]
    for call_format in (HERMES.name, *(name for name in CALL_FORMATS if name != HERMES.name)):
        obs, _ = _reset(env, trajectory, call_format)
        expected = harness.start(obs, max_turns=max_turns)
        if stored[: len(expected)] == expected:
            break
    else:  # no syntax gives the stored opening: replay as hermes and report where it differs
        call_format = HERMES.name
        obs, _ = _reset(env, trajectory)
        expected = harness.start(obs, max_turns=max_turns)
    to_format = getattr(harness, "for_call_format", None)
    if call_format != HERMES.name and to_format is not None:
        harness = to_format(call_format)
    diff = "" if stored[: len(expected)] == expected else _diff("start", stored[: len(expected)], expected)
    i, turn = len(expected), 0
    reward, terminated, metrics = 0.0, False, {}
    while i < len(stored):
        message = stored[i]
        i += 1
        if message.get("role") != "assistant":
            diff = diff or f"message {i - 1}: a {message.get('role')!r} message where an action was expected"
            break
        turn += 1
        obs, reward, terminated, truncated, info = env.step(message.get("content", ""))
        metrics.update(info.get("metrics", {}))
        if terminated or truncated:
            break
        new = harness.after_step(obs, turn=turn, max_turns=max_turns)
        if not diff and stored[i : i + len(new)] != new:
            diff = _diff(f"after turn {turn}", stored[i : i + len(new)], new)
        i += len(new)
    status = "ok" if terminated else "truncated"
    return Replay(float(reward) if terminated else 0.0, status, metrics, diff)


@dataclass
class SourceReport:
    """The re-verification of one source (an evaluation directory or a training run's samples)."""

    name: str
    episodes: int = 0
    rescored: int = 0
    changed: int = 0
    observation_changed: int = 0
    skipped_infra: int = 0
    infra_now: int = 0
    errors: list[str] = field(default_factory=list)
    examples: list[dict[str, Any]] = field(default_factory=list)
    #: per track: ``[n, old mean reward, new mean reward]`` over the re-scored episodes
    tracks: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class ReverifyReport:
    run_dir: str
    sources: list[SourceReport]

    @property
    def errors(self) -> int:
        return sum(len(s.errors) for s in self.sources)

    @property
    def changed(self) -> int:
        return sum(s.changed for s in self.sources)

    def to_dict(self) -> dict[str, Any]:
        return {"run_dir": self.run_dir, "sources": [asdict(s) for s in self.sources]}


def _sources(run_dir: Path) -> Iterator[tuple[str, str, dict[str, Any], list[Trajectory]]]:
    """``(name, env_id, env_kwargs, trajectories)`` for every source in ``run_dir``."""
    candidates = [run_dir, run_dir / "heldout" / "base", run_dir / "heldout" / "trained"]
    for directory in candidates:
        if (directory / "eval.json").is_file():
            run = load_eval_run(directory)
            episodes = [t for track in run.trajectories.values() for t in track]
            yield str(directory), run.settings.env_id, dict(run.settings.env_kwargs), episodes
    samples = run_dir / "trajectories.jsonl"
    if samples.is_file() and (run_dir / "config.json").is_file():
        config = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
        envs = config.get("envs") or [config.get("env", {})]
        by_env: dict[str, list[Trajectory]] = {}  # a mixture's records name their [[env]]
        for n, record in iter_jsonl(samples, what="training sample file"):  # deep or huge lines: ConfigError
            try:
                episode = Trajectory.from_json(json.dumps(record["trajectory"]))
            except (ValueError, KeyError, TypeError, RecursionError) as exc:
                raise ConfigError(f"{samples}:{n} is not a training sample record ({exc!r})"[:500]) from None
            by_env.setdefault(record.get("env", ""), []).append(episode)
        for env in envs:
            name = env.get("name", "") if len(envs) > 1 else ""
            where = f"{samples} [{name}]" if name else str(samples)
            yield where, str(env.get("id", "")), dict(env.get("kwargs", {})), by_env.get(name, [])


def _reverify_source(
    name: str,
    env_id: str,
    env_kwargs: dict[str, Any],
    episodes: Sequence[Trajectory],
    progress: Callable[[int, int], None] | None,
    examples: int,
) -> SourceReport:
    report = SourceReport(name, episodes=len(episodes))
    env = make(env_id, **env_kwargs)
    try:
        for k, t in enumerate(episodes, 1):
            if progress is not None:
                progress(k, len(episodes))
            if t.status == "infra_error":
                report.skipped_infra += 1
                continue
            try:
                now = replay(env, t)
            except InfraError as exc:
                report.infra_now += 1
                report.errors.append(f"{t.harness}/{t.task_id} seed {t.seed}: infrastructure failed: {exc}")
                continue
            except Exception as exc:  # a verifier or environment bug: an error, never reward 0
                report.errors.append(f"{t.harness}/{t.task_id} seed {t.seed}: {type(exc).__name__}: {exc}")
                env.close()
                env = make(env_id, **env_kwargs)
                continue
            report.rescored += 1
            n, old, new = report.tracks.get(t.harness, [0, 0.0, 0.0])
            report.tracks[t.harness] = [n + 1, old + t.reward, new + now.reward]
            changed = not math.isclose(now.reward, t.reward, abs_tol=TOLERANCE) or now.status != t.status
            report.changed += changed
            report.observation_changed += bool(now.observation_diff)
            if (changed or now.observation_diff) and len(report.examples) < examples:
                report.examples.append(
                    {
                        "harness": t.harness,
                        "task_id": t.task_id,
                        "seed": t.seed,
                        "old": [t.reward, t.status],
                        "new": [now.reward, now.status],
                        "observation_diff": now.observation_diff,
                    }
                )
    finally:
        env.close()
    report.tracks = {h: [n, old / n, new / n] for h, (n, old, new) in report.tracks.items()}
    return report


def _refuse_imports(sources: Sequence[tuple[str, str, dict[str, Any], list[Trajectory]]]) -> None:
    for name, env_id, _, _ in sources:
        refuse_stored_import(name, env_id, "reverify_run(..., allow_import=True)")


def refuse_stored_import(name: str, env_id: str, allow: str) -> None:
    """Refuse a stored ``module:id`` environment id (its module would be imported: code chosen by a
    file); the flag that allows it is named (``--allow-import``, or ``allow`` from Python)."""
    module = env_id.rpartition(":")[0]
    if module and not is_remote_id(env_id):
        raise ConfigError(
            f"{name} names the environment {env_id!r}: rebuilding it imports the module {module!r}, which "
            "runs its code, and the name comes from a stored file that anyone who could write the run "
            "directory may have chosen. Nothing was imported. If you trust this run directory and that "
            f"module, pass --allow-import ({allow})"
        )


def reverify_run(
    run_dir: str | Path,
    *,
    progress: Callable[[str, int, int], None] | None = None,
    examples: int = 5,
    write: bool = True,
    allow_import: bool = False,
) -> ReverifyReport:
    """Re-score every stored trajectory under ``run_dir``; write ``RUN/reverify.json`` when ``write``.

    ``allow_import``: build environments named in gymnasium's ``module:id`` form, importing the module
    a stored file names (see the NOTE above); refused otherwise.

    Raises:
        ConfigError: ``run_dir`` is not a directory or holds nothing to re-score, a stored environment id
            names a module to import and ``allow_import`` is false, or a link stands at ``reverify.json``.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise ConfigError(
            f"{str(run)!r} is not a directory; pass a `toolgym train --out` or `toolgym eval --out`"
        )
    stored = list(_sources(run))
    if not allow_import:
        _refuse_imports(stored)
    sources = []
    for name, env_id, env_kwargs, episodes in stored:
        step = (lambda done, total, name=name: progress(name, done, total)) if progress else None
        sources.append(_reverify_source(name, env_id, env_kwargs, episodes, step, examples))
    if not sources:
        raise ConfigError(
            f"{run} has no stored trajectories to re-score: expected eval.json + trajectories-<track>.jsonl "
            "(toolgym eval --out) or config.json + trajectories.jsonl (toolgym train --out)"
        )
    report = ReverifyReport(str(run), sources)
    if write:
        write_atomic(run / RESULT, json.dumps(report.to_dict(), indent=2) + "\n")  # never through a link
    return report
