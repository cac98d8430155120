"""Chat formats: how a policy renders a conversation into tokens, where a turn ends, and how its model
writes tool calls and reasoning. A small registry; ``auto`` picks one from the tokenizer.

========  ==========================================  ==================  ======================================
format    renders                                      tool calls          chosen by ``auto`` when
========  ==========================================  ==================  ======================================
hermes    ChatML, toolgym's own template (unchanged)   ``hermes``          the template uses ``<|im_start|>``, or
                                                                           no template and ChatML tokens
llama3    Llama 3.x headers, tools results as          ``llama3``          the template uses
          ``ipython`` turns                                                ``<|start_header_id|>``
mistral   ``[INST]``, ``[TOOL_RESULTS]``,             ``mistral``         the template uses ``[INST]``
          ``[SYSTEM_PROMPT]`` when the tokenizer has it
harmony   gpt-oss: system + developer messages,       ``harmony``         the template uses ``<|channel|>``
          channels, ``functions.NAME`` tool messages
template  the model's own Jinja template through       found in the        the tokenizer has a template that
          ``apply_chat_template``                      template, else      uses none of the above
                                                       ``hermes``
========  ==========================================  ==================  ======================================

A toolgym export records the format it was trained with (``toolgym-export.json``), and ``auto`` takes
that first. Every format but ``template`` is toolgym's own renderer: a conversation is rendered once,
turn by turn, and each turn is appended, so the prefix property holds by construction. ``template``
checks it (:mod:`toolgym.agents.chat.template`). A named format whose special tokens are missing
from the tokenizer is refused with the missing tokens named; so is a tokenizer with no template and
none of the formats' tokens.

Reasoning. A format has reasoning markers when the tokenizer has them as single tokens (``<think>``
``</think>``; Mistral's ``[THINK]`` ``[/THINK]``; harmony's ``analysis`` channel always): the reasoning
is sampled and trained like any assistant text, :meth:`ChatFormat.split_reasoning` keeps it out of the
action the environment parses, the rollout counts it (``tokens/thinking``), and ``thinking_budget``
caps it per turn (the rollout then closes the block itself, with tokens it does not train on).

Add a format: a renderer with ``start``/``continuation`` (and its special tokens in :data:`REQUIRED`),
paired with a call syntax of :mod:`toolgym.call_formats`, registered in :data:`RENDERERS`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from toolgym.agents.chat.base import ChatFormat, Reasoning, single_token
from toolgym.agents.chat.chatml import IM_END, IM_START, ChatMLTemplate, TextTokenizer
from toolgym.agents.chat.template import TemplateFormat
from toolgym.call_formats import CALL_FORMATS, H_CALL, H_CHANNEL, H_END, H_MESSAGE, H_RETURN, H_START
from toolgym.chat_format_names import CHAT_FORMATS
from toolgym.core import Message
from toolgym.errors import ConfigError, did_you_mean

__all__ = [
    "ChatFormat",
    "HarmonyFormat",
    "HermesFormat",
    "Llama3Format",
    "MistralFormat",
    "Reasoning",
    "detect_chat_format",
    "resolve_chat_format",
]

logger = logging.getLogger(__name__)

BOT, HEADER_START, HEADER_END, EOT, EOM = (
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
)
BOS, EOS, INST, INST_END = "<s>", "</s>", "[INST]", "[/INST]"
SYSTEM_PROMPT, SYSTEM_PROMPT_END = "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"
TOOL_RESULTS, TOOL_RESULTS_END = "[TOOL_RESULTS]", "[/TOOL_RESULTS]"
#: An inference export's manifest (:mod:`toolgym.agents.policies.run_exports`): it records the chat format.
EXPORT_MANIFEST = "toolgym-export.json"

#: The special tokens each own format needs, each a single token of the vocabulary.
REQUIRED: dict[str, tuple[str, ...]] = {
    "hermes": (IM_START, IM_END),
    "llama3": (BOT, HEADER_START, HEADER_END, EOT),
    "mistral": (BOS, EOS, INST, INST_END, "[TOOL_CALLS]"),
    "harmony": (H_START, H_END, H_MESSAGE, H_CHANNEL, H_RETURN, H_CALL),
}
#: What a chat template holds when it renders each format (``auto`` reads the template first).
TEMPLATE_MARKERS: dict[str, str] = {
    "harmony": H_CHANNEL,
    "llama3": HEADER_START,
    "mistral": INST,
    "hermes": IM_START,
}
#: The model family's default system message in harmony (identity, reasoning effort, channels).
HARMONY_SYSTEM = (
    "You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n\n"
    "Reasoning: {effort}\n\n# Valid channels: analysis, commentary, final. Channel must be included for "
    "every message.\nCalls to these tools must go to the commentary channel: 'functions'."
)


@dataclass(frozen=True)
class HermesFormat(ChatFormat):
    """ChatML with ``<tool_call>`` calls: :class:`~toolgym.agents.chat.chatml.ChatMLTemplate`, unchanged."""

    name: str = "hermes"
    call_format: str = "hermes"
    stop_tokens: tuple[str, ...] = (IM_END,)
    template: ChatMLTemplate = ChatMLTemplate()

    def start(self, messages: Sequence[Message]) -> str:
        return self.template.start(messages)

    def continuation(self, messages: Sequence[Message], *, close_turn: bool = False) -> str:
        return self.template.continuation(messages, close_turn=close_turn)


@dataclass(frozen=True)
class Llama3Format(ChatFormat):
    """Llama 3.x: ``<|start_header_id|>ROLE<|end_header_id|>\\n\\nTEXT<|eot_id|>``; tool results are
    ``ipython`` turns; a turn ends with ``<|eot_id|>`` (or ``<|eom_id|>``)."""

    name: str = "llama3"
    call_format: str = "llama3"
    stop_tokens: tuple[str, ...] = (EOT, EOM)

    def _turns(self, messages: Sequence[Message]) -> str:
        roles = {"tool": "ipython"}
        return "".join(
            f"{HEADER_START}{roles.get(m['role'], m['role'])}{HEADER_END}\n\n{m['content']}{EOT}"
            for m in messages
        )

    def start(self, messages: Sequence[Message]) -> str:
        return BOT + self._turns(messages) + f"{HEADER_START}assistant{HEADER_END}\n\n"

    def continuation(self, messages: Sequence[Message], *, close_turn: bool = False) -> str:
        return (
            (EOT if close_turn else "") + self._turns(messages) + f"{HEADER_START}assistant{HEADER_END}\n\n"
        )


@dataclass(frozen=True)
class MistralFormat(ChatFormat):
    """Mistral instruct: ``[INST]USER[/INST]ASSISTANT</s>``, tool results in ``[TOOL_RESULTS]`` blocks.

    The system message is a ``[SYSTEM_PROMPT]`` block when the tokenizer has one; otherwise it opens the
    opening's last user message (mistral-common's placement). No generation prompt: the assistant's
    turn follows ``[/INST]`` or ``[/TOOL_RESULTS]`` directly.
    """

    name: str = "mistral"
    call_format: str = "mistral"
    stop_tokens: tuple[str, ...] = (EOS,)
    system_block: bool = False
    tool_results: bool = False

    def _render(self, messages: Sequence[Message], *, opening: bool) -> str:
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        system, out = "", []
        for i, m in enumerate(messages):
            role, content = m["role"], m["content"]
            if role == "system" and self.system_block:
                out.append(f"{SYSTEM_PROMPT}{content}{SYSTEM_PROMPT_END}")
            elif role == "system" and opening and users:
                system += content + "\n\n"
            elif role == "assistant":
                out.append(content + EOS)
            elif role == "tool" and self.tool_results:
                out.append(f"{TOOL_RESULTS}{content}{TOOL_RESULTS_END}")
            else:
                head = system if opening and users and i == users[-1] else ""
                out.append(f"{INST}{head}{content}{INST_END}")
        return "".join(out)

    def start(self, messages: Sequence[Message]) -> str:
        return BOS + self._render(messages, opening=True)

    def continuation(self, messages: Sequence[Message], *, close_turn: bool = False) -> str:
        return (EOS if close_turn else "") + self._render(messages, opening=False)


@dataclass(frozen=True)
class HarmonyFormat(ChatFormat):
    """gpt-oss harmony: a fixed system message, the environment's system text as the developer
    message, ``<|start|>ROLE<|message|>TEXT<|end|>`` messages, tool results as messages from
    ``functions.NAME``; a turn ends with ``<|call|>`` (a tool call) or ``<|return|>`` (the answer).
    Reasoning is the ``analysis`` channel."""

    name: str = "harmony"
    call_format: str = "harmony"
    stop_tokens: tuple[str, ...] = (H_RETURN, H_CALL)
    reasoning: Reasoning | None = Reasoning(H_CHANNEL + "analysis", H_END, H_END + H_START + "assistant")
    effort: Literal["low", "medium", "high"] = "medium"

    def _messages(self, messages: Sequence[Message]) -> str:
        out = []
        for m in messages:
            role, content = m["role"], m["content"]
            if role == "tool":
                name = m.get("name") or "error"
                out.append(
                    f"{H_START}functions.{name} to=assistant{H_CHANNEL}commentary{H_MESSAGE}{content}{H_END}"
                )
            elif role == "assistant" and content.startswith(H_CHANNEL):  # already in channels (a call)
                closed = content.endswith((H_CALL, H_END, H_RETURN))
                out.append(f"{H_START}assistant{content}{'' if closed else H_END}")
            elif role == "assistant":
                out.append(f"{H_START}assistant{H_CHANNEL}final{H_MESSAGE}{content}{H_END}")
            else:
                out.append(f"{H_START}{'developer' if role == 'system' else role}{H_MESSAGE}{content}{H_END}")
        return "".join(out)

    def start(self, messages: Sequence[Message]) -> str:
        system = f"{H_START}system{H_MESSAGE}{HARMONY_SYSTEM.format(effort=self.effort)}{H_END}"
        return system + self._messages(messages) + f"{H_START}assistant"

    def continuation(self, messages: Sequence[Message], *, close_turn: bool = False) -> str:
        return (H_END if close_turn else "") + self._messages(messages) + f"{H_START}assistant"

    def split_reasoning(self, text: str) -> tuple[str, str]:
        """Leading ``analysis`` messages are the reasoning; the action starts at the first other one."""
        pos = 0
        while text.startswith(H_CHANNEL + "analysis", pos) and H_MESSAGE in text[pos:]:
            header_end = text.index(H_MESSAGE, pos)
            if "to=" in text[pos:header_end]:  # a built-in tool call in the analysis channel: an action
                break
            end = text.find(H_END, header_end)
            if end == -1:
                return text, ""  # unfinished reasoning
            pos = end + len(H_END)
            pos += len(H_START + "assistant") if text.startswith(H_START + "assistant", pos) else 0
        return text[:pos], text[pos:]


#: the renderer of each name of :data:`~toolgym.chat_format_names.RENDERER_NAMES` (one per call syntax)
RENDERERS: dict[str, Callable[..., ChatFormat]] = {
    "hermes": HermesFormat,
    "llama3": Llama3Format,
    "mistral": MistralFormat,
    "harmony": HarmonyFormat,
}


def _template_text(hf_tokenizer: Any) -> str:
    template = getattr(hf_tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) else ""


def _think(hf_tokenizer: Any, name: str) -> Reasoning | None:
    """The tokenizer's reasoning markers, when it has them as single tokens."""
    pairs = (
        [("[THINK]", "[/THINK]"), ("<think>", "</think>")] if name == "mistral" else [("<think>", "</think>")]
    )
    for open_, close in pairs:
        if single_token(hf_tokenizer, open_) is not None and single_token(hf_tokenizer, close) is not None:
            return Reasoning(open_, close, close + "\n\n")
    return None


