"""The policy a training run trains: built from ``config.policy``, checked, and the learner's copy.

:func:`build_policy` turns the ``[policy]`` table into a policy (``hf``/``tiny`` sample from the very
module the learner trains; ``vllm`` serves its own copy in an engine process);
:func:`learner_model` loads that copy's fp32 transformers twin for the learner;
:func:`require_trainable` refuses, with what is missing, a policy the trainer cannot train.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from toolgym.agents.policies.models import require_hf
from toolgym.core import ServedPolicy, TrainablePolicy
from toolgym.errors import ConfigError
from toolgym.training.config import (
    RunConfig,
    TinyPolicyConfig,
    VLLMPolicyConfig,
    VLLMServerPolicyConfig,
)

__all__ = ["Closable", "build_policy", "learner_model", "require_trainable"]


def build_policy(config: RunConfig, log_file: Path | None = None) -> TrainablePolicy | ServedPolicy:
    """The policy named by ``config.policy``.

    ``hf`` and ``tiny`` expose the trained module as ``.model``; ``vllm`` starts an engine (its own
    process) and exposes ``.model_dir``, from which the trainer loads the learner's copy; its whole log
    goes to ``log_file`` (the run's ``engine.log``), its warnings to the console.
    """
    pc = config.policy
    if pc.threads:
        torch.set_num_threads(pc.threads)
    if isinstance(pc, TinyPolicyConfig):
        from toolgym.training.tiny_policy import TinyPolicy

        return TinyPolicy(hidden=pc.hidden, layers=pc.layers, seed=config.train.seed)
    if isinstance(pc, VLLMServerPolicyConfig):
        from toolgym.agents.policies.vllm_server import VLLMServerPolicy

        return VLLMServerPolicy(
            pc.model or None,
            url=pc.url or None,
            api_key_env=pc.api_key_env,
            dtype=pc.dtype,
            max_model_len=pc.max_model_len,
            seed=config.train.seed,
            kv_cache_gib=pc.kv_cache_gib or None,
            cpu_reserved=pc.cpu_reserved if pc.cpu_reserved >= 0 else None,
            chat_format=pc.chat_format,
            thinking_budget=pc.thinking_budget or None,
        )
    if isinstance(pc, VLLMPolicyConfig):
        from toolgym.agents.policies.vllm import VLLMPolicy

        return VLLMPolicy(
            pc.model or None,
            dtype=pc.dtype,
            max_model_len=pc.max_model_len,
            seed=config.train.seed,
            kv_cache_gib=pc.kv_cache_gib or None,
            gpu_memory_utilization=pc.gpu_memory_utilization,
            engine_kwargs=dict(pc.engine_kwargs),
            cpu_reserved=pc.cpu_reserved if pc.cpu_reserved >= 0 else None,
            chat_format=pc.chat_format,
            thinking_budget=pc.thinking_budget or None,
            log_file=log_file,
        )
    from toolgym.agents.policies.hf import HFPolicy

    if pc.learner_device != "cpu" and not torch.cuda.is_available():
        raise ConfigError(f"policy.learner_device = {pc.learner_device!r} but torch sees no CUDA device")
    return HFPolicy(
        pc.model or None,
        device=pc.learner_device,
        dtype=pc.dtype,
        threads=pc.threads or None,
        max_batch=pc.max_batch,
        max_batch_tokens=pc.max_batch_tokens,
        seed=config.train.seed,
        chat_format=pc.chat_format,
        thinking_budget=pc.thinking_budget or None,
        batching=pc.batching,
        attn_implementation=pc.attn_implementation or None,
    )


def learner_model(model_dir: str | Path, device: str = "cpu") -> torch.nn.Module:
    """The learner's own fp32 transformers model of a served checkpoint (the engine keeps another copy).

    fp32 whatever the serving dtype: the optimizer needs full-precision master weights; the engine
    casts them to its dtype when it reloads. Loaded in eval mode (no dropout), like the engine.
    """

    _, transformers = require_hf("training with policy.kind = 'vllm'")
    if device != "cpu" and not torch.cuda.is_available():
        raise ConfigError(f"policy.learner_device = {device!r} but torch sees no CUDA device")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.to(device).eval()


@runtime_checkable
class Closable(Protocol):
    """A policy that holds resources (an engine process, a thread) until closed."""

    def close(self) -> None: ...


def require_trainable(policy: object) -> None:
    """Refuse a policy the trainer cannot train, with what it lacks (a :class:`ConfigError`)."""
    if isinstance(policy, TrainablePolicy | ServedPolicy):
        if policy.token_exact:
            return
        reason = "its token ids and logprobs are not the ones it sampled (token_exact = False)"
    else:
        reason = (
            "it is neither a TrainablePolicy (model, weights_lock, policy_version, token_exact) nor a "
            "ServedPolicy (model_dir, policy_version, token_exact, close); a policy without exact "
            "sampled tokens (token_exact = False, e.g. HTTPPolicy) never is"
        )
    raise ConfigError(
        f"{type(policy).__name__} cannot be trained: {reason}. Train with policy.kind = 'hf' or 'vllm'; "
        "use this policy for evaluation only"
    )
