"""JSON schemas of tools, read off typed Python functions (:meth:`toolgym.core.FunctionTool.from_function`).

A tool's schema is what the model reads about it, so the derivation is exact and its output order
fixed: the description is the docstring before ``Args:``; per parameter ``type`` (from the annotation),
``items`` (for lists), the caller's constraints, ``description`` (from ``Args:``), ``default``; the
parameters without a default are ``required``.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from toolgym.errors import ConfigError

__all__ = ["function_schema"]

_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    dict: "object",
}


def _json_schema(hint: Any, where: str) -> dict[str, Any]:
    """The JSON schema of one annotation (:meth:`FunctionTool.from_function`)."""
    if typing.get_origin(hint) in (list, tuple, Sequence):
        (item, *_) = typing.get_args(hint) or (str,)
        return {"type": "array", "items": _json_schema(item, where)}
    if hint not in _JSON_TYPES:
        raise ConfigError(
            f"{where}: no JSON type for the annotation {hint!r}; use str, int, float, bool or list"
        )
    return {"type": _JSON_TYPES[hint]}


def function_schema(
    fn: Callable[..., Any],
    *,
    constraints: Mapping[str, Mapping[str, Any]] | None = None,
    show_defaults: bool = True,
) -> tuple[str, dict[str, Any]]:
    """``(description, parameters)`` of ``fn``: its docstring's summary and the JSON schema of its arguments.

    Args:
        fn: a function (or bound method) with annotated parameters and a Google-style docstring.
        constraints: extra schema keywords per parameter name (``{"k": {"minimum": 1}}``).
        show_defaults: whether the parameters' defaults appear in the schema.

    Raises:
        ConfigError: a parameter's annotation has no JSON type.
    """
    doc = inspect.getdoc(fn) or ""
    head, _, args_text = doc.partition("\nArgs:\n")
    described: dict[str, str] = {}
    for line in args_text.splitlines():
        entry = re.match(r"    (\w+): (.*)", line)
        if entry:
            described[entry[1]] = entry[2].strip()
        elif line.startswith("     ") and described:
            last = next(reversed(described))
            described[last] += " " + line.strip()
        elif line.strip():
            break  # the next section (Returns:, Raises:)
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required = []
    for param in inspect.signature(fn).parameters.values():
        spec = _json_schema(hints.get(param.name, Any), f"{getattr(fn, '__qualname__', fn)}({param.name})")
        spec.update((constraints or {}).get(param.name, {}))
        if param.name in described:
            spec["description"] = described[param.name]
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
        elif show_defaults:
            spec["default"] = param.default
        properties[param.name] = spec
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return " ".join(head.split()), schema
