"""The registered tool-call syntaxes: how each model family writes calls and reads its tool list.

=============  ==========================================================  ===============================
format         a call, as the model writes it                               tools described as
=============  ==========================================================  ===============================
``hermes``     ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``  JSON schemas in ``<tools>``
``llama3``     the whole turn is ``{"name": ..., "parameters": {...}}``      JSON schemas after instructions
               (after an optional ``<|python_tag|>``; several: ``;``)
``mistral``    ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``, or      a JSON list of schemas
               ``[TOOL_CALLS]name[ARGS]{...}`` (v11 tokenizers)
``harmony``    a message to ``functions.NAME``: ``<|channel|>commentary``    a TypeScript-like ``namespace
               ``to=functions.NAME <|constrain|>json<|message|>{...}``       functions`` (gpt-oss)
=============  ==========================================================  ===============================

Each is a :class:`~toolgym.parsing.CallFormat`; :func:`toolgym.parsing.parse` validates what its
``split`` cuts out, so every syntax's malformed calls become the same error observations. A turn of a
non-default syntax that holds no call of its own but the marker of another registered syntax gets an
error that names both (the model wrote a call in a format this model does not use): it is never
silently taken as the answer. ``hermes`` keeps its behaviour unchanged (text in another syntax is plain
text there).

How an environment learns the syntax: the rollout passes the policy's ``chat_format.call_format`` as
the reset option ``call_format`` when it is not ``hermes`` (ARCHITECTURE.md, "Contracts"); the
environment then lists its tools with that format's ``tools_prompt``, rewrites the calls of its worked
example into it (:func:`translate_calls`) and parses every action with it.

Add a syntax: implement the protocol (``name``, ``keys``, ``split``, ``format_call``, ``tools_prompt``),
register it in :data:`CALL_FORMATS`, and pair it with a renderer in ``toolgym.agents.chat.formats``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from toolgym import model_json
from toolgym.core import Message
from toolgym.errors import ConfigError, ToolParseError, did_you_mean
from toolgym.parsing import HERMES, CallFormat, CallKeys, RawCall, _split_blocks

__all__ = [
    "CALL_FORMATS",
    "HarmonyCalls",
    "Llama3Calls",
    "MistralCalls",
    "get_call_format",
    "translate_calls",
]

PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
H_START, H_END, H_MESSAGE, H_CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
H_CALL, H_RETURN, H_CONSTRAIN = "<|call|>", "<|return|>", "<|constrain|>"
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(H_CHANNEL) + r"\s*(\w+)")

_INTRO = "You are a helpful assistant that can call tools. You may call one tool per turn."
_OUTRO = "Tool results come back in messages from the tool. Call the answer tool when you are done."


def _example(schemas: Sequence[Mapping[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    """The first tool and placeholder arguments for it (the example call a tools prompt shows)."""
    if not schemas:
        return None
    fn = schemas[0]["function"]
    kinds = {"integer": 3, "number": 1.0, "boolean": True, "array": [], "object": {}}
    props = fn["parameters"].get("properties", {})
    return fn["name"], {k: kinds.get(v.get("type", ""), "...") for k, v in props.items()}


def _foreign(text: str, own: CallFormat) -> list[ToolParseError]:
    """An error when ``text`` holds another registered syntax's call marker (and none of ``own``'s)."""
    for fmt in CALL_FORMATS.values():
        marker = _MARKERS[fmt.name]
        if fmt.name != own.name and marker in text:
            example = own.format_call("<tool>", {"<argument>": "..."})
            return [
                ToolParseError(
                    f"this turn writes a tool call in the {fmt.name} format ({marker}...), but this model's "
                    f"calls are written in the {own.name} format: {example}"
                )
            ]
    return []


@dataclass(frozen=True)
class Llama3Calls:
    """Llama 3.x JSON tool calls: the turn is one JSON object (or several joined by ``;``)."""

    name: str = "llama3"
    keys: CallKeys = CallKeys("parameters", aliases=("arguments",))

    def split(self, text: str) -> tuple[list[RawCall], str, list[ToolParseError]]:
        stripped = text.strip()
        head = stripped.removeprefix(PYTHON_TAG).lstrip()
        if not (stripped.startswith(PYTHON_TAG) or head.startswith("{")):
            return [], text, _foreign(text, self)
        calls: list[RawCall] = []
        pos = 0
        while pos < len(head) and head[pos] == "{":
            try:
                _, end = model_json.raw_decode(head, pos)
            except model_json.ModelJSONError:  # malformed: the rest is the call, reported by the validator
                calls.append(RawCall(head[pos:]))
                return calls, "", []
            calls.append(RawCall(head[pos:end]))
            pos = end
            while pos < len(head) and head[pos] in " \t\r\n;":
                pos += 1
        if not calls:  # "<|python_tag|>" and no JSON object after it
            calls.append(RawCall(head))
        return calls, head[pos:], []

    def format_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        return json.dumps({"name": name, "parameters": dict(arguments)}, ensure_ascii=False)

    def tools_prompt(self, schemas: list[dict[str, Any]]) -> str:
        lines = [
            _INTRO,
            'To call a tool, reply with only a JSON object {"name": function name, "parameters": dictionary '
            "of argument name and its value}. Do not use variables.",
        ]
        example = _example(schemas)
        if example:
            lines += ["For example:", self.format_call(*example)]
        lines += [_OUTRO, "", "The tools:", ""]
        return "\n".join(lines) + "\n\n".join(json.dumps(s, indent=4, ensure_ascii=False) for s in schemas)


@dataclass(frozen=True)
class MistralCalls:
    """Mistral's ``[TOOL_CALLS]`` calls: a JSON list of calls, or ``name[ARGS]{...}`` (v11 tokenizers)."""

    name: str = "mistral"
    keys: CallKeys = CallKeys("arguments", ignored=("id",))

    def split(self, text: str) -> tuple[list[RawCall], str, list[ToolParseError]]:
        if TOOL_CALLS not in text:
            return [], text, _foreign(text, self)
        content, _, rest = text.partition(TOOL_CALLS)
        calls: list[RawCall] = []
        errors: list[ToolParseError] = []
        for piece in (p.strip() for p in rest.split(TOOL_CALLS)):
            if piece.startswith("["):
                try:
                    items = model_json.loads(piece)
                    bodies = [json.dumps(item, ensure_ascii=False) for item in items]
                except (model_json.ModelJSONError, RecursionError):
                    calls.append(RawCall(piece))  # the validator reports the bad JSON
                    continue
                calls += [RawCall(body) for body in bodies]
            elif ARGS in piece:
                name, _, body = piece.partition(ARGS)
                calls.append(RawCall(body, name=name))
            elif piece.startswith("{"):
                calls.append(RawCall(piece))
            elif "{" in piece:  # v11 without [ARGS]: name{...}
                brace = piece.index("{")
                calls.append(RawCall(piece[brace:], name=piece[:brace]))
            else:
                errors.append(
                    ToolParseError(
                        f"{TOOL_CALLS} must be followed by a JSON list of calls, e.g. "
                        f"{self.format_call('<tool>', {})}"
                    )
                )
        return calls, content, errors

    def format_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        return TOOL_CALLS + json.dumps([{"name": name, "arguments": dict(arguments)}], ensure_ascii=False)

    def tools_prompt(self, schemas: list[dict[str, Any]]) -> str:
        lines = [
            _INTRO,
            "The tools are described as a JSON list of schemas:",
            json.dumps(schemas, ensure_ascii=False),
            f"To call a tool, reply with {TOOL_CALLS} followed by a JSON list that holds the call.",
        ]
        example = _example(schemas)
        if example:
            lines += ["For example:", self.format_call(*example)]
        return "\n".join([*lines, _OUTRO])


