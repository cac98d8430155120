"""Tool-call parsing: assistant text -> :class:`ParsedTurn`. Total over what a model writes: it never
raises for the model's text (a fault of ours, such as a missing package, does raise: see :func:`parse`).

Default format (Hermes / Qwen)::

    <tool_call>{"name": "search", "arguments": {"query": "Super Bowl 50", "k": 3}}</tool_call>

An answer may also be given as ``<answer>...</answer>``. Parsing and validating a call are one stage;
running it is the environment's (a second stage with its own error type, ``ToolCallError``). Every
malformed call becomes a :class:`~toolgym.errors.ToolParseError` *value* in ``ParsedTurn.errors`` whose
``observation()`` is shown to the model; nothing here ends an episode.

Tool results travel back the same way for every model: each ``tool`` message is shown as
``<tool_response>\n{result}\n</tool_response>`` (:func:`format_tool_response`), and rule-based
policies read them back out of a rendered transcript with :func:`tool_responses`. Chat templates,
HTTP servers and environments' scripted baselines all use these two functions, so the chat format is
written down once.

Other model families write calls in other syntaxes (Llama 3's bare JSON, Mistral's ``[TOOL_CALLS]``,
gpt-oss's harmony recipients). Each syntax is a :class:`CallFormat`: it cuts the calls out of a turn
(:meth:`CallFormat.split`), writes one (``format_call``) and describes the tools (``tools_prompt``);
:func:`parse` validates what it cut out, the same way for every syntax. The default is :data:`HERMES`,
the format above; the others and their registry are in :mod:`toolgym.call_formats`.

The parser and the response format live in the core (not in ``toolgym.agents``) because environments
parse their actions and may not depend on agents (see ARCHITECTURE.md, "Dependency rule");
``toolgym.agents`` re-exports the parser.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from toolgym import model_json
from toolgym.errors import InfraError, MissingDependencyError, ToolParseError, did_you_mean

__all__ = [
    "HERMES",
    "CallFormat",
    "CallKeys",
    "HermesCalls",
    "ParsedTurn",
    "RawCall",
    "ToolCall",
    "format_tool_call",
    "format_tool_response",
    "parse",
    "tool_responses",
    "tools_system_prompt",
]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_RESPONSE = re.compile(re.escape(RESPONSE_OPEN) + r"\n(.*?)\n" + re.escape(RESPONSE_CLOSE), re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|\Z)", re.DOTALL)
#: Longest accepted tool call (characters between the tags). Larger calls are refused, not parsed.
MAX_CALL_CHARS = 65_536


@dataclass(frozen=True)
class ToolCall:
    """A validated call: ``arguments`` already satisfy the tool's JSON schema."""

    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn split into free text, valid calls, errors, and an ``<answer>`` if present."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[ToolParseError, ...] = field(default=())
    answer: str | None = None


@dataclass(frozen=True)
class RawCall:
    """One call as a syntax cut it out of a turn, not yet validated.

    ``body`` is JSON text: the whole call object (``{"name": ..., "arguments": {...}}``) when ``name`` is
    None, or only the arguments object when the syntax writes the name outside the JSON (a harmony
    recipient, Mistral's ``name[ARGS]{...}``).
    """

    body: str
    name: str | None = None


@dataclass(frozen=True)
class CallKeys:
    """The keys of a syntax's call object: ``arguments`` (named in error messages), other accepted
    spellings of it, and keys that are allowed and ignored (an id the model writes)."""

    arguments: str = "arguments"
    aliases: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()


class CallFormat(Protocol):
    """A tool-call syntax: how a model family writes calls, and how its tools are shown to it.

    ``split`` is total: it returns the calls it found (unvalidated), the turn's text outside them, and
    the errors of the syntax itself (an unclosed tag, a call written in another registered syntax);
    :func:`parse` validates each call. ``format_call`` writes one call as a well-behaved model would
    (worked examples, scripted policies); ``tools_prompt`` is the system text that lists the tools as
    this family expects them and shows how to call one. ``name`` is its key in
    :mod:`toolgym.call_formats`.
    """

    @property
    def name(self) -> str: ...

    @property
    def keys(self) -> CallKeys: ...

    def split(self, text: str) -> tuple[list[RawCall], str, list[ToolParseError]]: ...

    def format_call(self, name: str, arguments: Mapping[str, Any]) -> str: ...

    def tools_prompt(self, schemas: list[dict[str, Any]]) -> str: ...


