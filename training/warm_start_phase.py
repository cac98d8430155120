"""The warm-start phase of a training run: sample demonstrations, fine-tune, or reuse an earlier run's.

:func:`run_warm_start` is what the trainer calls before its first rollout (the pieces it uses, and why a
warm start exists, are in :mod:`toolgym.training.warm_start`); :func:`reuse_warm_start` loads the
step-0 export of an earlier run with the same settings instead (``warm_start.reuse``).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolgym.errors import ConfigError
from toolgym.training.checkpoint import save_checkpoint
from toolgym.training.config import renamed_keys, to_dict
from toolgym.training.export import export_checkpoint
from toolgym.training.learn.lora import base_weights_trainable, load_plain_state_dict
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
    "reuse_warm_start",
    "run_warm_start",
    "warm_start_identity",
    "warm_start_seed",
    "warm_start_tools",
]


async def run_warm_start(trainer: Any, make_env: Callable[[], Any]) -> None:
    """The configured warm start of ``trainer``'s run, once (a resumed run never repeats it), checkpointed.

    It runs before any rollout worker samples, ends with a weight sync and a version bump like an RL
    step, and is saved as a step-0 checkpoint and export, so the warm-started policy can be evaluated
    on its own (``run:DIR@0``; the held-out control arm). With ``warm_start.reuse`` the export of an
    earlier run with the same settings is loaded instead.
    """
    import asyncio

    config = trainer.config
    ws = config.warm_start
    if not ws.enabled or trainer.warm_started:
        return
    started = time.perf_counter()
    if ws.reuse:
        result = reuse_warm_start(ws.reuse, config, trainer.model)
        trainer.progress.line(f"warm start: reused {ws.reuse}")
    else:
        tools = warm_start_tools(config)
        policy_for = (
            reference_demonstrator(config.env.id, dict(config.env.kwargs), trainer.policy)
            if ws.source == "reference"
            else None
        )
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
                lock=trainer._weights_lock,
                progress=lambda done, total: bar.update(done, total=total),
            )
        result = summarize(episodes, kept, losses, started, tools=tuple(tools))
    trainer.optimizer.reload_masters()  # a bf16 model's fp32 masters still hold the weights before it
    with trainer._weights_lock:
        if trainer.weight_sync is not None:
            trainer.weight_sync.sync(trainer.model, trainer.policy.policy_version + 1)
        else:
            trainer.policy.policy_version += 1
    if trainer.reference is not None:  # the KL anchors to the warm-started policy
        trainer.reference.load_state_dict(trainer.model.state_dict())
    trainer.warm_started = True
    result.write(trainer.run_dir)
    trainer.progress.line(
        f"warm start: done in {time.perf_counter() - started:.0f} s (loss {list(result.epoch_losses)})"
    )
    save_checkpoint(trainer.run_dir, trainer.state_dict())
    export_checkpoint(trainer.run_dir, trainer.model, trainer.policy, step=0)


def reuse_warm_start(source: str | Path, config: Any, model: torch.nn.Module) -> WarmStartResult:
    """Load an earlier run's warm-start export into ``model`` and return that run's result.

    Raises:
        ConfigError: ``source`` is not a run (or step-0 export) with a warm start, or its settings
            differ from ``config``'s in what decides the warm start (named).
    """
    from safetensors.torch import load_file

    path = Path(source)
    run = path.parent.parent if path.name == "step-000000" else path
    export, record, settings = run / "export" / "step-000000", run / "warm_start.json", run / "config.json"
    if not (export / "model.safetensors").is_file() or not record.is_file() or not settings.is_file():
        raise ConfigError(
            f"warm_start.reuse = {str(source)!r}: not a training run with a warm start (it needs "
            "export/step-000000/model.safetensors, warm_start.json and config.json; exports are pruned to "
            "the newest two, so pass a run whose step-0 export is still there)"
        )
    try:
        theirs = renamed_keys(json.loads(settings.read_text(encoding="utf-8")))  # a record of any release
        result = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"warm_start.reuse: {run} is unreadable ({exc})") from None
    ours, there = warm_start_identity(to_dict(config)), warm_start_identity(theirs)
    differences = [
        f"{k}: {there.get(k)!r} there, {v!r} here" for k, v in ours.items() if k != SEED and there.get(k) != v
    ]
    if there.get(SEED) != ours[SEED]:
        differences.append(
            f"{SEED}: {there.get(SEED)!r} there, {ours[SEED]!r} here (warm_start.seed, else train.seed; to "
            f"train RL with another train.seed from that warm start, set warm_start.seed = {there.get(SEED)!r})"
        )
    tools = list(warm_start_tools(config))  # the demonstrations' prompt, as that run recorded it
    if sorted(result.get("tools") or []) != sorted(tools):
        differences.append(f"the prompt's tools: {result.get('tools') or 'all'} there, {tools or 'all'} here")
    if differences:
        raise ConfigError(
            f"warm_start.reuse = {str(source)!r} is another warm start: {'; '.join(differences)}. "
            "Reuse a run made with this config's [warm_start], or drop warm_start.reuse to warm-start here"
        )
    weights = load_file(str(export / "model.safetensors"))
    missing, unexpected = load_plain_state_dict(model, weights)  # into a LoRA model's base layers too
    if unexpected or any(not k.endswith("lm_head.weight") for k in missing):
        raise ConfigError(
            f"warm_start.reuse: {export}'s weights do not fit this model ({(missing + unexpected)[:3]})"
        )
    fields = {f.name for f in dataclasses.fields(WarmStartResult)}
    values: dict[str, Any] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in result.items() if k in fields
    }
    return WarmStartResult(**values)


#: What decides a warm start besides ``[warm_start]`` itself, its seed (:func:`warm_start_seed`) and
#: the prompt's tools.
WARM_START_KEYS = {
    "env": ("id", "kwargs", "harness", "max_total_tokens", "task_limit", "task_ids"),
    "policy": ("model",),
    "sampling": ("max_tokens",),
}


#: The name :func:`warm_start_identity` gives the warm start's seed.
SEED = "the warm start's seed"


def warm_start_seed(config: Any) -> int:
    """The warm start's seed: ``warm_start.seed``, else ``train.seed``."""
    seed = config.warm_start.seed
    return int(config.train.seed if seed is None else seed)


def warm_start_identity(data: Mapping[str, Any]) -> dict[str, Any]:
    """What decides a warm start, by name, from a config as plain data (``to_dict``, or a run's stored
    ``config.json``, where a setting added since may be missing): :data:`WARM_START_KEYS`, every
    ``[warm_start]`` setting but ``reuse``, ``tools`` (the prompt's tools are compared on their own)
    and ``seed``, and the seed the warm start used (:data:`SEED`, as :func:`warm_start_seed` gives it)."""
    ws = dict(data.get("warm_start", {}))
    out = {f"{s}.{k}": data.get(s, {}).get(k) for s, keys in WARM_START_KEYS.items() for k in keys}
    out.update({f"warm_start.{k}": v for k, v in ws.items() if k not in ("reuse", "tools", "seed")})
    out[SEED] = ws["seed"] if ws.get("seed") is not None else data.get("train", {}).get("seed")
    return out


def warm_start_tools(config: Any) -> tuple[str, ...]:
    """The tools the demonstrations' prompt offers: ``warm_start.tools``, else the first curriculum
    stage's (the prompt RL starts from), else every tool (empty)."""
    stages = config.curriculum.stages or (config.env.stages if config.env.stages else ())
    return tuple(config.warm_start.tools or (stages[0] if stages else ()))
