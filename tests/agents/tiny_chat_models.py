"""Tiny randomly initialised chat models of several architectures, built locally (no downloads).

Each tokenizer is the shipped SmolLM2 tokenizer plus a format's special tokens and a chat template
written for these tests in that format's markers (so ``chat_format="auto"`` reads it as a real model of
the family would be read). Each model is a one-layer, 16-wide network of the family's architecture.

:class:`ForcedPolicy` is the real :class:`~toolgym.agents.policies.hf.HFPolicy` (prefill, KV cache,
stop tokens, logprobs of the distribution each token is drawn from) whose draws follow scripted token
ids while a script is queued, one script per request, and sample freely after: teacher forcing, so a
random model writes well-formed (and malformed) calls and the episode's tokens are known.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch
import transformers

from toolgym import FunctionTool, Score, Task, ToolEnv
from toolgym.agents.policies.hf import HFPolicy
from toolgym.agents.policies.hf_decode import ContinuousDecoder
from toolgym.agents.policies.models import smollm2_path
from toolgym.core import SamplingParams, Trajectory
from toolgym.parsing import format_tool_call

LLAMA3 = (
    "{{- bos_token -}}{%- for m in messages -%}{{- '<|start_header_id|>' + ('ipython' if m['role'] == 'tool' "
    "else m['role']) + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)
CHATML = (
    "{#- tool calls: <tool_call> -#}{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + "
    "m['content'] + '<|im_end|>\\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
#: ChatML that, like Qwen3's, keeps an assistant turn's <think> block only after the latest real user
#: message (a user turn that is only tool responses does not count) and normalises its whitespace.
QWEN3 = (
    "{#- tool calls: <tool_call> -#}{%- set ns = namespace(last=-1) -%}{%- for m in messages -%}"
    "{%- if m['role'] == 'user' and not (m['content'].startswith('<tool_response>') and "
    "m['content'].endswith('</tool_response>')) -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'assistant' and '</think>' in m['content'] -%}"
    "{%- set thought = m['content'].split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = m['content'].split('</think>')[-1].lstrip('\\n') -%}"
    "{%- if loop.index0 > ns.last -%}{%- set content = '<think>\\n' + thought + '\\n</think>\\n\\n' + content -%}"
    "{%- endif -%}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
MISTRAL = (
    "{{- bos_token -}}{%- for m in messages -%}{%- if m['role'] == 'system' -%}{{- '[SYSTEM_PROMPT]' + "
    "m['content'] + '[/SYSTEM_PROMPT]' -}}{%- elif m['role'] == 'user' -%}{{- '[INST]' + m['content'] + "
    "'[/INST]' -}}{%- elif m['role'] == 'tool' -%}{{- '[TOOL_RESULTS]' + m['content'] + '[/TOOL_RESULTS]' -}}"
    "{%- else -%}{{- m['content'] + eos_token -}}{%- endif -%}{%- endfor -%}"
)
#: Gemma-like: no system role (it raises), ``model`` turns, contents trimmed.
GEMMA = (
    "{{- bos_token -}}{%- for m in messages -%}{%- if m['role'] == 'system' -%}"
    "{{- raise_exception('System role not supported') -}}{%- endif -%}{{- '<start_of_turn>' + ('model' if "
    "m['role'] == 'assistant' else m['role']) + '\\n' + m['content'] | trim + '<end_of_turn>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)
HARMONY = (
    "{%- for m in messages -%}{{- '<|start|>' + m['role'] + '<|channel|>final<|message|>' + m['content'] + "
    "'<|end|>' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)

#: kind -> (config class name, named special tokens, other special tokens, chat template)
KINDS: dict[str, tuple[str, dict[str, str], list[str], str]] = {
    "llama": (
        "LlamaConfig",
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"],
        LLAMA3,
    ),
    "qwen2": ("Qwen2Config", {}, [], CHATML),
    "qwen3": ("Qwen3Config", {}, ["<think>", "</think>"], QWEN3),
    "mistral": (
        "MistralConfig",
        {"bos_token": "<s>", "eos_token": "</s>"},
        [
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[ARGS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
            "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]",
        ],
        MISTRAL,
    ),
    "gemma": (
        "GemmaConfig",
        {"bos_token": "<bos>", "eos_token": "<eos>"},
        ["<start_of_turn>", "<end_of_turn>"],
        GEMMA,
    ),
    "gpt-oss": (
        "GptOssConfig",
        {"eos_token": "<|return|>"},
        ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>"],
        HARMONY,
    ),
}


@cache
def _smollm2_files() -> Path:
    return smollm2_path()


def tokenizer_for(kind: str, template: str | None = None) -> Any:
    """SmolLM2's tokenizer with the ``kind``'s special tokens and chat template (or ``template``)."""
    _, named, others, default = KINDS[kind]
    tokenizer = transformers.AutoTokenizer.from_pretrained(_smollm2_files())
    if named:
        tokenizer.add_special_tokens(named)
    if others:
        tokenizer.add_tokens(others, special_tokens=True)
    tokenizer.chat_template = default if template is None else template
    return tokenizer


def build_model_dir(kind: str, path: Path, *, template: str | None = None, seed: int = 0) -> Path:
    """A tiny random ``kind`` model and its tokenizer saved in ``path`` (a Hugging Face model directory)."""
    config_name, *_ = KINDS[kind]
    tokenizer = tokenizer_for(kind, template)
    size = dict(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    if kind == "gpt-oss":
        size.update(num_local_experts=2, num_experts_per_tok=1, layer_types=["full_attention"])
    if kind == "qwen3" or kind == "qwen2":
        size.update(layer_types=["full_attention"], use_sliding_window=False)
    config = getattr(transformers, config_name)(**size)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class ForcedPolicy(HFPolicy):
    """HFPolicy whose draws follow queued scripts (see the module docstring)."""

    def __init__(self, model: Path, **kwargs: Any) -> None:
        super().__init__(model, seed=0, threads=1, **kwargs)
        self.scripts: list[list[int]] = []

    def script(self, *turns: str) -> None:
        """Queue each text as one request's draws, ending with the format's end-of-turn token (as
        :meth:`complete` writes a scripted turn)."""
        for text in turns:
            self.scripts.append(list(self.complete(text, SamplingParams(max_tokens=10**6)).token_ids))

    def script_ids(self, *ids: Sequence[int]) -> None:
        """Queue raw draws (no end-of-turn token added)."""
        self.scripts += [list(i) for i in ids]

    def _new_decoder(self, cls: Any = None, **extra: Any) -> Any:
        return super()._new_decoder(ForcedDecoder, forced=self._forced)

    def _sample_row(self, row: Any, logits: Any) -> int:
        if self._forced(row, logits):
            return row.ids[-1]
        return super()._sample_row(row, logits)

    def _forced(self, row: Any, logits: Any) -> bool:
        """Record the next scripted token of ``row`` (its script taken at its first draw); ``False``
        when the row has no script."""
        if not hasattr(row, "script"):
            row.script = self.scripts.pop(0) if self.scripts else None
        if row.script is None:
            return False
        sampling = row.request.sampling
        token = row.script[len(row.ids)]
        scaled = logits if sampling.temperature == 0 else logits / sampling.temperature
        logprob = float(torch.log_softmax(scaled.float(), dim=-1)[token])
        row.record(token, logprob, self.stop_ids, self.tokenizer.decode)
        if row.finish is None and len(row.ids) == len(row.script):
            row.finish = "length"
        return True


class ForcedDecoder(ContinuousDecoder):
    """The continuous scheduler's decoder with :meth:`ForcedPolicy._forced` draws for scripted rows."""

    def __init__(self, *args: Any, forced: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.forced = forced

    def draw(self, rows: list[Any], logits: Any) -> list[Any]:
        free = [i for i, row in enumerate(rows) if not self.forced(row, logits[i])]
        done = [row for row in rows if row.finish is not None]
        if free:
            done += super().draw([rows[i] for i in free], logits[free])
        return done


def rescored(policy: HFPolicy, trajectory: Trajectory) -> list[tuple[float, float]]:
    """(behaviour, recomputed) logprob of every sampled token of every segment: the model run once over
    each segment's whole sequence, as a learner does (temperature 1)."""
    pairs = []
    for view in trajectory.segment_views():
        ids = torch.tensor([list(view.token_ids)])
        with torch.no_grad():
            logp = torch.log_softmax(policy.model(input_ids=ids).logits[0].float(), dim=-1)
        for i, (token, mask) in enumerate(zip(view.token_ids, view.loss_mask, strict=True)):
            if mask:
                pairs.append((view.logprobs[i], float(logp[i - 1, token])))
    return pairs


SEARCH = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


class LookupEnv(ToolEnv):
    """One question, a search tool that knows the answer, an answer tool; a worked example."""

    def __init__(self, max_turns: int = 4) -> None:
        super().__init__(max_turns=max_turns)
        self.tasks = [Task("x", "What is x?", "42")]

        class Exact:
            def score(self, task: Task, answer: object, trajectory: object) -> Score:
                return Score(float(answer == task.reference))

        self.verifier = Exact()

    async def episode_tools(self, task: Task) -> list[FunctionTool]:
        return [
            FunctionTool("search", "Look something up.", SEARCH, fn=lambda query: f"{query}: x is 42"),
            FunctionTool("answer", "Give the answer. Ends the episode.", ANSWER, terminal=True),
        ]

    def demonstration(self, allowed_tools: Sequence[str]) -> list[dict[str, str]]:
        return [
            {"role": "user", "content": "What is y?"},
            {"role": "assistant", "content": format_tool_call("search", {"query": "y"})},
        ]