def _ts_type(schema: Mapping[str, Any]) -> str:
    """A JSON schema as the TypeScript-like type harmony's tool list uses."""
    if "enum" in schema:
        return " | ".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        return _ts_type(schema.get("items", {})) + "[]"
    return {"string": "string", "integer": "number", "number": "number", "boolean": "boolean"}.get(
        str(kind), "object" if kind == "object" else "any"
    )


@dataclass(frozen=True)
class HarmonyCalls:
    """gpt-oss harmony calls: an assistant message whose recipient (``to=``) is ``functions.NAME``.

    A turn is one or more messages (``<|channel|>CHANNEL[ to=RECIPIENT]...<|message|>CONTENT``, later
    ones after ``<|start|>assistant``); ``analysis`` messages are reasoning (the policy's chat format
    removes them before the environment sees the turn; any left are ignored), calls are the messages to
    ``functions.*``, and the rest (``final``, ``commentary`` preambles) is the turn's text.
    """

    name: str = "harmony"
    keys: CallKeys = CallKeys()

    def split(self, text: str) -> tuple[list[RawCall], str, list[ToolParseError]]:
        if H_MESSAGE not in text:
            return [], text, _foreign(text, self)
        calls: list[RawCall] = []
        content: list[str] = []
        errors: list[ToolParseError] = []
        for message in text.split(H_START + "assistant"):
            if not message.strip():
                continue
            header, found, body = message.partition(H_MESSAGE)
            if not found:
                errors.append(ToolParseError(f"a harmony message needs a header ending in {H_MESSAGE}"))
                continue
            for end in (H_END, H_CALL, H_RETURN):
                body = body.removesuffix(end)
            recipient = _RECIPIENT.search(header)
            channel = _CHANNEL.search(header)
            if recipient and recipient.group(1).startswith("functions."):
                calls.append(RawCall(body, name=recipient.group(1).removeprefix("functions.")))
            elif recipient:
                errors.append(
                    ToolParseError(f"unknown recipient {recipient.group(1)!r}: call tools as functions.NAME")
                )
            elif not (channel and channel.group(1) == "analysis"):
                content.append(body)
        return calls, "\n".join(content), errors

    def format_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        body = json.dumps(dict(arguments), ensure_ascii=False)
        return f"{H_CHANNEL}commentary to=functions.{name} {H_CONSTRAIN}json{H_MESSAGE}{body}{H_CALL}"

    def tools_prompt(self, schemas: list[dict[str, Any]]) -> str:
        lines = ["# Instructions", "", f"{_INTRO} {_OUTRO}", "", "# Tools", "", "## functions", ""]
        lines += ["namespace functions {", ""]
        for schema in schemas:
            fn = schema["function"]
            params = fn["parameters"]
            lines.append(f"// {fn['description']}")
            props = params.get("properties", {})
            if not props:
                lines += [f"type {fn['name']} = () => any;", ""]
                continue
            lines.append(f"type {fn['name']} = (_: {{")
            for key, prop in props.items():
                if prop.get("description"):
                    lines.append(f"// {prop['description']}")
                optional = "" if key in params.get("required", []) else "?"
                default = f" // default: {prop['default']}" if "default" in prop else ""
                lines.append(f"{key}{optional}: {_ts_type(prop)},{default}")
            lines += ["}) => any;", ""]
        lines.append("} // namespace functions")
        return "\n".join(lines)