def detect_chat_format(hf_tokenizer: Any, model_dir: str | Path | None = None) -> tuple[str, str]:
    """The format ``auto`` picks, and why (see the module docstring): the export's record, then the
    template's markers, then the template itself, then the special tokens.

    Raises:
        ConfigError: no export record, no template and no known format's tokens.
    """
    manifest = Path(model_dir) / EXPORT_MANIFEST if model_dir is not None else None
    if manifest is not None and manifest.is_file():
        try:
            recorded = json.loads(manifest.read_text(encoding="utf-8")).get("chat_format", "hermes")
        except (OSError, json.JSONDecodeError, AttributeError) as exc:
            raise ConfigError(f"{manifest} is unreadable ({exc})") from None
        return str(recorded), f"recorded in {EXPORT_MANIFEST}"
    template = _template_text(hf_tokenizer)
    have = {n: all(single_token(hf_tokenizer, t) is not None for t in REQUIRED[n]) for n in REQUIRED}
    for name, marker in TEMPLATE_MARKERS.items():
        if marker in template and have[name]:
            return name, f"the chat template uses {marker} and the tokenizer has the {name} tokens"
    if template:
        return "template", "the tokenizer has a chat template in no known format"
    for name in RENDERERS:
        if have[name]:
            return (
                name,
                f"no chat template; the tokenizer has the {name} tokens ({', '.join(REQUIRED[name])})",
            )
    formats = "; ".join(f"{n}: {' '.join(REQUIRED[n])}" for n in REQUIRED)
    raise ConfigError(
        "cannot tell this model's chat format: its tokenizer has no chat template and not the special "
        f"tokens of any known format ({formats}). Give the tokenizer a chat_template, or name a format "
        f"(chat_format = one of {', '.join(CHAT_FORMATS[1:])})"
    )


