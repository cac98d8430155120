"""Policy building blocks: the shared chat-rendering base and the scripted (canned-turn) policy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from toolgym.agents.chat.chatml import ByteTokenizer, ChatMLTemplate, TextTokenizer
from toolgym.agents.chat.formats import ChatFormat, HermesFormat
from toolgym.core import Completion, Message, SamplingParams
from toolgym.errors import ToolgymError

__all__ = ["ChatPolicy", "RulePolicy", "ScriptedPolicy"]


class ChatPolicy:
    """Base for policies that render chats with a :class:`~toolgym.agents.chat.formats.ChatFormat`
    (default: ``hermes``, :class:`ChatMLTemplate`) and a tokenizer.

    ``chat_format`` is also what the rollout reads: its ``call_format`` goes to the environment at reset,
    its reasoning markers keep reasoning out of the action, and a ``template`` format's rewrite check
    runs after every turn.
    """

    name = "chat"
    #: The completion's ids are the sampled ids and its logprobs the sampler's (see TrainablePolicy).
    token_exact: bool = True
    #: Weight updates seen; a policy whose weights change sets it (see TrainablePolicy).
    policy_version: int = 0

    def __init__(
        self,
        tokenizer: TextTokenizer,
        template: ChatMLTemplate | None = None,
        *,
        chat_format: ChatFormat | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_format: ChatFormat = chat_format or HermesFormat(template=template or ChatMLTemplate())

    @property
    def template(self) -> ChatMLTemplate | None:
        """The ChatML template of a ``hermes`` policy (``None`` for other formats)."""
        return getattr(self.chat_format, "template", None)

    @template.setter
    def template(self, template: ChatMLTemplate) -> None:
        self.chat_format = HermesFormat(template=template, tokenizer=self.chat_format.tokenizer)

    def render(
        self, messages: Sequence[Message], *, continuation: bool = False, close_turn: bool = False
    ) -> list[int]:
        if continuation:
            text = self.chat_format.continuation(messages, close_turn=close_turn)
        else:
            text = self.chat_format.start(messages)
        return list(self.tokenizer.encode(text))

    def complete(self, text: str, sampling: SamplingParams) -> Completion:
        """A completion for a fixed turn text: its ids plus the end-of-turn token, cut at ``max_tokens``.

        A text that already ends with one of the format's end-of-turn tokens ends with that one (and,
        as a sampled turn's, its ``text`` leaves it out).
        """
        end = self.chat_format.stop_tokens[0]
        for stop in self.chat_format.stop_tokens:
            if text.endswith(stop):
                text, end = text[: -len(stop)], stop
                break
        ids = list(self.tokenizer.encode(text + end))
        finish: Literal["stop", "length"] = "stop"
        if len(ids) > sampling.max_tokens:
            ids, finish = ids[: sampling.max_tokens], "length"
            text = self.tokenizer.decode(ids)
        return Completion(token_ids=tuple(ids), logprobs=(0.0,) * len(ids), text=text, finish_reason=finish)


class ScriptedPolicy(ChatPolicy):
    """Replays canned assistant turns, in order; for tests and env debugging without a model.

    Each canned turn is encoded with the policy's tokenizer and ends with the format's end-of-turn token
    (``<|im_end|>``; a stop),
    with logprob 0.0 for every token. Running out of turns is an error, not a silent empty turn.
    """

    name = "scripted"

    def __init__(
        self,
        turns: Sequence[str],
        tokenizer: TextTokenizer | None = None,
        *,
        chat_format: ChatFormat | None = None,
    ) -> None:
        super().__init__(tokenizer or ByteTokenizer(), chat_format=chat_format)
        self.turns = list(turns)
        self._next = 0

    def reset(self) -> None:
        self._next = 0

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        if self._next >= len(self.turns):
            raise ToolgymError(f"ScriptedPolicy ran out of turns after {len(self.turns)}")
        text = self.turns[self._next]
        self._next += 1
        return self.complete(text, sampling)


class RulePolicy(ChatPolicy):
    """A model-free policy whose turn is a function of the conversation so far (baselines, demos).

    ``rule`` receives the decoded transcript (the rendered ChatML text) and returns the next assistant
    turn. Deterministic rules make deterministic baselines.
    """

    def __init__(
        self,
        rule: Callable[[str], str],
        name: str = "rule",
        tokenizer: TextTokenizer | None = None,
        template: ChatMLTemplate | None = None,
    ) -> None:
        super().__init__(tokenizer or ByteTokenizer(), template)
        self.rule = rule
        self.name = name

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        return self.complete(self.rule(self.tokenizer.decode(token_ids)), sampling)