#: The registered call formats by name; ``hermes`` is every environment's default.
CALL_FORMATS: dict[str, CallFormat] = {
    "hermes": HERMES,
    "llama3": Llama3Calls(),
    "mistral": MistralCalls(),
    "harmony": HarmonyCalls(),
}
#: What a call of each syntax starts with (how a turn in another syntax is recognised).
_MARKERS = {"hermes": "<tool_call>", "llama3": PYTHON_TAG, "mistral": TOOL_CALLS, "harmony": "to=functions."}


def get_call_format(name: str) -> CallFormat:
    """The call format registered as ``name``; an unknown name is a ConfigError with "did you mean"."""
    try:
        return CALL_FORMATS[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown call format {name!r}.{did_you_mean(str(name), CALL_FORMATS)} "
            f"Known formats: {', '.join(CALL_FORMATS)}"
        ) from None


def translate_calls(messages: Sequence[Message], call_format: CallFormat) -> list[Message]:
    """``messages`` with every assistant turn's default-format calls rewritten in ``call_format``.

    For an environment's worked example (written with :func:`toolgym.parsing.format_tool_call`): the
    model sees the example in its own syntax. A turn with calls becomes just the calls; other turns and
    messages are returned unchanged (copies).
    """
    out: list[Message] = []
    for message in messages:
        message = dict(message)
        if message.get("role") == "assistant" and call_format.name != HERMES.name:
            bodies, _ = _split_blocks(message["content"], [])
            calls = [json.loads(b) for b in bodies]
            if calls:
                message["content"] = "".join(
                    call_format.format_call(c["name"], c["arguments"]) for c in calls
                )
        out.append(message)
    return out
