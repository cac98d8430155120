"""The warm-start phase of a training run: sample demonstrations, fine-tune, or reuse an earlier run's.

:func:`run_warm_start` is what the trainer calls before its first rollout (the pieces it uses, and why a
warm start exists, are in :mod:`toolgym.training.warm_start`); with ``warm_start.reuse`` it loads the
step-0 export of an earlier run with the same settings instead (:func:`reused_warm_start` checks the
settings), or rebuilds that warm start where the run kept no weights; the weights are checked by the
hash the run recorded (:func:`weights_sha256`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolgym.agents.eval.results import RESULT_FILE, machine_roots, portable, read_result
from toolgym.errors import ConfigError
from toolgym.training.checkpoint import save_checkpoint
from toolgym.training.config import RunConfig, renamed_keys, to_dict
from toolgym.training.export import export_checkpoint
from toolgym.training.learn.lora import base_weights_trainable, load_plain_state_dict, plain_state_dict
from toolgym.training.sampling.workers import env_factory
from toolgym.training.warm_start import (
    WarmStartResult,
    fine_tune,
    reference_demonstrator,
    rejection_sample,
    summarize,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "SEED",
    "WARM_START_KEYS",
    "ReusedWarmStart",
    "load_warm_start",
    "reuse_warm_start",
    "reused_warm_start",
    "run_warm_start",
    "warm_start_env_kwargs",
    "warm_start_identity",
    "warm_start_seed",
    "warm_start_tools",
    "weights_sha256",
]


async def run_warm_start(trainer: Any, make_env: Callable[[], Any]) -> None:
    """The configured warm start of ``trainer``'s run, once (a resumed run never repeats it), checkpointed.

    It runs before any rollout worker samples, ends with a weight sync and a version bump like an RL
    step, and is saved as a step-0 checkpoint and export, so the warm-started policy can be evaluated
    on its own (``run:DIR@0``; the held-out control arm). With ``warm_start.reuse`` the export of an
    earlier run with the same settings is loaded instead, or, where that run keeps no weights (its
    result file, or a run directory without its export), the warm start is rebuilt here. Either way the
    weights must have the hash that run recorded (:func:`weights_sha256`), or the run stops before its
    first checkpoint.

    Raises:
        ConfigError: the reused or rebuilt weights differ from the recorded ones (both hashes named).
    """
    config = trainer.config
    ws = config.warm_start
    if not ws.enabled or trainer.warm_started:
        return
    started = time.perf_counter()
    result, source = None, None
    if ws.reuse:
        source = reused_warm_start(ws.reuse, config)
        if source.export is not None:
            result = load_warm_start(source, trainer.model)
            trainer.progress.line(f"warm start: reused {ws.reuse}")
        else:
            trainer.progress.line(
                f"warm start: {ws.reuse} keeps no weights; rebuilding its warm start here, checked by its "
                f"hash {source.sha256[:12]}"
            )
    if result is None:
        result = await _make_warm_start(trainer, make_env, started)
    digest = weights_sha256(trainer.model)
    if source is not None and source.sha256 and digest != source.sha256:
        raise ConfigError(_hash_refusal(source, digest))
    result = dataclasses.replace(result, weights_sha256=digest)
    trainer.optimizer.reload_masters()  # a bf16 model's fp32 masters still hold the weights before it
    trainer.handle.publish()  # the warm-started weights, as the next version
    if trainer.reference is not None:  # the KL anchors to the warm-started policy
        trainer.reference.load_state_dict(trainer.model.state_dict())
    trainer.warm_started = True
    result.write(trainer.run_dir)
    trainer.progress.line(
        f"warm start: done in {time.perf_counter() - started:.0f} s (loss by epoch "
        f"{', '.join(f'{loss:.4f}' for loss in result.epoch_losses)}, weights {digest[:12]})"
    )
    save_checkpoint(trainer.run_dir, trainer.state_dict())
    export_checkpoint(trainer.run_dir, trainer.model, trainer.policy, step=0)


async def _make_warm_start(trainer: Any, make_env: Callable[[], Any], started: float) -> WarmStartResult:
    """Sample the demonstrations and fine-tune ``trainer.model`` on the kept ones."""
    import asyncio

    config = trainer.config
    ws = config.warm_start
    tools = warm_start_tools(config)
    kwargs = warm_start_env_kwargs(config)
    policy_for = (
        reference_demonstrator(config.env.id, kwargs, trainer.policy, config.env.reference_rule)
        if ws.source == "reference"
        else None
    )
    free = None
    if ws.kwargs:  # its own environments: the run's kwargs with warm_start.kwargs over them
        make_env, free = env_factory("asyncio", config.env.id, kwargs)
    try:
        with trainer.progress.task(f"warm start ({ws.source}): episodes") as bar:
            episodes, kept = await rejection_sample(
                make_env,
                trainer.policy,
                trainer.harness,
                trainer.task_ids,
                dataclasses.replace(ws, tools=tuple(tools)),
                seed=warm_start_seed(config) + 1_000_003,
                max_tokens=config.sampling.max_tokens,
                max_total_tokens=config.env.max_total_tokens,
                progress=lambda done, total: bar.update(done, total=total),
                policy_for=policy_for,
            )
    finally:
        if free is not None:
            free()
    trainer.progress.line(f"warm start: kept {len(kept)} of {len(episodes)} episodes; fine-tuning")
    with (
        base_weights_trainable(trainer.model),  # a full fine-tune, adapters or not
        trainer.progress.task("warm start: fine-tuning steps") as bar,
    ):
        losses = await asyncio.to_thread(
            fine_tune,
            trainer.model,
            kept,
            ws,
            seed=warm_start_seed(config),
            lock=trainer.handle.lock,
            progress=lambda done, total: bar.update(done, total=total),
            checkpoint_layers=config.train.batching.checkpoint_layers,
        )
    return summarize(episodes, kept, losses, started, tools=tuple(tools))


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of ``model``'s weights under their original names (LoRA adapters merged in, so a LoRA
    model right after its warm start hashes as the full model does): every tensor in name order, with
    its name and shape, floating-point values as float32 (a bfloat16 export loaded into a float32 model
    hashes as the bfloat16 model that wrote it)."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    state = plain_state_dict(model)
    for name in sorted(state):
        tensor = state[name].detach().to("cpu")
        if (
            tensor.is_floating_point()
        ):  # bfloat16 and float16 widen exactly: one hash whatever the model's dtype
            tensor = tensor.float()
        tensor = tensor.contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


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
    :func:`run_warm_start` checks the weights it ends with).

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


def _hash_refusal(source: ReusedWarmStart, digest: str) -> str:
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


#: What decides a warm start besides ``[warm_start]`` itself, its seed (:func:`warm_start_seed`) and
#: the prompt's tools.
WARM_START_KEYS = {
    "env": ("id", "kwargs", "harness", "max_total_tokens", "task_limit", "task_ids", "reference_rule"),
    "policy": ("model",),
    "sampling": ("max_tokens",),
}


#: The name :func:`warm_start_identity` gives the warm start's seed.
SEED = "the warm start's seed"


def warm_start_seed(config: RunConfig) -> int:
    """The warm start's seed: ``warm_start.seed``, else ``train.seed``."""
    seed = config.warm_start.seed
    return int(config.train.seed if seed is None else seed)


