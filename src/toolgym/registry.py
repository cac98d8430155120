"""Registry of toolgym environments under versioned gymnasium ids (``toolgym/<Name>-v<N>``).

The table below is the single list of environments. Entry points are strings, so importing toolgym
imports no environment module (and none of their optional dependencies). A behaviour change to an
environment bumps its version.

:func:`make` is the one way toolgym builds an environment from an id (the CLI, evaluation and the
trainer all come here): an unknown id is a :class:`~toolgym.errors.ConfigError` with "did you mean",
and the environment boundary's retry settings may ride along with the environment's own arguments.
An ``http(s)://host:port`` id names an environment served by ``toolgym serve``
(:class:`toolgym.serving.client.ServedEnv`): every caller of :func:`make` accepts one.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import gymnasium
from gymnasium.envs.registration import load_env_creator

from toolgym.env import RetryPolicy
from toolgym.errors import ConfigError, did_you_mean

#: The client of ``toolgym serve`` that an ``http(s)://`` id builds (an entry point, as for environments:
#: the core names the serving layer and never imports it).
SERVED_ENTRY_POINT = "toolgym.serving.client:ServedEnv"


def is_remote_id(env_id: str) -> bool:
    """Whether an environment id names a ``toolgym serve`` server (an ``http(s)://`` URL)."""
    return env_id.startswith(("http://", "https://"))


__all__ = [
    "ENVIRONMENTS",
    "RETRY_KWARGS",
    "SERVED_ENTRY_POINT",
    "EnvEntry",
    "check_id",
    "env_attribute",
    "env_creator",
    "env_ids",
    "env_reference_rule",
    "explicit_kwargs",
    "is_remote_id",
    "make",
    "register_all",
]

#: Keyword arguments :func:`make` takes for the environment boundary's
#: :class:`~toolgym.env.RetryPolicy` instead of passing them to the environment's constructor.
RETRY_KWARGS = ("infra_retries", "infra_backoff_s")


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

    Any id registered with gymnasium works (your own environments too, once their module is imported,
    or named in gymnasium's ``module:id`` form). ``kwargs`` go to the environment, except
    ``infra_retries`` and ``infra_backoff_s``, which set the environment boundary's
    :class:`~toolgym.env.RetryPolicy` (so ``env.kwargs.infra_retries=4`` works for any toolgym
    environment, in-process or on Ray actors).

    Raises:
        ConfigError: an unknown id (with "did you mean"), or retry settings for an environment that
            is not a :class:`~toolgym.env.ToolEnv`.
    """
    if is_remote_id(env_id):  # a `toolgym serve` server
        served: gymnasium.Env = env_creator(env_id)(env_id, **kwargs)
        return served
    check_id(env_id)
    retry = {key.removeprefix("infra_"): kwargs.pop(key) for key in RETRY_KWARGS if key in kwargs}
    env = gymnasium.make(env_id, **kwargs)
    if retry:
        if not hasattr(env.unwrapped, "retry"):
            env.close()
            raise ConfigError(f"{env_id} is not a toolgym ToolEnv: it takes no {', '.join(sorted(retry))}")
        env.unwrapped.retry = RetryPolicy(**retry)
    return env


def check_id(env_id: str) -> None:
    """Raise :class:`ConfigError` with a suggestion unless ``gymnasium.make`` would find ``env_id``.

    In gymnasium's ``module:id`` form the module is imported first (it registers the id), as
    ``gymnasium.make`` does.
    """
    if is_remote_id(env_id):
        return  # a served environment: the server checks its own id when it starts
    register_all()
    module, sep, name = env_id.rpartition(":")
    if sep:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(
                f"environment id {env_id!r} names module {module!r}, which cannot be imported ({exc}); "
                "fix the module name or run from the folder that holds it"
            ) from exc
    try:
        gymnasium.spec(name)
    except gymnasium.error.Error:
        raise ConfigError(
            f"unknown environment id {name!r}.{did_you_mean(name, [*env_ids(), *gymnasium.registry])} "
            f"toolgym registers: {', '.join(env_ids())} (see `toolgym envs`)"
        ) from None


def explicit_kwargs(env_id: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` without the arguments given at the environment's own default: SearchQA's
    ``retriever="bm25"`` named or left out builds the same environment, so records of the two compare.
    As given when the environment's constructor cannot be read (an unknown or served id)."""
    try:
        parameters = inspect.signature(env_creator(env_id)).parameters
    except (ConfigError, TypeError, ValueError):
        return dict(kwargs)
    empty = inspect.Parameter.empty
    return {
        k: v
        for k, v in kwargs.items()
        if k not in parameters or parameters[k].default is empty or parameters[k].default != v
    }


def env_creator(env_id: str) -> Any:
    """What builds the environment ``env_id`` (its class, mostly), found without importing it statically.

    A served environment (an ``http(s)://`` id) is built by :data:`SERVED_ENTRY_POINT`; any other id by
    its gymnasium entry point. Raises :class:`ConfigError` for an unknown id (see :func:`check_id`).
    """
    check_id(env_id)
    if is_remote_id(env_id):
        return load_env_creator(SERVED_ENTRY_POINT)
    entry_point = gymnasium.spec(env_id.rpartition(":")[2]).entry_point
    return load_env_creator(entry_point) if isinstance(entry_point, str) else entry_point


def env_attribute(env_id: str, attribute: str) -> Any:
    """An attribute of the module that defines a registered environment (``None`` when it has none).

    Found through gymnasium's registry by name (``baseline_rule``, ``reference_rule``,
    ``audit_exploits``), so callers never import an environment module statically. A served
    environment (an ``http(s)://`` id) has none here: its module lives on the server.
    """
    if is_remote_id(env_id):
        return None
    if ":" in env_id:  # gymnasium's "module:id" form: importing the module registers the id
        module_name, env_id = env_id.split(":", 1)
        importlib.import_module(module_name)
    entry_point = gymnasium.spec(env_id).entry_point
    module = entry_point.__module__ if not isinstance(entry_point, str) else entry_point.split(":")[0]
    return getattr(importlib.import_module(module), attribute, None)


def env_reference_rule(env_id: str, env_kwargs: Mapping[str, Any], name: str = "") -> tuple[str, Any]:
    """``(name, rule_for)``: the environment module's reference rule called ``name`` (``rule_for(task)``
    gives a scripted demonstration of ``task``).

    A module lists its rules in ``REFERENCE_RULES`` (name -> ``rule_for``) and may name the one for a
    configuration in ``default_reference_rule(env_kwargs)`` (SearchQA: the reformulating rule for its
    hard questions); a module with only a ``reference_rule`` has that one, called ``"reference"``.
    ``name`` empty: the module's default, else its first rule.

    Raises:
        ConfigError: the module has no reference rule, or none called ``name`` (the ones it has named).
    """
    listed = env_attribute(env_id, "REFERENCE_RULES")
    if listed is None:
        single = env_attribute(env_id, "reference_rule")
        listed = {"reference": single} if single is not None else {}
    rules = dict(listed)
    if not rules:
        raise ConfigError(
            f"{env_id}'s module has no reference rule (REFERENCE_RULES or reference_rule(task)): the warm "
            "start's reference demonstrations and the reference task pool need one"
        )
    if not name:
        pick = env_attribute(env_id, "default_reference_rule")
        name = str(pick(dict(env_kwargs))) if pick is not None else next(iter(rules))
    if name not in rules:
        raise ConfigError(
            f"env.reference_rule = {name!r}: {env_id} has no such reference rule.{did_you_mean(name, rules)} "
            f"Its rules: {', '.join(rules)}"
        )
    return name, rules[name]
