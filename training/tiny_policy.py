"""A randomly initialised byte-level causal LM as a policy: real torch, seconds per training step.

It exists so the trainer's whole path (sampling, logprobs, loss, optimizer, checkpoints) can be tested
and benchmarked on any CPU without loading SmolLM2. It pairs a small Llama (vocabulary 258) with
:class:`~toolgym.agents.chat.chatml.ByteTokenizer`, so encode/decode round-trip exactly.

NOTE (seeding): each turn samples from a generator seeded by ``(sampling.seed, len(token_ids))``, so
an episode's samples depend only on its seed and the weights, not on which other episodes run
concurrently; that is what makes a resumed run reproduce an uninterrupted one.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Literal

import torch

from toolgym.agents.chat.chatml import ByteTokenizer
from toolgym.agents.policies.base import ChatPolicy
from toolgym.core import Completion, SamplingParams

__all__ = ["TinyPolicy", "tiny_model"]


def tiny_model(*, hidden: int = 64, layers: int = 2, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised Llama with the byte vocabulary (seeded, so every run builds the same one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=258,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


class TinyPolicy(ChatPolicy):
    """Token-in/token-out sampling from a torch causal LM with a byte tokenizer.

    ``model`` is shared with the learner (weights updated in place); ``policy_version`` is bumped by
    the trainer after each optimizer step and stamped on every completion.
    """

    name = "tiny"

    def __init__(
        self, model: torch.nn.Module | None = None, *, hidden: int = 64, layers: int = 2, seed: int = 0
    ) -> None:
        super().__init__(ByteTokenizer())
        self.model = model if model is not None else tiny_model(hidden=hidden, layers=layers, seed=seed)
        self.eos_token_id = ByteTokenizer.eos_token_id
        self.policy_version = 0
        self.weights_lock = threading.RLock()

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        return await asyncio.to_thread(self.generate_sync, list(token_ids), sampling)

    def generate_sync(self, token_ids: list[int], sampling: SamplingParams) -> Completion:
        with self.weights_lock, torch.no_grad():
            return self._generate(token_ids, sampling)

    def _generate(self, token_ids: list[int], sampling: SamplingParams) -> Completion:
        version = self.policy_version
        gen = torch.Generator().manual_seed(hash((sampling.seed or 0, len(token_ids))) & 0x7FFF_FFFF)
        ids = torch.tensor([token_ids], dtype=torch.long)
        out_ids: list[int] = []
        out_lps: list[float] = []
        past = None
        finish: Literal["stop", "length"] = "length"
        for _ in range(sampling.max_tokens):
            out = self.model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            if sampling.temperature == 0:  # greedy; the logprob recorded is the model's own (T = 1)
                logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                token = int(torch.argmax(logp).item())
            else:
                logp = torch.log_softmax(out.logits[0, -1].float() / sampling.temperature, dim=-1)
                token = int(torch.multinomial(logp.exp(), 1, generator=gen).item())
            out_ids.append(token)
            out_lps.append(float(logp[token]))
            if token == self.eos_token_id:
                finish = "stop"
                break
            ids = torch.tensor([[token]], dtype=torch.long)
        text_ids = out_ids[:-1] if finish == "stop" else out_ids
        return Completion(
            token_ids=tuple(out_ids),
            logprobs=tuple(out_lps),
            text=self.tokenizer.decode(text_ids),
            finish_reason=finish,
            policy_version=version,
        )
