"""Registry of toolgym environments under versioned gymnasium ids (``toolgym/<Name>-v<N>``).

The table below is the single list of environments. Entry points are strings, so importing toolgym
imports no environment module (and none of their optional dependencies). A behaviour change to an
environment bumps its version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gymnasium

from toolgym.errors import ConfigError, did_you_mean

__all__ = ["ENVIRONMENTS", "EnvEntry", "check_id", "env_ids", "make", "register_all"]


@dataclass(frozen=True)
class EnvEntry:
    id: str
    entry_point: str
    description: str


ENVIRONMENTS: tuple[EnvEntry, ...] = (
    EnvEntry(
        "toolgym/SearchQA-v0",
        "toolgym.envs.search_qa:SearchQAEnv",
        "Question answering with search(query, k) and open(doc_id) over a local BM25 index (XQuAD + Wikipedia).",
    ),
    EnvEntry(
        "toolgym/ArxivRefs-v0",
        "toolgym.envs.arxiv_refs:ArxivRefsEnv",
        "Reconstruct a paper's related-work citations with search_papers/read_paper over a fixed collection (unarXive).",
    ),
    EnvEntry(
        "toolgym/CodeExec-v0",
        "toolgym.envs.code_exec:CodeExecEnv",
        "Write Python functions (HumanEval/MBPP): python(code) in a Docker sandbox, submit(code) to hidden tests.",
    ),
)


def register_all() -> None:
    """Register every environment with gymnasium (idempotent)."""
    for entry in ENVIRONMENTS:
        if entry.id not in gymnasium.registry:
            gymnasium.register(id=entry.id, entry_point=entry.entry_point)


def env_ids() -> list[str]:
    return [e.id for e in ENVIRONMENTS]


def make(env_id: str, **kwargs: Any) -> gymnasium.Env:
    """``gymnasium.make`` with a "did you mean" answer for unknown ids.

    Any id registered with gymnasium works (your own environments too, once their module is imported).
    """
    check_id(env_id)
    return gymnasium.make(env_id, **kwargs)


def check_id(env_id: str) -> None:
    """Raise :class:`ConfigError` with a suggestion unless ``env_id`` is registered."""
    register_all()
    if env_id not in gymnasium.registry:
        raise ConfigError(
            f"unknown environment id {env_id!r}.{did_you_mean(env_id, [*env_ids(), *gymnasium.registry])} "
            f"toolgym registers: {', '.join(env_ids())} (see `toolgym envs`)"
        )
