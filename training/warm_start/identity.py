"""What decides a warm start, and what proves two are the same: its settings, its seed and its weights' hash.

A warm start is decided by the ``[warm_start]`` table, a few keys of the rest of the config
(:data:`WARM_START_KEYS`), its seed (:func:`warm_start_seed`) and the tools its prompt offers
(:func:`warm_start_tools`); :func:`warm_start_identity` names them all for a comparison. The weights it
ends with are fingerprinted by :func:`weights_sha256`, the hash a reused or rebuilt warm start is
checked by.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from toolgym.training.config import RunConfig
from toolgym.training.learn.lora import plain_state_dict

if TYPE_CHECKING:
    import torch

__all__ = [
    "SEED",
    "WARM_START_KEYS",
    "warm_start_env_kwargs",
    "warm_start_identity",
    "warm_start_seed",
    "warm_start_tools",
    "weights_sha256",
]


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
