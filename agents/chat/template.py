"""The ``template`` chat format: the model's own Jinja template, through ``apply_chat_template``.

toolgym appends each turn and never re-renders one, which needs the template's *prefix property*: a
conversation rendered whole must start with the rendering of any earlier part of it. Two checks:

* **when the format is built** (:meth:`TemplateFormat.build`): a probe conversation (plain text turns,
  a tool result, a user note) is rendered turn by turn and whole; a template whose renderings differ
  (it numbers turns, treats the last turn apart, ends turns only between messages) is refused with the
  first difference named;
* **at every turn of an episode** (:meth:`TemplateFormat.rewrite`, called by the rollout): the open
  segment's tokens, decoded, are compared with the template's rendering of the same messages. A
  template that rewrites history for what was actually said (Qwen3 drops the ``<think>`` blocks of
  turns before the latest user message; some trim or normalise whitespace) gets a description of the
  rewrite; the rollout then opens a new token segment there, rendered by the template (``on_rewrite =
  "segment"``, the default: the earlier segment keeps its sampled tokens and trains with the episode's
  advantage, as compaction's segments do), or stops with that description (``"refuse"``). Nothing is
  ever re-tokenised in place.

Messages reach the template as OpenAI chat messages: tool results become user turns of
``<tool_response>`` blocks (as over HTTP, :func:`toolgym.agents.chat.messages.openai_messages`), so any
template renders them; a template that refuses a system role gets the system text at the head of the
first user message. The turn's end is the special token the template writes right after an assistant
message's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

from toolgym.agents.chat.base import THINK, ChatFormat, Reasoning, single_token
from toolgym.agents.chat.chatml import TextTokenizer
from toolgym.agents.chat.messages import openai_messages
from toolgym.call_formats import H_CHANNEL, PYTHON_TAG, TOOL_CALLS
from toolgym.core import Message
from toolgym.errors import ConfigError

__all__ = ["TemplateFormat"]

_USER, _ANSWER = "PROBE-QUESTION", "PROBE-ANSWER"
#: A template's text -> the call syntax it renders (the first that matches; else hermes).
_CALL_MARKERS = (
    ("<tool_call>", "hermes"),
    (TOOL_CALLS, "mistral"),
    (H_CHANNEL, "harmony"),
    (PYTHON_TAG, "llama3"),
)


@dataclass(frozen=True)
class TemplateFormat(ChatFormat):
    """A model's own chat template (see the module docstring). Build it with :meth:`build`.

    Attributes:
        hf: the Hugging Face tokenizer whose template renders.
        fold_system: the template refuses a system role: its text heads the first user message.
        on_rewrite: what the rollout does with a history-rewriting template (``segment`` or ``refuse``).
    """

    name: str = "template:hermes"
    call_format: str = "hermes"
    stop_tokens: tuple[str, ...] = ()
    hf: Any = None
    fold_system: bool = False
    on_rewrite: Literal["segment", "refuse"] = "segment"
    checks_history: ClassVar[bool] = True

    @classmethod
    def build(
        cls,
        hf_tokenizer: Any,
        call_format: str | None = None,
        *,
        tokenizer: TextTokenizer | None = None,
        on_rewrite: Literal["segment", "refuse"] = "segment",
    ) -> TemplateFormat:
        """Check the tokenizer's template and build the format (the call syntax: found in the template).

        Raises:
            ConfigError: no template, a template that fails on plain chat messages, one whose turn end
                is not a special token, or one that fails the prefix check.
        """
        template = getattr(hf_tokenizer, "chat_template", None)
        if not template:
            raise ConfigError(
                "chat format 'template' needs a tokenizer with a chat template; this one has none"
            )
        text = template if isinstance(template, str) else str(template)
        found = next((calls for marker, calls in _CALL_MARKERS if marker in text), "hermes")
        calls = call_format or found
        fmt = cls(
            name=f"template:{calls}",
            call_format=calls,
            hf=hf_tokenizer,
            tokenizer=tokenizer,
            on_rewrite=on_rewrite,
        )
        try:
            fmt._render([{"role": "system", "content": "S"}, {"role": "user", "content": _USER}], True)
        except Exception as exc:  # noqa: BLE001 - a template's own refusal (jinja raise_exception) is its answer
            fmt = replace(fmt, fold_system=True)
            try:
                fmt._render([{"role": "system", "content": "S"}, {"role": "user", "content": _USER}], True)
            except Exception:  # noqa: BLE001 - as above
                raise ConfigError(
                    f"the chat template cannot render a system and a user message: {exc}"
                ) from None
        base = fmt._render(
            [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ANSWER}], False
        )
        tail = base[base.index(_ANSWER) + len(_ANSWER) :]
        specials = {*getattr(hf_tokenizer, "all_special_tokens", []), *hf_tokenizer.get_added_vocab()}
        stop = max((t for t in specials if t and tail.startswith(t)), key=len, default=None)
        if stop is None:
            raise ConfigError(
                f"the chat template ends an assistant turn with {tail[:20]!r}, not a special token: toolgym "
                "cannot tell where a sampled turn ends; use one of toolgym's own formats (chat_format)"
            )
        eos = getattr(hf_tokenizer, "eos_token", None)
        stops = (stop,) if not eos or eos == stop else (stop, eos)
        prompt = fmt._render([{"role": "user", "content": _USER}], True)
        gen = prompt[len(fmt._render([{"role": "user", "content": _USER}], False)) :]
        think: Reasoning | None = None
        if (
            single_token(hf_tokenizer, THINK.open) is not None
            and single_token(hf_tokenizer, THINK.close) is not None
        ):
            think = Reasoning(THINK.open, THINK.close, THINK.forced_close, opened_by_prompt=THINK.open in gen)
        fmt = replace(fmt, stop_tokens=stops, reasoning=think)
        try:
            problem = fmt._probe()
        except ConfigError as exc:  # an earlier turn changed as the probe went on
            problem = str(exc)
        if problem:
            raise ConfigError(
                f"the chat template fails the prefix check: {problem}; use one of toolgym's own formats"
            )
        return fmt

    # ------------------------------------------------------------------ rendering
    def _conversation(self, messages: Sequence[Message]) -> list[dict[str, str]]:
        out = openai_messages(messages)
        if self.fold_system and out and out[0]["role"] == "system":
            system, rest = out[0]["content"], out[1:]
            if rest and rest[0]["role"] == "user":
                return [{"role": "user", "content": f"{system}\n\n{rest[0]['content']}"}, *rest[1:]]
            return [{"role": "user", "content": system}, *rest]
        return out

    def _render(self, messages: Sequence[Message], generation: bool) -> str:
        return str(
            self.hf.apply_chat_template(
                self._conversation(messages), tokenize=False, add_generation_prompt=generation
            )
        )

    def start(self, messages: Sequence[Message]) -> str:
        return self._render(messages, True)

    def continuation(self, messages: Sequence[Message], *, close_turn: bool = False) -> str:
        """What follows a sampled turn: the template's rendering of ``messages`` after a probe exchange,
        from the turn's end token on (without it, unless the turn was cut before it)."""
        head = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ANSWER}]
        base, full = self._render(head, False), self._render([*head, *messages], True)
        cut = base.index(_ANSWER) + len(_ANSWER) + len(self.stop_tokens[0])
        if full[:cut] != base[:cut]:
            raise ConfigError(
                "the chat template renders an earlier turn differently once more messages follow ("
                f"{_difference(base[:cut], full[:cut])}); toolgym cannot append turns with it"
            )
        return full[cut - len(self.stop_tokens[0]) if close_turn else cut :]

    # ------------------------------------------------------------------ the prefix property
    def _probe(self) -> str | None:
        """Render a probe conversation turn by turn and whole; the first difference, or None."""
        opening = [{"role": "system", "content": "S"}, {"role": "user", "content": _USER}]
        later = [
            [{"role": "tool", "name": "t", "content": "R1"}],
            [{"role": "tool", "name": "t", "content": "R2"}, {"role": "user", "content": "NOTE"}],
        ]
        answers = ["A1", "A2"]
        text, messages = self.start(opening), list(opening)
        for answer, follow in zip(answers, later, strict=True):
            text += answer + self.stop_tokens[0] + self.continuation(follow)
            messages += [{"role": "assistant", "content": answer}, *follow]
        return _difference(text, self.start(messages))

    def rewrite(self, messages: Sequence[Message], token_ids: Sequence[int]) -> str | None:
        """How the template rewrites the history ``token_ids`` hold (rendered from ``messages``), or None.

        Compares the decoded tokens with the template's rendering of ``messages`` (see the module
        docstring). The tokens are the rollout's, so a difference is what the template would show the
        model now that it did not show before.
        """
        if self.tokenizer is None:
            return None
        actual, expected = self.tokenizer.decode(token_ids), self.start(messages)
        if actual == expected:
            return None
        problem = _difference(actual, expected) or "renders the conversation differently"
        r = self.reasoning
        if r is not None and r.close in actual and actual.count(r.close) > expected.count(r.close):
            return f"drops the reasoning ({r.open}...{r.close}) of earlier assistant turns: {problem}"
        return problem


def _difference(actual: str, expected: str) -> str | None:
    """Where two renderings first differ, with a little context, or None when they are equal."""
    if actual == expected:
        return None
    at = next(
        (i for i, (a, b) in enumerate(zip(actual, expected, strict=False)) if a != b),
        min(len(actual), len(expected)),
    )
    return (
        f"at character {at}, the turn-by-turn rendering has {actual[max(at - 20, 0) : at + 40]!r} where the "
        f"whole conversation renders {expected[max(at - 20, 0) : at + 40]!r}"
    )
