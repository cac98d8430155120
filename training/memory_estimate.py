"""What a run's config will take in memory, told at start-up: the learner's peak and the sampler's share.

The learner's peak is the sum of what one forward/backward pass holds at once:

- the model's weights, and a reference copy when ``train.loss.kl_coef > 0``;
- gradients and AdamW's two moments for every trainable parameter (fp32, like the learner's weights);
- activations: what autograd keeps for the backward pass, for the most tokens a pass may take: the
  token budget (``train.batching.micro_batch_tokens``, else ``micro_batch`` x the longest
  ``max_total_tokens``) plus, with prefix sharing, one shared prefix (at most one sequence) whose graph
  is kept until the group's backward pass. The bytes per token are *measured* on the model itself: one
  short forward pass with grad, counting the tensors autograd saves (weights excluded), so an
  architecture, LoRA or attention kernel is accounted for as it runs. With
  ``train.batching.checkpoint_layers`` the probe runs checkpointed (the layers' inputs), plus one
  layer's share of the plain probe (the layer being recomputed in the backward pass);
- scoring the sampled tokens: the logits of the pass's rows, their log-softmax and their gradient, each
  ``rows x vocabulary`` fp32, capped by :mod:`~toolgym.training.learn.chosen_logprobs`'s chunks when the
  model has a plain output layer (and not at all otherwise).

The sampler's share: a vLLM engine's copy of the weights in its dtype and its KV cache
(``policy.kv_cache_gib``; 1 GiB on CPU by default, ``gpu_memory_utilization`` of the card on a GPU, of
which the weights are part); an ``hf`` policy samples from the learner's own model, adding its prefix
cache (1 GiB at most). Not counted: the Python runtime and imported libraries (about 1 GB on CPU),
the environments (a search index), checkpoints being written, the held-out engine when a fresh one is
started. ``bench/memory.py`` compares this estimate with the measured peak of a learner step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from toolgym.errors import RunStopped
from toolgym.training.config import RunConfig
from toolgym.training.config.policy import EngineConfig, HFPolicyConfig
from toolgym.training.learn.chosen_logprobs import CHUNK_BYTES, WHOLE_BYTES, lm_parts
from toolgym.training.learn.layer_checkpoint import checkpointed_layers, decoder_layers

__all__ = ["MemoryEstimate", "activation_bytes_per_token", "estimate_memory", "out_of_memory", "pass_budget"]

GiB = 1 << 30
#: Tokens of the probe that measures activations per token (the count is linear in it: tested).
PROBE_TOKENS = 32
#: An ``hf`` policy's prefix cache bound (HFPolicy's default ``prefix_cache_bytes``).
HF_PREFIX_CACHE = 1 << 30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes by part: the learner's peak (``learner``) and the sampler's own memory (``sampler``)."""

    learner: dict[str, int] = field(default_factory=dict)
    sampler: dict[str, int] = field(default_factory=dict)
    tokens: int = 0  # the most tokens one learner pass takes (activations are counted for these)
    device: str = "cpu"

    @property
    def learner_bytes(self) -> int:
        return sum(self.learner.values())

    @property
    def sampler_bytes(self) -> int:
        return sum(self.sampler.values())

    def describe(self) -> str:
        """One line for the run's log."""

        def parts(table: dict[str, int]) -> str:
            return ", ".join(f"{name} {_gb(size)}" for name, size in table.items() if size)

        line = (
            f"memory estimate on {self.device}: learner at most {_gb(self.learner_bytes)} GB per process "
            f"({parts(self.learner)}; activations for {self.tokens:,} tokens a pass, the token budget and "
            "one shared prefix: shorter passes take less)"
        )
        if self.sampler:
            line += f"; sampler {_gb(self.sampler_bytes)} GB ({parts(self.sampler)})"
        return line + "; the Python runtime and the environments come on top"


def _gb(size: int) -> str:
    return f"{size / 1e9:.2f}"