@dataclass(frozen=True)
class HermesCalls:
    """The default syntax: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen,
    SmolLM2). Text in another syntax is plain text here, as it always was."""

    name: str = "hermes"
    keys: CallKeys = CallKeys()

    def split(self, text: str) -> tuple[list[RawCall], str, list[ToolParseError]]:
        errors: list[ToolParseError] = []
        bodies, content = _split_blocks(text, errors)
        return [RawCall(body) for body in bodies], content, errors

    def format_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        return format_tool_call(name, arguments)

    def tools_prompt(self, schemas: list[dict[str, Any]]) -> str:
        return tools_system_prompt(schemas)


#: The default call format (every environment's, unless the policy's chat format says otherwise).
HERMES = HermesCalls()


def tools_system_prompt(schemas: list[dict[str, Any]]) -> str:
    """The Hermes-style system text that lists tools and shows the call format with one example."""
    lines = [
        "You are a helpful assistant that can call tools.",
        "You may call one tool per turn. The tools are described as JSON schemas inside <tools></tools>:",
        "<tools>",
        *(json.dumps(s, ensure_ascii=False) for s in schemas),
        "</tools>",
        "To call a tool, reply with a JSON object inside <tool_call></tool_call> tags, for example:",
    ]
    if schemas:
        fn = schemas[0]["function"]
        example = {k: _example_value(v) for k, v in fn["parameters"].get("properties", {}).items()}
        lines.append(format_tool_call(fn["name"], example))
    lines.append("Tool results come back in messages from the tool. Call the answer tool when you are done.")
    return "\n".join(lines)


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """Render a call in the default format (what a well-behaved model writes)."""
    return f"{OPEN}{json.dumps({'name': name, 'arguments': dict(arguments)}, ensure_ascii=False)}{CLOSE}"


def format_tool_response(content: str) -> str:
    """One tool result as the model reads it (the Hermes / Qwen convention).

    Chat templates render each ``tool`` message this way, so a model trained on those families reads
    results where it expects them; :func:`tool_responses` is the inverse.
    """
    return f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"


def tool_responses(transcript: str) -> list[str]:
    """The tool results shown in a rendered transcript, in order (the inverse of :func:`format_tool_response`).

    For rule-based policies that read a decoded conversation (scripted baselines, demonstrations): they
    depend on this function, not on the tags, so environments never parse the agents' chat format by hand.
    """
    return _RESPONSE.findall(transcript)


def _example_value(schema: Mapping[str, Any]) -> Any:
    return {"integer": 3, "number": 1.0, "boolean": True, "array": [], "object": {}}.get(
        schema.get("type", ""), "..."
    )


def parse(
    text: str | bytes,
    tools: Mapping[str, Mapping[str, Any]],
    *,
    max_calls: int = 1,
    max_call_chars: int = MAX_CALL_CHARS,
    call_format: CallFormat | None = None,
) -> ParsedTurn:
    """Parse one assistant turn.

    Args:
        text: the raw assistant text (``bytes`` are decoded as UTF-8; undecodable bytes are an error).
        tools: tool name -> JSON schema of its parameters (the tools allowed in this episode).
        max_calls: calls allowed per turn; the first ``max_calls`` valid calls are kept.
        max_call_chars: longest call accepted.
        call_format: the syntax calls are written in (default :data:`HERMES`).

    Returns:
        A :class:`ParsedTurn`: whatever the model wrote, its mistakes are values, never exceptions.

    Raises:
        MissingDependencyError: a package the validation needs is not installed (ours to fix; showing
            the model an error for it would score every episode 0 and blame the model).
        InfraError: the parser itself failed (a toolgym bug) or a tool's schema is not valid JSON
            Schema: the episode ends as ``infra_error``, never scored or trained on, and a run that
            keeps hitting it stops (``InfraDown``). Never for what the model wrote: whatever fails
            while reading its text (JSON, numbers past Python's limits, nesting, Unicode, validating
            its arguments against a valid schema; :mod:`toolgym.model_json`) is its parse error, so
            a model cannot turn its failures into left-out episodes.
    """
    try:
        syntax = HERMES if call_format is None else call_format
        return _parse(text, tools, max_calls=max_calls, max_call_chars=max_call_chars, syntax=syntax)
    except ImportError as exc:
        raise MissingDependencyError.from_import_error(exc, "Validating a tool call's arguments") from exc
    except InfraError:
        raise
    except Exception as exc:  # noqa: BLE001 - a bug of ours is never the model's parse error
        raise InfraError(
            f"the tool-call parser failed on this turn ({type(exc).__name__}: {exc}); this is a toolgym "
            "bug, not the model's mistake, so the episode is not scored"
        ) from exc


