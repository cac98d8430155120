"""Log-probabilities of the chosen tokens without a ``[rows, vocabulary]`` tensor per micro-batch.

The learner needs one number per trained token: ``log p(x_t | x_<t)`` of the token that was sampled
(and, where it is logged, the entropy of that distribution). Computing it as a log-softmax over the
model's logits holds the logits, their log-softmax and, in the backward pass, their gradients: each
``rows x vocabulary`` floats (four 1,500-token sequences of a 49,152-token vocabulary: 1.2 GB each).

For a causal LM whose logits are exactly ``hidden @ W.T`` (:func:`lm_parts`: the common decoder-only
architectures, an output layer without bias, softcapping or scaling), :func:`chosen_logprobs` takes
the decoder's hidden states and the output matrix instead and, when the rows' logits would take more
than :data:`WHOLE_BYTES`, works through the rows in chunks of about :data:`CHUNK_BYTES` of logits:
``logp = logit[x] - logsumexp(logits)``, the log-sum-exp kept per row. The backward pass recomputes
each chunk's logits (one more output-layer product per chunk) and forms
``(onehot(x) - softmax) * grad / T`` there, so memory is bounded by a chunk, never the micro-batch. Values and gradients equal the log-softmax path's up to float rounding (tested); any
other model (the tiny policy, an output layer LoRA wraps, softcapped logits, a model FSDP2 shards)
keeps the log-softmax over its logits (:class:`Logits`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "CHUNK_BYTES",
    "WHOLE_BYTES",
    "Hidden",
    "distribution_entropy",
    "Logits",
    "chosen_logprobs",
    "lm_parts",
    "run_rows",
]

#: Logits computed at once: ``rows x vocabulary`` fp32 floats per chunk (the chunk has at least a row).
CHUNK_BYTES = 64 << 20
#: Rows whose logits fit in this many bytes are scored whole, through plain autograd: chunking them
#: would save little memory and cost the backward pass's recomputation (5 % of a learn-config step).
WHOLE_BYTES = 256 << 20
#: ``config.model_type`` of the architectures whose logits are the last hidden state times the output
#: matrix, nothing else (no softcapping, no logit scale).
PLAIN_HEAD_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo2"})


@dataclass
class Hidden:
    """Rows to score as hidden states ``[B, K, H]`` and the output matrix ``[V, H]``."""

    states: torch.Tensor
    weight: torch.Tensor

    def first(self, rows: int) -> Hidden:
        """The first ``rows`` positions of every sequence."""
        return Hidden(self.states[:, :rows], self.weight)


@dataclass
class Logits:
    """Rows to score as the model's own logits ``[B, K, V]`` (a model without a plain output layer)."""

    logits: torch.Tensor

    def first(self, rows: int) -> Logits:
        """The first ``rows`` positions of every sequence."""
        return Logits(self.logits[:, :rows])


def lm_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.Tensor] | None:
    """``(decoder, output matrix)`` of a causal LM whose logits are ``decoder(...) @ W.T``, else ``None``."""
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    get_decoder = getattr(model, "get_decoder", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD_TYPES or get_decoder is None:
        return None
    if type(head) is not torch.nn.Linear or head.bias is not None:  # e.g. a LoRA layer wrapping it
        return None
    if _sharded(model):
        return None
    return get_decoder(), head.weight


def _sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 shards the model: it must be called at its root (the first call sets the sharded
    modules up as one tree) and its parameters are distributed tensors, so it keeps its logits."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without distributed support
        return False
    return any(isinstance(module, FSDPModule) for module in model.modules())


def run_rows(
    model: torch.nn.Module, keep: torch.Tensor | None = None, **kwargs: Any
) -> tuple[Hidden | Logits, Any]:
    """Run ``model`` (``kwargs``: its call's arguments) and return the rows ``keep`` (all rows when
    ``None``) to score, and the key/value cache when ``use_cache``."""
    parts = lm_parts(model)
    if parts is None:
        if keep is not None:
            kwargs["logits_to_keep"] = keep
        out = model(**kwargs)
        return Logits(out.logits), getattr(out, "past_key_values", None)
    decoder, weight = parts
    out = decoder(**kwargs)
    states = out.last_hidden_state
    return Hidden(states if keep is None else states[:, keep], weight), getattr(out, "past_key_values", None)


def chosen_logprobs(
    rows: Hidden | Logits, targets: torch.Tensor, *, temperature: float = 1.0, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, K]`` fp32 ``log p(targets)`` of the rows' distributions at ``temperature`` and, with
    ``entropy``, each row's entropy (no gradient)."""
    if isinstance(rows, Hidden) and rows.states[..., 0].numel() * rows.weight.shape[0] * 4 <= WHOLE_BYTES:
        rows = Logits(rows.states @ rows.weight.T)
    if isinstance(rows, Logits):
        logits = rows.logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        log_probs = torch.log_softmax(logits, dim=-1)
        picked = torch.gather(log_probs, -1, targets[..., None]).squeeze(-1)
        if not entropy:
            return picked, None
        with torch.no_grad():
            return picked, distribution_entropy(log_probs)
    batch, k, width = rows.states.shape
    flat = rows.states.reshape(batch * k, width)
    picked, ent = _Chosen.apply(flat, rows.weight, targets.reshape(-1), float(temperature), entropy)
    return picked.view(batch, k), ent.view(batch, k) if entropy else None


def distribution_entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """Entropy of each row of a ``[..., V]`` log-softmax (nats), over the last dimension."""
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def _chunk_rows(vocab: int) -> int:
    """Rows per chunk: about :data:`CHUNK_BYTES` of fp32 logits, at least one."""
    return max(1, CHUNK_BYTES // (4 * vocab))


class _Chosen(torch.autograd.Function):
    """``logit[x] - logsumexp(logits)`` chunk by chunk; the backward pass recomputes each chunk."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, vocab = hidden.shape[0], weight.shape[0]
        w = weight.float()
        picked = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(picked)
        ent = torch.zeros(rows if entropy else 0, dtype=torch.float32, device=hidden.device)
        step = _chunk_rows(vocab)
        for start in range(0, rows, step):
            end = start + step
            logits = hidden[start:end].float() @ w.T
            if temperature != 1.0:
                logits = logits / temperature
            norm = torch.logsumexp(logits, dim=-1)
            lse[start:end] = norm
            picked[start:end] = logits.gather(-1, targets[start:end, None]).squeeze(-1) - norm
            if entropy:
                probs = torch.exp(logits - norm[:, None])
                ent[start:end] = norm - (probs * logits).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(ent)
        return picked, ent

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _grad_ent: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, targets, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        rows, vocab = hidden.shape[0], weight.shape[0]
        w = weight.float()
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        )
        step = _chunk_rows(vocab)
        for start in range(0, rows, step):
            end = start + step
            h = hidden[start:end].float()
            logits = h @ w.T
            if ctx.temperature != 1.0:
                logits = logits / ctx.temperature
            g = grad[start:end].float()
            # d(logit[x] - logsumexp)/d(logit) = onehot(x) - softmax; the temperature divides once more
            d_logits = torch.exp(logits - lse[start:end, None]).mul_(-g[:, None])
            d_logits.scatter_add_(-1, targets[start:end, None], g[:, None])
            if ctx.temperature != 1.0:
                d_logits.div_(ctx.temperature)
            if grad_hidden is not None:
                grad_hidden[start:end] = (d_logits @ w).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.add_(d_logits.T @ h)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None,
            None,
            None,
        )
