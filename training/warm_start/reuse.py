"""Reusing an earlier run's warm start (``warm_start.reuse``): load its step-0 export, or rebuild it and check.

:func:`reused_warm_start` reads what ``warm_start.reuse`` names (a run directory, its step-0 export or a
run's result file) and refuses a warm start made with other settings (each difference named);
:func:`load_warm_start` loads the export's weights. Where the run keeps no weights, the warm start is
rebuilt and must end with the hash that run recorded (:func:`hash_refusal` words the refusal).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolgym.agents.eval.results import RESULT_FILE, machine_roots, portable, read_result
from toolgym.errors import ConfigError
from toolgym.training.config import RunConfig, renamed_keys, to_dict
from toolgym.training.learn.lora import load_plain_state_dict
from toolgym.training.warm_start.demonstrations import WarmStartResult
from toolgym.training.warm_start.identity import SEED, warm_start_identity, warm_start_tools

if TYPE_CHECKING:
    import torch

__all__ = ["ReusedWarmStart", "hash_refusal", "load_warm_start", "reuse_warm_start", "reused_warm_start"]


@dataclasses.dataclass(frozen=True)
class ReusedWarmStart:
    """Where ``warm_start.reuse`` points: the run's step-0 export (None: no weights kept there), its
    ``warm_start.json`` record and the weights hash it recorded (empty: recorded before hashes were)."""

    source: str
    export: Path | None
    record: dict[str, Any]
    sha256: str


def reused_warm_start(source: str | Path, config: RunConfig) -> ReusedWarmStart:
    """What ``warm_start.reuse = source`` names, checked to be this config's warm start.

    ``source`` is a training run directory (or its ``export/step-000000``) or a run's result file
    (``toolgym train`` writes ``RUN/result.json``; a study keeps them in the repository). Without the
    step-0 export (a result file, or a run whose weights were removed) the warm start is rebuilt, so the
    record must carry the hash to check the rebuild by.

    Raises:
        ConfigError: not a run with a warm start, nothing to load or to check a rebuild by, or its
            settings differ from ``config``'s in what decides the warm start (named).
    """
    path = Path(source)
    settings, record, roots = _reused_records(path)
    run = path.parent.parent if path.name == "step-000000" else path
    export = run / "export" / "step-000000"
    weights = export if path.is_dir() and (export / "model.safetensors").is_file() else None
    sha256 = str(record.get("weights_sha256") or "")
    if weights is None and not sha256:
        raise ConfigError(
            f"warm_start.reuse = {str(source)!r}: neither its step-0 export (export/step-000000/"
            "model.safetensors) nor a recorded weights hash to rebuild it against (warm_start.json "
            "records one since toolgym kept hashes); pass a run whose step-0 export is still there"
        )
    ours = warm_start_identity(to_dict(config))
    if roots:  # a result file names this machine's folders by stand-ins
        ours = portable(ours, roots)
    there = warm_start_identity(settings)
    differences = [
        f"{k}: {there.get(k)!r} there, {v!r} here" for k, v in ours.items() if k != SEED and there.get(k) != v
    ]
    if there.get(SEED) != ours[SEED]:
        differences.append(
            f"{SEED}: {there.get(SEED)!r} there, {ours[SEED]!r} here (warm_start.seed, else train.seed; to "
            f"train RL with another train.seed from that warm start, set warm_start.seed = {there.get(SEED)!r})"
        )
    tools = list(warm_start_tools(config))  # the demonstrations' prompt, as that run recorded it
    if sorted(record.get("tools") or []) != sorted(tools):
        differences.append(f"the prompt's tools: {record.get('tools') or 'all'} there, {tools or 'all'} here")
    if differences:
        raise ConfigError(
            f"warm_start.reuse = {str(source)!r} is another warm start: {'; '.join(differences)}. "
            "Reuse a run made with this config's [warm_start], or drop warm_start.reuse to warm-start here"
        )
    return ReusedWarmStart(str(source), weights, record, sha256)


def _reused_records(path: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """``(config, warm_start record, the stand-ins of its paths)`` of a run directory or result file."""
    if path.is_file():
        data = read_result(path)
        settings, record = data.get("config"), data.get("warm_start")
        if data.get("what") != "run" or not isinstance(settings, dict) or not isinstance(record, dict):
            raise ConfigError(
                f"warm_start.reuse = {str(path)!r}: not the result file of a training run with a warm start "
                "(it needs the run's config and warm_start record)"
            )
        return renamed_keys(settings), record, machine_roots(path.parent)
    run = path.parent.parent if path.name == "step-000000" else path
    files = run / "config.json", run / "warm_start.json"
    if not all(f.is_file() for f in files):
        if (run / RESULT_FILE).is_file():
            return _reused_records(run / RESULT_FILE)
        raise ConfigError(
            f"warm_start.reuse = {str(path)!r}: not a training run with a warm start (it needs config.json "
            f"and warm_start.json, with export/step-000000/model.safetensors to load, or a {RESULT_FILE})"
        )
    try:
        settings = json.loads(files[0].read_text(encoding="utf-8"))
        record = json.loads(files[1].read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"warm_start.reuse: {run} is unreadable ({exc})") from None
    if not isinstance(settings, dict) or not isinstance(record, dict):
        raise ConfigError(f"warm_start.reuse: {run}'s config.json or warm_start.json is not a JSON object")
    return renamed_keys(settings), record, {}  # a record of any release


def load_warm_start(source: ReusedWarmStart, model: torch.nn.Module) -> WarmStartResult:
    """Load ``source``'s step-0 export into ``model`` (its base layers, with LoRA) and return its result.

    Raises:
        ConfigError: the export's weights do not fit ``model``.
    """
    from safetensors.torch import load_file

    assert source.export is not None
    weights = load_file(str(source.export / "model.safetensors"))
    missing, unexpected = load_plain_state_dict(model, weights)  # into a LoRA model's base layers too
    if unexpected or any(not k.endswith("lm_head.weight") for k in missing):
        raise ConfigError(
            f"warm_start.reuse: {source.export}'s weights do not fit this model ({(missing + unexpected)[:3]})"
        )
    fields = {f.name for f in dataclasses.fields(WarmStartResult)}
    values: dict[str, Any] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in source.record.items() if k in fields
    }
    return WarmStartResult(**values)


def reuse_warm_start(source: str | Path, config: RunConfig, model: torch.nn.Module) -> WarmStartResult:
    """Load an earlier run's warm-start export into ``model`` and return that run's result (no hash check:
    the warm-start phase checks the weights it ends with).

    Raises:
        ConfigError: ``source`` is not a run (or step-0 export) with a warm start, keeps no weights, or
            its settings differ from ``config``'s in what decides the warm start (named).
    """
    reused = reused_warm_start(source, config)
    if reused.export is None:
        raise ConfigError(
            f"warm_start.reuse = {str(source)!r} keeps no weights to load (it is rebuilt by a run)"
        )
    return load_warm_start(reused, model)


def hash_refusal(source: ReusedWarmStart, digest: str) -> str:
    """Why weights hashed ``digest`` are not ``source``'s recorded warm start: its export was replaced, or
    this machine does not rebuild the same warm start."""
    if source.export is not None:
        return (
            f"warm_start.reuse = {source.source!r}: its step-0 export's weights have hash {digest[:16]}, but "
            f"its warm_start.json records {source.sha256[:16]}: the export was replaced or damaged since. "
            "Reuse another run, or drop warm_start.reuse to warm-start here"
        )
    return (
        f"warm_start.reuse = {source.source!r}: the warm start rebuilt here has weights hash {digest[:16]}, "
        f"the recorded one {source.sha256[:16]}: this machine does not rebuild the same warm start (another "
        "library version, thread count or device changes the sampled episodes or the fine-tune's arithmetic), "
        "so runs from it would not share their starting point. Bring that run's export/step-000000 here, "
        "or drop warm_start.reuse and warm-start every compared run here"
    )
