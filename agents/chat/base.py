"""What every chat format is: a renderer paired with its call syntax and reasoning markers.

:class:`ChatFormat` is the base of toolgym's own renderers (:mod:`toolgym.agents.chat.formats`) and of
the model's own template (:mod:`toolgym.agents.chat.template`); the rollout reads only this contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from toolgym.agents.chat.chatml import TextTokenizer
from toolgym.core import Message

__all__ = ["THINK", "ChatFormat", "Reasoning", "single_token"]


@dataclass(frozen=True)
class Reasoning:
    """A format's reasoning block: its markers, and what ends one that the thinking budget cut.

    ``opened_by_prompt``: the generation prompt already opens the block (the model writes only its end).
    """

    open: str
    close: str
    forced_close: str
    opened_by_prompt: bool = False


THINK = Reasoning("<think>", "</think>", "</think>\n\n")


@dataclass(frozen=True)
class ChatFormat:
    """A renderer paired with its call syntax (see the module docstring); the base of every format.

    Attributes:
        name: the registry spec (``hermes``, ``llama3``, ..., ``template:hermes``): what an export records.
        call_format: the call syntax (:mod:`toolgym.call_formats`), passed to the environment at reset.
        stop_tokens: the tokens that end an assistant turn (sampled, kept as its last id); the first is
            what a scripted turn ends with.
        reasoning: the reasoning markers, or ``None`` when the model has none.
        thinking_budget: the most reasoning tokens per turn (``None``: no cap).
        tokenizer: the policy's tokenizer (reasoning tokens are counted with it).
    """

    name: str
    call_format: str
    stop_tokens: tuple[str, ...]
    reasoning: Reasoning | None = None
    thinking_budget: int | None = None
    tokenizer: TextTokenizer | None = None
    #: whether the rollout must check, after each turn, that the renderer did not rewrite history
    #: (toolgym's own renderers append by construction; the model's own template may not)
    checks_history: ClassVar[bool] = False

    def start(self, messages: Sequence[Message]) -> str:
        """The text of a conversation's opening, ending with the assistant's generation prompt."""
        raise NotImplementedError

    def rewrite(self, messages: Sequence[Message], token_ids: Sequence[int]) -> str | None:
        """How rendering ``messages`` whole would differ from ``token_ids`` (their turn-by-turn tokens),
        or None; only formats with ``checks_history`` ever differ."""
        return None

    def continuation(self, messages: Sequence[Message], *, close_turn: bool = False) -> str:
        """The text of ``messages`` after a sampled assistant turn (``close_turn``: one cut before its end)."""
        raise NotImplementedError

    def split_reasoning(self, text: str) -> tuple[str, str]:
        """A turn's text as ``(reasoning, action)``: the action is what the environment parses.

        A block that never closed (cut by a token limit) is all reasoning, and the action is empty.
        """
        r = self.reasoning
        if r is None:
            return "", text
        if r.close in text:
            end = text.index(r.close) + len(r.close)
            return text[:end], text[end:]
        if r.opened_by_prompt or text.lstrip().startswith(r.open):
            return text, ""
        return "", text

    def thinking_tokens(self, token_ids: Sequence[int], text: str) -> int:
        """How many of a turn's ``token_ids`` (decoded: ``text``) are its reasoning."""
        reasoning, _ = self.split_reasoning(text)
        if not reasoning or self.tokenizer is None:
            return 0
        low, high = 0, len(token_ids)  # the fewest leading ids whose text covers the reasoning
        while low < high:
            mid = (low + high) // 2
            if len(self.tokenizer.decode(token_ids[:mid])) >= len(reasoning):
                high = mid
            else:
                low = mid + 1
        return low


def single_token(hf_tokenizer: Any, token: str) -> int | None:
    """The id of ``token`` when the tokenizer encodes it as one token, else ``None``."""
    ids = hf_tokenizer.encode(token, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None