def resolve_chat_format(
    spec: str,
    hf_tokenizer: Any,
    *,
    tokenizer: TextTokenizer | None = None,
    model_dir: str | Path | None = None,
    thinking_budget: int | None = None,
    on_rewrite: Literal["segment", "refuse"] = "segment",
) -> ChatFormat:
    """The chat format ``spec`` names for a Hugging Face tokenizer (``auto``: :func:`detect_chat_format`).

    Args:
        spec: ``auto``, a format name, ``template`` or ``template:CALLS``.
        hf_tokenizer: the model's tokenizer.
        tokenizer: the policy's text tokenizer (counts reasoning tokens); default: none.
        model_dir: the model directory (an export there records its format).
        thinking_budget: most reasoning tokens per turn (needs a format with reasoning markers).
        on_rewrite: ``template`` only: what a history-rewriting template gets (a new segment, or an error).

    Raises:
        ConfigError: an unknown spec (with "did you mean"), special tokens the format needs that the
            tokenizer lacks (named), a template that fails the prefix check, or a thinking budget for
            a format without reasoning.
    """
    why = "named"
    if spec == "auto":
        spec, why = detect_chat_format(hf_tokenizer, model_dir)
    name, _, calls = spec.partition(":")
    if (
        name not in RENDERERS
        and name != "template"
        or (calls and (name != "template" or calls not in CALL_FORMATS))
    ):
        raise ConfigError(
            f"unknown chat format {spec!r}.{did_you_mean(spec, CHAT_FORMATS)} Known: {', '.join(CHAT_FORMATS)}"
        )
    if name == "template":
        fmt: ChatFormat = TemplateFormat.build(
            hf_tokenizer, calls or None, tokenizer=tokenizer, on_rewrite=on_rewrite
        )
    else:
        missing = [t for t in REQUIRED[name] if single_token(hf_tokenizer, t) is None]
        if missing:
            raise ConfigError(
                f"chat format {name!r} needs the special tokens {', '.join(REQUIRED[name])}, but the tokenizer "
                f"lacks {', '.join(missing)} (or splits them into several tokens): this model was not trained "
                "on that format; use chat_format = 'auto' or 'template'"
            )
        options: dict[str, Any] = {"tokenizer": tokenizer}
        think = _think(hf_tokenizer, name)
        if name != "harmony":
            options["reasoning"] = think
        stops = [s for s in RENDERERS[name]().stop_tokens if single_token(hf_tokenizer, s) is not None]
        options["stop_tokens"] = tuple(stops)
        if name == "mistral":
            options["system_block"] = single_token(hf_tokenizer, SYSTEM_PROMPT) is not None
            options["tool_results"] = single_token(hf_tokenizer, TOOL_RESULTS) is not None
        fmt = RENDERERS[name](**options)
    if thinking_budget is not None:
        if fmt.reasoning is None:
            raise ConfigError(
                f"a thinking budget needs reasoning markers, and chat format {fmt.name!r} has none for this "
                "tokenizer (<think> and </think> as single tokens)"
            )
        if thinking_budget < 1:
            raise ConfigError(f"thinking_budget must be >= 1 token, got {thinking_budget}")
        fmt = replace(fmt, thinking_budget=thinking_budget)
    logger.info("chat format %s (%s)", fmt.name, why)
    return fmt
