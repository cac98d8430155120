"""toolgym's chat messages as an OpenAI-compatible server reads and writes them.

Tool results travel as ``<tool_response>`` blocks inside user turns, as in toolgym's own ChatML
template (OpenAI ``tool`` messages would need call ids the text transcript does not have); a reply's
``tool_calls`` come back as ``<tool_call>`` text, so the environment parses them like any model output.
Shared by the HTTP policy (:mod:`toolgym.agents.policies.http`) and the model's own chat template
(:mod:`toolgym.agents.chat.template`), which renders the same messages.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from toolgym import model_json
from toolgym.core import Message
from toolgym.errors import ConfigError
from toolgym.parsing import CLOSE, OPEN, format_tool_response

__all__ = ["openai_messages", "tool_schemas", "turn_text"]

_TOOLS_BLOCK = re.compile(r"<tools>\n(.*?)\n</tools>", re.DOTALL)


def openai_messages(messages: Sequence[Message]) -> list[dict[str, str]]:
    """Our chat messages as OpenAI ones: tool results become ``<tool_response>`` user turns.

    Consecutive tool results share one user turn, and a user note right after them joins it, as in
    :class:`~toolgym.agents.chat.chatml.ChatMLTemplate`.
    """
    out: list[dict[str, str]] = []
    pending: list[str] = []
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "tool":
            pending.append(format_tool_response(content))
            continue
        if role == "user" and pending:
            pending.append(content)
            content = ""
        if pending:
            out.append({"role": "user", "content": "\n".join(pending)})
            pending = []
            if not content:
                continue
        if role not in ("system", "user", "assistant"):
            raise ConfigError(f"unknown message role {role!r}; expected system, user, assistant or tool")
        out.append({"role": role, "content": content})
    if pending:
        out.append({"role": "user", "content": "\n".join(pending)})
    return out


def tool_schemas(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The JSON schemas in the system message's ``<tools>`` block (empty when there is none)."""
    for message in messages:
        if message["role"] == "system":
            match = _TOOLS_BLOCK.search(message["content"])
            if match:
                return [json.loads(line) for line in match.group(1).splitlines() if line.strip()]
    return []


def turn_text(message: Mapping[str, Any]) -> str:
    """An OpenAI response message as one assistant turn in toolgym's text form."""
    text = message.get("content") or ""
    for call in message.get("tool_calls") or []:
        function = call.get("function", {})
        raw = function.get("arguments", "{}")
        try:
            arguments = model_json.loads(raw) if isinstance(raw, str) else raw
            body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
        except (model_json.ModelJSONError, RecursionError, TypeError, ValueError):
            # NOTE: kept verbatim so the environment reports the model's malformed call (however deep,
            # long or odd: what the served model wrote is its own parse error, never a crash here).
            name = function.get("name")
            name = name if name is None or isinstance(name, str) else str(name)[:200]
            body = '{"name": ' + json.dumps(name) + ', "arguments": ' + str(raw) + "}"
        text += f"{OPEN}{body}{CLOSE}"
    return text