def _parse(
    text: str | bytes,
    tools: Mapping[str, Mapping[str, Any]],
    *,
    max_calls: int,
    max_call_chars: int,
    syntax: CallFormat,
) -> ParsedTurn:
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            return ParsedTurn(
                content="", errors=(ToolParseError(f"the turn is not valid UTF-8 (byte {exc.start})"),)
            )
    if not isinstance(text, str):
        return ParsedTurn(
            content="", errors=(ToolParseError(f"expected the turn as text, got {type(text).__name__}"),)
        )
    if _has_surrogates(text):
        return ParsedTurn(
            content="", errors=(ToolParseError("the turn contains invalid Unicode (a lone surrogate)"),)
        )
    if not text.strip():
        return ParsedTurn(
            content=text, errors=(ToolParseError("empty turn: write a tool call or an answer"),)
        )

    raw_calls, content, errors = syntax.split(text)
    calls: list[ToolCall] = []
    for raw in raw_calls:
        call = _parse_call(raw, tools, max_call_chars, errors, syntax.keys)
        if call is not None:
            calls.append(call)
    if len(calls) > max_calls:
        errors.append(
            ToolParseError(
                f"too many tool calls in one turn (got {len(calls)}, at most {max_calls}); "
                f"only the first {max_calls} ran"
            )
        )
        calls = calls[:max_calls]
    match = _ANSWER.search(content)
    answer = match.group(1).strip() if match else None
    return ParsedTurn(content=content.strip(), calls=tuple(calls), errors=tuple(errors), answer=answer)


def _split_blocks(text: str, errors: list[ToolParseError]) -> tuple[list[str], str]:
    """Cut ``<tool_call>`` blocks out of the text; report unclosed, nested and stray tags."""
    bodies: list[str] = []
    outside: list[str] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        stray = text.find(CLOSE, pos)
        if stray != -1 and (start == -1 or stray < start):
            errors.append(ToolParseError(f"found {CLOSE} without a matching {OPEN}"))
            outside.append(text[pos:stray])
            pos = stray + len(CLOSE)
            continue
        if start == -1:
            outside.append(text[pos:])
            break
        outside.append(text[pos:start])
        end, whole = _call_end(text, start + len(OPEN))
        if end == -1:
            errors.append(ToolParseError(f"unclosed {OPEN} tag: end the call with {CLOSE}"))
            break
        body = text[start + len(OPEN) : end]
        if not whole and OPEN in body:
            errors.append(ToolParseError(f"nested {OPEN} tags: put one JSON object in each {OPEN}...{CLOSE}"))
            depth_end = end + len(CLOSE)
            # Skip the outer block entirely, including a second closing tag if the nesting had one.
            nxt_open, nxt_close = text.find(OPEN, depth_end), text.find(CLOSE, depth_end)
            if nxt_close != -1 and (nxt_open == -1 or nxt_close < nxt_open):
                depth_end = nxt_close + len(CLOSE)
            pos = depth_end
            continue
        bodies.append(body)
        pos = end + len(CLOSE)
    return bodies, "".join(outside)


def _call_end(text: str, body_start: int) -> tuple[int, bool]:
    """Where the call opened at ``body_start`` ends (the index of its ``</tool_call>``, -1 if unclosed),
    and whether its body is one whole JSON object.

    A body that starts with a JSON object which decodes completely and is followed by the closing tag
    ends there, so a literal ``</tool_call>`` (or ``<tool_call>``) inside one of its strings is text,
    not a tag; any other body ends at the first closing tag, as it always did.
    """
    i = body_start
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    if text.startswith("{", i):
        try:
            _, j = model_json.raw_decode(text, i)
        except model_json.ModelJSONError:
            pass
        else:
            while j < len(text) and text[j] in " \t\r\n":
                j += 1
            if text.startswith(CLOSE, j):
                return j, True
    return text.find(CLOSE, body_start), False


