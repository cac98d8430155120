"""Reading user-supplied data files with errors that name the file and line."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from toolgym.errors import ConfigError

__all__ = [
    "UniqueIds",
    "iter_jsonl",
    "iter_records",
    "json_error",
    "read_jsonl",
    "require_id",
    "require_text",
]


def json_error(exc: json.JSONDecodeError) -> str:
    """``exc`` as "<what> at column N" (some of Python's messages already end in "at": not repeated)."""
    return f"{exc.msg.removesuffix(' at')} at column {exc.colno}"


class _NotJSON(ValueError):
    """``NaN``, ``Infinity`` or ``-Infinity``: Python's reader accepts them, JSON does not."""


def _refuse_constant(name: str) -> Any:
    raise _NotJSON(name)


def iter_jsonl(path: str | Path, *, what: str = "file") -> Iterator[tuple[int, Any]]:
    """Yield ``(line number, parsed JSON)`` for each non-blank line of a JSONL (or ``.jsonl.gz``) file.

    Raises :class:`~toolgym.errors.ConfigError` naming ``file:line`` for a line that is not JSON (``NaN``
    and ``Infinity`` included: they are not JSON, and a NaN would reach a reward) or that nests too
    deeply to read, and naming the file when it is missing, unreadable or not UTF-8 (``what`` says what the file is).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such {what}")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line, parse_constant=_refuse_constant)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{path}:{lineno}: not valid JSON ({json_error(exc)})") from None
                except _NotJSON as exc:
                    raise ConfigError(
                        f"{path}:{lineno}: not valid JSON ({exc} is not a JSON value)"
                    ) from None
                except RecursionError:
                    raise ConfigError(
                        f"{path}:{lineno}: the record nests too deeply to read (arrays or objects inside "
                        "each other hundreds of levels down); flatten it"
                    ) from None
                except ValueError as exc:  # e.g. a number past Python's integer-string limit
                    raise ConfigError(f"{path}:{lineno}: not readable JSON ({exc})"[:500]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except (OSError, EOFError) as exc:
        raise ConfigError(f"{path}: cannot read the {what} ({exc})") from None


def iter_records(
    path: str | Path, *, required: Sequence[str] = (), kind: str = "record"
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line number, JSON object)`` for each record of a JSONL file (``.gz`` allowed).

    Blank lines are skipped. A line that is not a JSON object, or lacks a required key, raises
    :class:`~toolgym.errors.ConfigError` naming ``file:line`` and what was expected. The line number
    lets callers name ``file:line`` in their own checks (duplicate ids, bad field values).
    """
    for lineno, record in iter_jsonl(path):
        if not isinstance(record, dict):
            raise ConfigError(
                f"{path}:{lineno}: expected a JSON object per line, got {type(record).__name__}"
            )
        missing = [key for key in required if key not in record]
        if missing:
            raise ConfigError(
                f"{path}:{lineno}: {kind} lacks {', '.join(map(repr, missing))} (each line needs {', '.join(required)})"
            )
        yield lineno, record


def read_jsonl(
    path: str | Path, *, required: Sequence[str] = (), kind: str = "record"
) -> Iterator[dict[str, Any]]:
    """The JSON objects of :func:`iter_records`, without their line numbers."""
    for _, record in iter_records(path, required=required, kind=kind):
        yield record


def require_text(record: dict[str, Any], key: str, where: str, kind: str = "record") -> str:
    """``record[key]`` if it is a non-empty string; :class:`ConfigError` naming ``where`` otherwise."""
    value = record[key]
    if not isinstance(value, str) or not value.strip():
        got = "an empty string" if isinstance(value, str) else f"{type(value).__name__} {_short(value)}"
        raise ConfigError(f"{where}: {kind} field {key!r} must be a non-empty string, got {got}")
    return value


def require_id(record: dict[str, Any], where: str, kind: str = "record") -> str:
    """``record["id"]`` as a string: a string or an integer; :class:`ConfigError` naming ``where`` otherwise."""
    value = record["id"]
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        raise ConfigError(f"{where}: {kind} 'id' must be a string or an integer, got {_short(value)}")
    return str(value)


def _short(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, dict | list) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class UniqueIds:
    """The ids a loader has read from one file, each with its line: a repeated id names both lines."""

    def __init__(self, path: str | Path, kind: str = "") -> None:
        self.path, self.kind = path, f"{kind} " if kind else ""
        self._lines: dict[str, int] = {}

    def add(self, key: str, lineno: int) -> None:
        """Record ``key`` read at ``lineno``; :class:`ConfigError` when an earlier line had it."""
        first = self._lines.setdefault(key, lineno)
        if first != lineno:
            raise ConfigError(
                f"{self.path}:{lineno}: duplicate {self.kind}id {key!r} (first used at line {first}); "
                "ids must be unique"
            )