def warm_start_identity(data: Mapping[str, Any]) -> dict[str, Any]:
    """What decides a warm start, by name, from a config as plain data (``to_dict``, or a run's stored
    ``config.json``, where a setting added since may be missing): :data:`WARM_START_KEYS`, every
    ``[warm_start]`` setting but ``reuse``, ``tools`` (the prompt's tools are compared on their own),
    ``seed`` and ``kwargs`` (folded into ``env.kwargs``: the kwargs it sampled with,
    :func:`warm_start_env_kwargs`), and the seed the warm start used (:data:`SEED`, as
    :func:`warm_start_seed` gives it)."""
    ws = dict(data.get("warm_start", {}))
    out = {f"{s}.{k}": data.get(s, {}).get(k) for s, keys in WARM_START_KEYS.items() for k in keys}
    out["env.kwargs"] = {**dict(out["env.kwargs"] or {}), **dict(ws.get("kwargs") or {})}  # as it sampled
    out["env.reference_rule"] = out["env.reference_rule"] or ""  # a run from before the setting: its default
    out.update({f"warm_start.{k}": v for k, v in ws.items() if k not in ("reuse", "tools", "seed", "kwargs")})
    out[SEED] = ws["seed"] if ws.get("seed") is not None else data.get("train", {}).get("seed")
    return out


def warm_start_env_kwargs(config: RunConfig) -> dict[str, Any]:
    """The environment keyword arguments the warm start samples with: ``env.kwargs``, with
    ``warm_start.kwargs`` over them."""
    return {**dict(config.env.kwargs), **dict(config.warm_start.kwargs)}


def warm_start_tools(config: RunConfig) -> tuple[str, ...]:
    """The tools the demonstrations' prompt offers: ``warm_start.tools``, else the first curriculum
    stage's (the prompt RL starts from), else every tool (empty)."""
    stages = config.curriculum.stages or (config.env.stages if config.env.stages else ())
    return tuple(config.warm_start.tools or (stages[0] if stages else ()))