def activation_bytes_per_token(
    model: torch.nn.Module, tokens: int = PROBE_TOKENS, *, checkpoint: bool = False
) -> int:
    """Bytes autograd keeps per token of a forward pass with grad (weights excluded), measured; with
    ``checkpoint``, of the pass with checkpointed decoder layers.

    With a plain output layer the pass stops at the decoder's hidden states (the learner scores from
    them, :mod:`~toolgym.training.learn.chosen_logprobs`); otherwise the model's logits are part of it.
    """
    device = next(model.parameters()).device
    ids = torch.zeros((1, tokens), dtype=torch.long, device=device)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    parts = lm_parts(model)
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
    with torch.enable_grad(), hooks, checkpointed_layers(model, checkpoint):
        out = (
            parts[0](input_ids=ids, use_cache=False)
            if parts is not None
            else model(input_ids=ids, use_cache=False)
        )
        del out  # the graph and every saved tensor go with it; no backward pass runs
    return -(-sum(saved.values()) // tokens)


def pass_budget(config: RunConfig) -> int:
    """The most tokens one learner pass may take: ``train.batching.micro_batch_tokens``, else
    ``micro_batch`` sequences of the longest ``max_total_tokens``."""
    batching = config.train.batching
    return batching.micro_batch_tokens or batching.micro_batch * max(
        env.max_total_tokens for env in config.envs
    )


def out_of_memory(
    config: RunConfig, step: int, exc: BaseException, estimate: MemoryEstimate | None
) -> RunStopped:
    """The stop for a learner whose device ran out of memory in ``step``: what to lower, and that a
    rerun resumes."""
    batching = config.train.batching
    budget = (
        f"now {batching.micro_batch_tokens}"
        if batching.micro_batch_tokens
        else f"now 0: passes of up to micro_batch x max_total_tokens = {pass_budget(config)}"
    )
    said = "" if estimate is None else f"; at start it was estimated at {estimate.describe()}"
    first = str(exc).splitlines()[0] if str(exc) else "no detail"
    return RunStopped(
        f"the learner ran out of memory on {config.policy.learner_device} in step {step} ({first}): lower "
        f"train.batching.micro_batch_tokens ({budget} tokens a pass) or train.batching.micro_batch (now "
        f"{batching.micro_batch}), or set train.batching.checkpoint_layers = true{said}. Rerunning the same "
        "command resumes from the last checkpoint (the steps after it run again)"
    )


def estimate_memory(
    config: RunConfig, model: torch.nn.Module, *, per_token: int | None = None
) -> MemoryEstimate:
    """The config's memory with ``model`` as the learner's model (see the module docstring).

    ``per_token``: activation bytes per token of a plain pass when already known (else measured on
    ``model``).
    """
    tc = config.train
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    longest = max(env.max_total_tokens for env in config.envs)
    budget = pass_budget(config)
    prefix = longest if tc.batching.share_prefix else 0  # its context pass is never checkpointed
    tokens = budget + prefix
    if per_token is None:
        per_token = activation_bytes_per_token(model)
    pass_rate = per_token
    layers = len(decoder_layers(model))
    if tc.batching.checkpoint_layers and layers:
        pass_rate = activation_bytes_per_token(model, checkpoint=True) + per_token // layers
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
    logits = tokens * vocab * 4
    plain_head = lm_parts(model) is not None
    if plain_head and logits > WHOLE_BYTES:
        logits = CHUNK_BYTES  # chunked: the logits of a chunk at a time (recomputed in the backward pass)
    learner = {
        "weights": weights,
        "reference": weights if tc.loss.kl_coef > 0 else 0,
        "gradients": trainable * 4,
        "AdamW": trainable * 8,
        "activations": budget * pass_rate + prefix * per_token,
        # the logits, their log-softmax and their gradient (the probe counted a model's own logits)
        "scoring": (3 if plain_head else 2) * logits,
    }
    sampler: dict[str, int] = {}
    pc = config.policy
    device = str(pc.learner_device)
    if isinstance(pc, EngineConfig):
        served = 2 if pc.dtype in ("bfloat16", "float16") else 4
        engine_weights = sum(p.numel() for p in params) * served
        if pc.kv_cache_gib:
            kv = int(pc.kv_cache_gib * GiB)
        elif device.startswith("cuda") and torch.cuda.is_available():
            kv = max(
                int(
                    pc.gpu_memory_utilization
                    * torch.cuda.get_device_properties(torch.device(device)).total_memory
                )
                - engine_weights,
                0,
            )
        else:
            kv = GiB
        sampler = {"engine weights": engine_weights, "KV cache": kv}
    elif isinstance(pc, HFPolicyConfig):
        sampler = {"prefix cache": HF_PREFIX_CACHE}
    return MemoryEstimate(learner=learner, sampler=sampler, tokens=tokens, device=device)
