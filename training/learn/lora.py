"""LoRA for the learner through ``peft``: adapters injected into the model in place, merged for export.

Why in place. The ``hf`` policy samples from the very module the learner trains, so the adapters must
live inside that module: :func:`apply_lora` uses ``peft.inject_adapter_in_model``, which replaces each
target ``Linear`` by a LoRA layer wrapping it, in the same model object; the policy's generation and
the learner's scoring both run through the adapters, and only the adapters' parameters train
(``requires_grad`` is turned off everywhere else). A ``vllm`` policy's learner copy gets the same
treatment; the engine receives merged weights.

Merged weights. Exports and weight syncs hand out the model under its original tensor names with each
adapter folded in (``W + B @ A * alpha / r``, :func:`plain_state_dict`), so an export is an ordinary
model directory and the vLLM engine reloads ordinary weights. Checkpoints keep the adapters
themselves (a resume re-applies LoRA before loading them).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from toolgym.errors import ConfigError, MissingDependencyError
from toolgym.training.config.train import LoraConfig

if TYPE_CHECKING:
    import torch

__all__ = [
    "apply_lora",
    "base_weights_trainable",
    "is_lora",
    "load_plain_state_dict",
    "plain_state_dict",
    "trainable_count",
]

_ADAPTER = "default"


def _require_peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise MissingDependencyError("peft", "lora", "LoRA training (train.lora.rank > 0)") from exc
    return peft


def apply_lora(model: torch.nn.Module, settings: LoraConfig, *, seed: int = 0) -> torch.nn.Module:
    """Inject LoRA adapters into ``model`` in place and freeze everything else; returns ``model``.

    Raises:
        ConfigError: the model has none of the target layers, or is not a module peft can adapt.
        MissingDependencyError: ``peft`` is not installed (extra ``toolgym[lora]``).
    """
    import torch

    if not settings.enabled:
        return model
    peft = _require_peft()
    linear = sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    )
    missing = [t for t in settings.targets if t not in linear]
    if missing or not linear:
        raise ConfigError(
            f"LoRA cannot adapt {type(model).__name__}: it has no Linear layers named {missing or list(settings.targets)}"
            f" (its Linear layers: {', '.join(linear) or 'none'}); set train.lora.targets to some of them, "
            "or train.lora.rank = 0 for full fine-tuning"
        )
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.targets),
        bias="none",
    )
    model.requires_grad_(False)
    with torch.random.fork_rng():  # the adapters' init is part of the run's seed, not of global state
        torch.manual_seed(seed)
        peft.inject_adapter_in_model(config, model, adapter_name=_ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    return model


def _lora_layers(model: torch.nn.Module) -> list[tuple[str, Any]]:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def is_lora(model: torch.nn.Module) -> bool:
    """Whether LoRA adapters are injected into ``model``."""
    return bool(_lora_layers(model))


def plain_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under its original names, adapters merged in (its own ``state_dict`` without LoRA).

    The merged tensors are new (detached) tensors; nothing in the model changes.
    """
    import torch

    layers = _lora_layers(model)
    state = model.state_dict()
    if not layers:
        return state
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if "lora_" in key:
            continue
        out[key.replace(".base_layer.", ".")] = tensor
    with torch.no_grad():
        for name, layer in layers:
            weight = f"{name}.weight"
            delta = layer.get_delta_weight(_ADAPTER).to(out[weight].dtype)
            out[weight] = out[weight].detach() + delta
    return out


def load_plain_state_dict(
    model: torch.nn.Module, weights: Mapping[str, torch.Tensor]
) -> tuple[list[str], list[str]]:
    """Load weights saved under the model's original names (an export, a plain checkpoint) into
    ``model``, adapters or not: with LoRA injected, each adapted layer's weight goes to its
    ``base_layer`` (the adapters keep their values). Returns ``(missing, unexpected)`` in the original
    names, adapters left out, like ``load_state_dict(strict=False)``.
    """
    state = model.state_dict()
    mapped: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for key, tensor in weights.items():
        wrapped = key.removesuffix(".weight") + ".base_layer.weight" if key.endswith(".weight") else key
        target = wrapped if wrapped in state and wrapped != key else key
        if target in state:
            mapped[target] = tensor
        else:
            unexpected.append(key)
    model.load_state_dict(mapped, strict=False)
    missing = [k.replace(".base_layer.", ".") for k in state if "lora_" not in k and k not in mapped]
    return missing, unexpected


@contextmanager
def base_weights_trainable(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, train the model's own weights, not its adapters (a no-op without LoRA).

    The warm start is a full fine-tune whether RL then trains adapters or not, so a LoRA run starts
    from the same warm-started model as a full one: the adapters (``B = 0``: no effect yet) stay
    frozen here, every other weight trains; afterwards only the adapters train again.
    """
    if not is_lora(model):
        yield
        return
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" not in name)
    try:
        yield
    finally:
        for name, param in model.named_parameters():
            param.requires_grad_("lora_" in name)


def trainable_count(params: Sequence[torch.nn.Parameter] | Any) -> int:
    """Number of trainable scalars (a model's, or a list of parameters')."""
    import torch

    items = params.parameters() if isinstance(params, torch.nn.Module) else params
    return sum(p.numel() for p in items if p.requires_grad)
