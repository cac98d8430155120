"""The plain-data codec between a candidate's values and the host: one source for both sides.

The host imports this module; the hidden-test runner copies this file's text into its container and
the per-call driver imports it there, so the two ends cannot drift apart. It must therefore use the
standard library only and run on the image's Python (3.11).

Only plain data crosses (None, bool, int, float, complex, str, bytes, list, tuple, dict, set,
frozenset), nested at most 200 deep. Subclasses are reduced to their built-in base through the base
type's own methods, so a candidate's ``__eq__``, ``__repr__`` or ``__iter__`` override never runs on
the way out; anything else is encoded as ``{"t": "opaque"}``, which the host decodes to a value equal
to nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MAX_DEPTH = 200


def enc(v: Any, depth: int = 0) -> Any:
    """JSON-ready form of plain data; ``TypeError`` for anything else, ``ValueError`` when too deep."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    d = depth + 1
    if v is None or v is True or v is False:
        return v
    if isinstance(v, bool):
        return bool.__bool__(v)
    if isinstance(v, int):
        return {"t": "int", "v": int.__repr__(v)}
    if isinstance(v, float):
        return {"t": "float", "v": float.__repr__(v)}
    if isinstance(v, complex):
        real = float.__repr__(complex.__getattribute__(v, "real"))
        imag = float.__repr__(complex.__getattribute__(v, "imag"))
        return {"t": "complex", "v": [real, imag]}
    if isinstance(v, str):
        return {"t": "str", "v": str.__str__(v)}
    if isinstance(v, bytes | bytearray):
        return {"t": "bytes", "v": bytes(v).hex()}
    if isinstance(v, list):
        return {"t": "list", "v": [enc(x, d) for x in list.__iter__(v)]}
    if isinstance(v, tuple):
        return {"t": "tuple", "v": [enc(x, d) for x in tuple.__iter__(v)]}
    if isinstance(v, dict):
        return {"t": "dict", "v": [[enc(k, d), enc(x, d)] for k, x in dict.items(v)]}
    if isinstance(v, frozenset):
        return {"t": "frozenset", "v": [enc(x, d) for x in frozenset.__iter__(v)]}
    if isinstance(v, set):
        return {"t": "set", "v": [enc(x, d) for x in set.__iter__(v)]}
    raise TypeError("unsupported")


def enc_result(v: Any) -> Any:
    """:func:`enc`, or the opaque marker when ``v`` is not plain data (or fails while encoding)."""
    try:
        return enc(v)
    except Exception:
        return {"t": "opaque"}


def dec(e: Any, opaque: Callable[[], Any] | None = None) -> Any:
    """The value :func:`enc` encoded; the opaque marker becomes ``opaque()`` (an error without it)."""
    if e is None or e is True or e is False:
        return e
    t, v = e["t"], e.get("v")
    if t == "int":
        return int(v)
    if t == "float":
        return float(v)
    if t == "complex":
        return complex(float(v[0]), float(v[1]))
    if t == "str":
        return str(v)
    if t == "bytes":
        return bytes.fromhex(v)
    if t == "list":
        return [dec(x, opaque) for x in v]
    if t == "tuple":
        return tuple(dec(x, opaque) for x in v)
    if t == "dict":
        return {dec(k, opaque): dec(x, opaque) for k, x in v}
    if t == "set":
        return {dec(x, opaque) for x in v}
    if t == "frozenset":
        return frozenset(dec(x, opaque) for x in v)
    if t == "opaque" and opaque is not None:
        return opaque()
    raise ValueError("bad encoding")
