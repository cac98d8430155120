"""The gymnasium spaces of a toolgym environment: chat messages in, raw assistant text out.

Observations are lists of chat messages (dicts of strings with a ``role`` and a ``content``), actions
are the assistant's raw text. Neither is a fixed-shape array, so both spaces are not flattenable;
``sample`` draws short random text for gymnasium's checker.
"""

from __future__ import annotations

import string
from typing import Any

import gymnasium
import numpy as np

from toolgym.core import Message

__all__ = ["MAX_ACTION_CHARS", "MessagesSpace", "TextSpace"]


class MessagesSpace(gymnasium.spaces.Space[list[Message]]):
    """Observation space: a list of chat messages (dicts with string ``role`` and ``content``)."""

    ROLES = ("system", "user", "assistant", "tool")

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def contains(self, x: Any) -> bool:
        return isinstance(x, list) and all(
            isinstance(m, dict)
            and m.get("role") in self.ROLES
            and isinstance(m.get("content"), str)
            and all(isinstance(v, str) for v in m.values())
            for m in x
        )

    def sample(self, mask: Any = None, probability: Any = None) -> list[Message]:
        n = int(self.np_random.integers(1, 3))
        return [
            {"role": "tool", "name": "sample", "content": _random_text(self.np_random, 40)} for _ in range(n)
        ]

    def __repr__(self) -> str:
        return "MessagesSpace()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MessagesSpace)


#: The longest action an environment's action space admits (and every server accepts).
MAX_ACTION_CHARS = 1_000_000


class TextSpace(gymnasium.spaces.Space[str]):
    """Action space: any string up to ``max_length`` characters (the assistant's raw text)."""

    def __init__(self, max_length: int = MAX_ACTION_CHARS, seed: int | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)
        self.max_length = max_length

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        return _random_text(self.np_random, 60)

    def __repr__(self) -> str:
        return f"TextSpace(max_length={self.max_length})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TextSpace) and other.max_length == self.max_length


def _random_text(rng: np.random.Generator, max_len: int) -> str:
    alphabet = string.ascii_letters + string.digits + " .,<>{}\"':"
    n = int(rng.integers(1, max_len))
    return "".join(alphabet[i] for i in rng.integers(0, len(alphabet), size=n))
