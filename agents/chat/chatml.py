"""Hermes-style chat template on ChatML tokens, and a byte tokenizer for model-free tests.

The template renders::

    <|im_start|>system\\n{tools prompt}<|im_end|>\\n
    <|im_start|>user\\n{task}<|im_end|>\\n
    <|im_start|>assistant\\n{sampled ...<|im_end|>}\\n
    <|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n

Tool results are shown to the model as a user turn wrapped in ``<tool_response>`` tags (as Qwen and
Hermes models are trained to read them; the tags come from :func:`toolgym.parsing.format_tool_response`,
so scripted baselines can read them back with :func:`toolgym.parsing.tool_responses`); consecutive
tool messages share one user turn.

NOTE (token drift): each rendered chunk is tokenised once, on its own, and appended. The assistant's
``<|im_end|>`` is *sampled* (mask 1); the newline after it belongs to the next chunk (mask 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from toolgym.core import Message
from toolgym.parsing import format_tool_response

__all__ = ["ByteTokenizer", "ChatMLTemplate", "TextTokenizer"]

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


class TextTokenizer(Protocol):
    """The little a template needs from a tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ChatMLTemplate:
    """Renders messages to text chunks; tokenisation is the caller's."""

    def start(self, messages: Sequence[Message]) -> str:
        return "".join(self._turns(messages)) + f"{IM_START}assistant\n"

    def continuation(self, messages: Sequence[Message], *, close_turn: bool = False) -> str:
        head = IM_END if close_turn else ""
        return head + "\n" + "".join(self._turns(messages)) + f"{IM_START}assistant\n"

    @staticmethod
    def _turns(messages: Sequence[Message]) -> list[str]:
        turns: list[str] = []
        pending_tool: list[str] = []

        def flush() -> None:
            if pending_tool:
                turns.append(f"{IM_START}user\n" + "\n".join(pending_tool) + f"{IM_END}\n")
                pending_tool.clear()

        for message in messages:
            if message["role"] == "tool":
                pending_tool.append(format_tool_response(message["content"]))
                continue
            if message["role"] == "user" and pending_tool:
                # A note that follows tool results (e.g. the scaffold's budget) joins their user turn.
                pending_tool.append(message["content"])
                flush()
                continue
            flush()
            turns.append(f"{IM_START}{message['role']}\n{message['content']}{IM_END}\n")
        flush()
        return turns


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, plus ``<|im_start|>`` = 256 and ``<|im_end|>`` = 257.

    A real tokenizer for tests that must not load a model: encode/decode round-trip exactly.
    """

    specials = {IM_START: 256, IM_END: 257}
    eos_token_id = 257

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            for token, token_id in self.specials.items():
                if text.startswith(token, i):
                    ids.append(token_id)
                    i += len(token)
                    break
            else:
                j = min((p for p in (text.find(s, i) for s in self.specials) if p != -1), default=len(text))
                ids.extend(text[i:j].encode("utf-8"))
                i = j
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        inverse = {v: k for k, v in self.specials.items()}
        out: list[str] = []
        buf = bytearray()
        for token_id in ids:
            if token_id in inverse:
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
                out.append(inverse[token_id])
            else:
                buf.append(token_id)
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)
