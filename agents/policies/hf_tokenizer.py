"""A Hugging Face tokenizer as toolgym's text tokenizer, and the tokenizer-and-format pair of a checkpoint.

:class:`HFTokenizer` is what every policy over a Hugging Face checkpoint renders and decodes with
(transformers, the in-process vLLM engine, a vLLM server); :func:`chat_tokenizer` loads a model
directory's tokenizer and resolves its chat format (:mod:`toolgym.agents.chat.formats`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from toolgym.agents.chat.chatml import IM_END, IM_START
from toolgym.agents.chat.formats import ChatFormat, resolve_chat_format
from toolgym.agents.policies.models import require_hf
from toolgym.errors import ConfigError

__all__ = ["HFTokenizer", "chat_tokenizer"]


class HFTokenizer:
    """A Hugging Face tokenizer seen through :class:`~toolgym.agents.chat.chatml.TextTokenizer`.

    ``encode`` adds no BOS/EOS (the chat format writes every special token itself) and maps special
    tokens to their single ids; ``decode`` keeps special tokens and does no clean-up, so
    ``decode(encode(text)) == text`` for ordinary text. ``stop_tokens`` are the chat format's
    end-of-turn tokens (default ChatML's ``<|im_end|>``); each must be one token.
    """

    def __init__(self, hf_tokenizer: Any, stop_tokens: Sequence[str] = (IM_END,)) -> None:
        self.hf = hf_tokenizer
        for marker in stop_tokens if tuple(stop_tokens) != (IM_END,) else (IM_START, IM_END):
            ids = hf_tokenizer.encode(marker, add_special_tokens=False)
            if len(ids) != 1:
                chatml = marker in (IM_START, IM_END)
                raise ConfigError(
                    f"the tokenizer encodes {marker!r} as {ids}, not one special token; "
                    + (
                        "toolgym's ChatML template needs a model trained on ChatML (SmolLM2, Qwen, Hermes); "
                        "other models: chat_format = 'auto'"
                        if chatml
                        else "an end-of-turn token must be one token"
                    )
                )
        start = hf_tokenizer.encode(IM_START, add_special_tokens=False)
        self.im_start_id: int | None = int(start[0]) if len(start) == 1 else None
        #: the ids that end an assistant turn, the first one the format's own
        self.stop_ids: tuple[int, ...] = tuple(hf_tokenizer.convert_tokens_to_ids(t) for t in stop_tokens)
        self.eos_token_id: int = self.stop_ids[0] if self.stop_ids else int(hf_tokenizer.eos_token_id or 0)
        self.pad_token_id: int = (
            hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else self.eos_token_id
        )

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def __len__(self) -> int:
        return len(self.hf)


def chat_tokenizer(
    model_dir: Path, chat_format: str = "auto", thinking_budget: int | None = None
) -> tuple[HFTokenizer, ChatFormat]:
    """A model directory's tokenizer, stopping at its chat format's end-of-turn tokens, and that format
    (``auto``: read off the tokenizer): what every policy over a Hugging Face checkpoint renders with."""
    _, transformers = require_hf("a Hugging Face tokenizer")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    fmt = resolve_chat_format(
        chat_format,
        hf_tokenizer,
        tokenizer=HFTokenizer(hf_tokenizer, ()),
        model_dir=model_dir,
        thinking_budget=thinking_budget,
    )
    return HFTokenizer(hf_tokenizer, fmt.stop_tokens), fmt
