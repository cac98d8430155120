"""JSON the model wrote, decoded so that every way it can fail is the model's mistake.

A model's tool call is untrusted text: it may nest 20,000 deep, hold a number of 5,000 digits (past
Python's integer-string limit), write ``NaN``, ``Infinity`` or ``1e999`` (not JSON, or not a finite
number), or anything else that makes a JSON reader raise. Every such failure arises while reading the
model's text, so it is the model's parse error (shown to it and scored), never a fault of ours: a
model that could turn its failures into left-out episodes would raise its own score. :func:`loads`
and :func:`raw_decode` raise only :class:`ModelJSONError`, with a message written for the model.
"""

from __future__ import annotations

import json
import math
from typing import Any

from toolgym.data import json_error

__all__ = ["ModelJSONError", "loads", "raw_decode"]


class ModelJSONError(ValueError):
    """The model's text is not JSON toolgym accepts; ``str()`` is the reason, worded for the model to
    follow its subject ("tool call is not valid JSON: ...", "tool call nests too deeply: ...")."""


def _constant(name: str) -> Any:
    raise ModelJSONError(f"writes {name}, which is not JSON: write a number")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ModelJSONError(f"holds the number {text[:20]}{'...' if len(text) > 20 else ''}, out of range")
    return value


_DECODER = json.JSONDecoder(parse_constant=_constant, parse_float=_float)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ModelJSONError):
        return str(exc)
    if isinstance(exc, json.JSONDecodeError):
        return f"is not valid JSON: {json_error(exc)}" + (f" of line {exc.lineno}" if exc.lineno > 1 else "")
    if isinstance(exc, RecursionError):
        return "nests too deeply: write a flat JSON object"
    if isinstance(exc, ValueError) and "digits" in str(exc):
        return "holds a number with too many digits"
    return f"cannot be read as JSON ({type(exc).__name__})"


def raw_decode(text: str, pos: int = 0) -> tuple[Any, int]:
    """The JSON value that starts at ``text[pos]`` and where it ends (``json.JSONDecoder.raw_decode``).

    Raises:
        ModelJSONError: anything that stops the value from being read.
    """
    try:
        return _DECODER.raw_decode(text, pos)
    except Exception as exc:  # noqa: BLE001 - the model's text, however it fails to decode, is the model's
        raise ModelJSONError(_reason(exc)) from None


def loads(text: str) -> Any:
    """``text`` (the whole of it) as one JSON value.

    Raises:
        ModelJSONError: anything that stops it from being read.
    """
    try:
        return _DECODER.decode(text)
    except Exception as exc:  # noqa: BLE001 - the model's text, however it fails to decode, is the model's
        raise ModelJSONError(_reason(exc)) from None
