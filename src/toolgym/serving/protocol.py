"""What a ``toolgym serve`` reply must hold, checked by its client before anything of it is used.

:class:`toolgym.serving.client.ServedEnv` trusts nothing the server sends: a reply that does not have the
shape :mod:`toolgym.serving.server` documents is the server's fault, an :class:`~toolgym.errors.InfraError`
(the episode ends as ``infra_error``; the run goes on), never an observation, a reward or a crash of
the caller. The rules, per route:

* ``GET /info``: ``env_id`` a non-empty string, ``max_turns`` an integer >= 1, ``task_ids`` a list
  of strings, ``description`` a string, ``fingerprint`` an object;
* ``POST /sessions``: ``session`` 1-128 characters of ``[0-9A-Za-z_-]`` (it becomes part of later
  request paths), ``observation`` a list of messages, ``info`` an object;
* ``POST /sessions/{id}/step``: ``observation`` a list of messages, ``reward`` a finite number
  (not a boolean), ``terminated`` and ``truncated`` booleans, ``info`` an object;
* an error reply: ``{"error": {"type": str, "message": str, "toolgym": bool}}``.

A message is an object whose keys and values are strings (``role`` and ``content`` at least).
"""

from __future__ import annotations

import math
import re
from typing import Any

from toolgym.core import Message
from toolgym.errors import InfraError

__all__ = ["ErrorReply", "check_error", "check_info", "check_reset", "check_step"]

_SESSION = re.compile(r"[0-9A-Za-z_-]{1,128}")


class ErrorReply:
    """A well-formed error reply: the exception's class name, its message, whether it is toolgym's."""

    __slots__ = ("kind", "message", "toolgym")

    def __init__(self, kind: str, message: str, toolgym: bool) -> None:
        self.kind, self.message, self.toolgym = kind, message, toolgym


def _bad(where: str, what: str) -> InfraError:
    return InfraError(f"{where}: the reply breaks the toolgym serve protocol: {what}")


def _fields(data: Any, where: str, names: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise _bad(where, f"expected a JSON object, got {type(data).__name__}")
    missing = [name for name in names if name not in data]
    if missing:
        raise _bad(where, f"missing {', '.join(missing)}")
    return data


def _object(value: Any, where: str, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(where, f"{name} must be an object, got {type(value).__name__}")
    return value


def _messages(value: Any, where: str) -> list[Message]:
    if not isinstance(value, list):
        raise _bad(where, f"observation must be a list of messages, got {type(value).__name__}")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
            raise _bad(where, f"observation[{i}] must be an object with role and content")
        for key, text in message.items():
            if not isinstance(text, str):
                raise _bad(where, f"observation[{i}][{key!r}] must be a string, got {type(text).__name__}")
    return value


def _flag(value: Any, where: str, name: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(where, f"{name} must be true or false, got {value!r:.40}")
    return value


def check_info(data: Any, where: str) -> dict[str, Any]:
    """The ``/info`` reply, checked (see the module docstring)."""
    info = _fields(data, where, ("env_id", "max_turns", "task_ids"))
    if not isinstance(info["env_id"], str) or not info["env_id"]:
        raise _bad(where, f"env_id must be a non-empty string, got {info['env_id']!r:.40}")
    turns = info["max_turns"]
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise _bad(where, f"max_turns must be an integer >= 1, got {turns!r:.40}")
    ids = info["task_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise _bad(where, "task_ids must be a list of strings")
    if not isinstance(info.get("description", ""), str):
        raise _bad(where, "description must be a string")
    _object(info.get("fingerprint", {}), where, "fingerprint")
    return info


def check_reset(data: Any, where: str) -> tuple[str, list[Message], dict[str, Any]]:
    """``(session, observation, info)`` of a ``POST /sessions`` reply, checked."""
    reply = _fields(data, where, ("session", "observation", "info"))
    session = reply["session"]
    if not isinstance(session, str) or not _SESSION.fullmatch(session):
        raise _bad(where, f"session must be 1-128 characters of [0-9A-Za-z_-], got {session!r:.60}")
    return session, _messages(reply["observation"], where), _object(reply["info"], where, "info")


def check_step(data: Any, where: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
    """``(observation, reward, terminated, truncated, info)`` of a step reply, checked."""
    reply = _fields(data, where, ("observation", "reward", "terminated", "truncated", "info"))
    reward = reply["reward"]
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise _bad(where, f"reward must be a finite number, got {reward!r:.40}")
    return (
        _messages(reply["observation"], where),
        float(reward),
        _flag(reply["terminated"], where, "terminated"),
        _flag(reply["truncated"], where, "truncated"),
        _object(reply["info"], where, "info"),
    )


def check_error(data: Any, where: str) -> ErrorReply:
    """The error a non-2xx reply carries; a reply without a well-formed one is a protocol break."""
    error = _fields(data, where, ("error",))["error"]
    if not isinstance(error, dict):
        raise _bad(where, f"error must be an object, got {type(error).__name__}")
    kind, message, toolgym = error.get("type", ""), error.get("message", ""), error.get("toolgym", False)
    if not isinstance(kind, str) or not isinstance(message, str) or not isinstance(toolgym, bool):
        raise _bad(where, "error.type and error.message must be strings, error.toolgym a boolean")
    return ErrorReply(kind, message, toolgym)