def _parse_call(
    raw: RawCall,
    tools: Mapping[str, Mapping[str, Any]],
    max_call_chars: int,
    errors: list[ToolParseError],
    keys: CallKeys,
) -> ToolCall | None:
    body, args = raw.body, keys.arguments
    if len(body) > max_call_chars:
        errors.append(
            ToolParseError(f"tool call too long ({len(body)} characters; at most {max_call_chars})")
        )
        return None
    body = body.strip()
    shape = f'{{"name": ..., "{args}": {{...}}}}'
    if not body and raw.name is None:
        errors.append(ToolParseError(f"empty tool call: expected {shape}"))
        return None
    try:
        # the syntax may write the name outside the JSON: then the body is the arguments (none: {})
        obj = (
            model_json.loads(body)
            if raw.name is None
            else {"name": raw.name.strip(), args: model_json.loads(body or "{}")}
        )
    except model_json.ModelJSONError as exc:  # however the model's text fails to decode, it is the model's
        errors.append(ToolParseError(f"tool call {exc}"))
        return None
    if not isinstance(obj, dict):
        errors.append(ToolParseError(f"tool call must be a JSON object {shape}, got {_json_type(obj)}"))
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        errors.append(ToolParseError('tool call has no "name" string'))
        return None
    accepted = (args, *keys.aliases)
    extra_keys = sorted(set(obj) - {"name", *accepted, *keys.ignored})
    spelled = [k for k in accepted if k in obj]
    if extra_keys or len(spelled) > 1:
        errors.append(
            ToolParseError(
                f"unexpected key(s) {', '.join(map(repr, extra_keys or spelled[1:]))} in the call; expected "
                f"only name and {args}",
                tool=name,
            )
        )
        return None
    if name not in tools:
        hint = did_you_mean(name, tools)
        available = ", ".join(sorted(tools)) or "none"
        errors.append(ToolParseError(f"unknown tool {name!r}.{hint} Available tools: {available}"))
        return None
    arguments = obj.get(spelled[0], {}) if spelled else {}
    if isinstance(arguments, str):  # OpenAI style: arguments as a JSON-encoded string
        try:
            arguments = model_json.loads(arguments)
        except model_json.ModelJSONError as exc:
            errors.append(ToolParseError(f"{args} is a string that {exc}", tool=name))
            return None
    if not isinstance(arguments, dict):
        errors.append(ToolParseError(f"{args} must be a JSON object, got {_json_type(arguments)}", tool=name))
        return None
    check_schema(tools[name])  # the schema is ours: a fault in it is never the model's
    try:
        if _has_surrogates(json.dumps(arguments, ensure_ascii=False)):
            errors.append(ToolParseError("arguments contain invalid Unicode (a lone surrogate)", tool=name))
            return None
        problem = schema_problem(arguments, tools[name])
    except RecursionError:
        errors.append(ToolParseError("arguments nest too deeply: write a flat JSON object", tool=name))
        return None
    except ImportError:
        raise  # a package of ours is missing: never the model's mistake
    except Exception as exc:  # noqa: BLE001 - the validator failed on the model's values, against a valid schema
        errors.append(
            ToolParseError(f"arguments cannot be checked ({type(exc).__name__}: {exc})"[:300], tool=name)
        )
        return None
    if problem:
        errors.append(ToolParseError(problem, tool=name))
        return None
    return ToolCall(name=name, arguments=arguments)


_CHECKED_SCHEMAS: set[str] = set()


def check_schema(schema: Mapping[str, Any]) -> None:
    """Check a tool's parameter schema once (by its JSON text) against JSON Schema's metaschema.

    Raises:
        InfraError: the schema is not valid JSON Schema (the tool's author's fault, never the model's).
    """
    key = json.dumps(schema, sort_keys=True, default=str)
    if key in _CHECKED_SCHEMAS:
        return
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(dict(schema))
    except jsonschema.exceptions.SchemaError as exc:
        raise InfraError(
            f"a tool's parameter schema is not valid JSON Schema ({exc.message}); fix the tool's schema"
        ) from exc
    _CHECKED_SCHEMAS.add(key)


def schema_problem(arguments: Mapping[str, Any], schema: Mapping[str, Any]) -> str | None:
    """Describe the first way ``arguments`` break ``schema`` (extra keys refused by default), or None."""
    properties = schema.get("properties", {})
    if schema.get("additionalProperties", False) is False:
        extra = sorted(set(arguments) - set(properties))
        if extra:
            allowed = ", ".join(sorted(properties)) or "none"
            return f"unexpected argument {extra[0]!r} (allowed: {allowed})"
    for key in schema.get("required", []):
        if key not in arguments:
            return f"missing required argument {key!r}"
    import jsonschema  # imported on first use: it costs a tenth of a second, and most imports never validate

    validator = jsonschema.Draft202012Validator(dict(schema))
    error = jsonschema.exceptions.best_match(validator.iter_errors(dict(arguments)))
    if error is None:
        return None
    where = ".".join(str(p) for p in error.absolute_path) or "arguments"
    if error.validator == "type":
        expected = (
            error.validator_value
            if isinstance(error.validator_value, str)
            else " or ".join(error.validator_value)
        )
        return f"argument {where!r} must be {expected}, got {_json_type(error.instance)}"
    return f"argument {where!r}: {error.message}"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__
    )


def _has_surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
