"""Reading a run's config: TOML plus dotted overrides, keys of earlier releases, and back to plain data.

A config file mirrors the dataclasses (:class:`~toolgym.training.config.run.RunConfig`); command-line
overrides use dotted keys (``train.steps=3``, ``train.optim.lr=1e-6``, ``sampling.temperature=0.8``)
whose values are parsed as TOML literals (``[["answer"], ["answer", "search"]]``) or taken as strings.
Several ``[[env]]`` tables train on a mixture of environments; overrides address one of them by
position (``env.1.weight=2``). ``[policy]`` is built as the table of its ``kind``. A wrong key fails
at start-up with a :class:`~toolgym.errors.ConfigError` that says "did you mean".

Keys of earlier releases. The flat ``[train]`` keys that now live in sub-tables (``train.lr`` ->
``train.optim.lr``, ``train.lora_rank`` -> ``train.lora.rank``: :data:`RENAMED`) still load for one
release: each is moved to its new place with a warning naming it. A stored run's ``config.json``
written before is read through the same table, silently (:func:`renamed_keys`).
"""

from __future__ import annotations

import dataclasses
import logging
import tomllib
import types
import typing
import warnings
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from toolgym.errors import ConfigError, check_choice, did_you_mean
from toolgym.training.config.policy import POLICY_KINDS, PolicyConfig
from toolgym.training.config.run import RunConfig

__all__ = [
    "RENAMED",
    "json_safe",
    "load_config",
    "renamed_keys",
    "resolve_config_path",
    "resolve_shipped",
    "shipped_configs",
    "to_dict",
]

log = logging.getLogger(__name__)

#: Keys of earlier releases -> where they live now (dotted, from the top of the file).
RENAMED: dict[str, str] = {
    "train.lr": "train.optim.lr",
    "train.weight_decay": "train.optim.weight_decay",
    "train.betas": "train.optim.betas",
    "train.max_grad_norm": "train.optim.max_grad_norm",
    "train.lr_schedule": "train.optim.schedule",
    "train.warmup_steps": "train.optim.warmup_steps",
    "train.min_lr_ratio": "train.optim.min_lr_ratio",
    "train.clip_low": "train.loss.clip_low",
    "train.clip_high": "train.loss.clip_high",
    "train.kl_coef": "train.loss.kl_coef",
    "train.loss_agg": "train.loss.agg",
    "train.loss_constant": "train.loss.constant_norm",
    "train.ratio": "train.loss.ratio",
    "train.dual_clip": "train.loss.dual_clip",
    "train.tis_cap": "train.loss.tis_cap",
    "train.lora_rank": "train.lora.rank",
    "train.lora_alpha": "train.lora.alpha",
    "train.lora_targets": "train.lora.targets",
    "train.lora_dropout": "train.lora.dropout",
    "train.micro_batch": "train.batching.micro_batch",
    "train.share_prefix": "train.batching.share_prefix",
    "train.rollout_workers": "train.rollouts.workers",
    "train.max_off_policy_steps": "train.rollouts.max_off_policy_steps",
    "train.backend": "train.rollouts.backend",
    "train.ray_env_actors": "train.rollouts.ray_env_actors",
    "train.learners": "train.learners.count",  # a number then; a table now
    "train.dist_backend": "train.learners.backend",
    "train.shard": "train.learners.shard",
    "train.learner_timeout": "train.learners.timeout",
    "train.learner_nodes": "train.learners.nodes",
    "train.learner_resources": "train.learners.resources",
    "policy.tiny_hidden": "policy.hidden",
    "policy.tiny_layers": "policy.layers",
}


def renamed_keys(data: Mapping[str, Any], *, warn: bool = False) -> dict[str, Any]:
    """``data`` (a parsed config) with every key of :data:`RENAMED` moved to its new place.

    ``warn``: say so for each (a ``FutureWarning`` and a log line naming the new key), as loading a
    file or override does; a stored run's record is converted silently. A key given both ways is
    refused: which one was meant cannot be known.
    """
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}
    for old, new in RENAMED.items():
        section, key = old.split(".")
        table = out.get(section)
        if not isinstance(table, dict) or key not in table:
            continue
        if old == "train.learners" and isinstance(table[key], Mapping):
            continue  # the table of today
        value = table.pop(key)
        node = out
        *parents, leaf = new.split(".")
        for name in parents:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{old} moved to {new}, but {name} is a value, not a table")
        if leaf in node:
            raise ConfigError(f"{old} and {new} are the same setting, given twice: keep {new}")
        node[leaf] = value
        if warn:
            message = f"config key {old} is now {new} (the old key works for this release; update the file)"
            warnings.warn(message, FutureWarning, stacklevel=3)
            log.warning(message)
    return out


def _renamed_override(key: str, value: Any) -> str:
    """An override's key as it is named today (an override replaces the file's value, however named)."""
    new = RENAMED.get(key)
    if new is None or (key == "train.learners" and isinstance(value, Mapping)):
        return key
    message = f"config key {key} is now {new} (the old key works for this release; update the command)"
    warnings.warn(message, FutureWarning, stacklevel=3)
    log.warning(message)
    return new


def _build_policy(data: Any, prefix: str) -> PolicyConfig:
    if not isinstance(data, Mapping):
        raise ConfigError(f"[{prefix.rstrip('.')}] must be a table of settings, got {data!r}")
    kind = data.get("kind", "hf")
    check_choice("policy.kind", kind, POLICY_KINDS)
    cls = POLICY_KINDS[kind]
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            takes = [k for k, c in POLICY_KINDS.items() if key in {f.name for f in dataclasses.fields(c)}]
            if takes:
                raise ConfigError(
                    f"{prefix}{key} is a setting of policy.kind = {' or '.join(map(repr, takes))}, not {kind!r}"
                )
    built: PolicyConfig = _build(cls, data, prefix)
    return built


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a TOML file (or start from defaults) and apply ``key=value`` overrides.

    Keys of earlier releases (:data:`RENAMED`) are moved to their new place with a warning naming it.
    """
    data: dict[str, Any] = {}
    if path is not None:
        path = resolve_config_path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from exc
    data = renamed_keys(data, warn=True)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.steps=3)")
        value = _parse_value(raw.strip())
        key = _renamed_override(key.strip(), value)
        if key == "policy.kind":
            _switch_policy_kind(data, value)
        _set_dotted(data, key.split("."), value)
    if isinstance(data.get("env"), list):  # [[env]] tables: a mixture
        if "envs" in data:
            raise ConfigError("give the environments as [[env]] tables only (not also as envs)")
        tables = data.pop("env")
        if len(tables) == 1:  # one [[env]] table is a plain [env]
            data["env"] = tables[0]
        else:
            data["envs"] = tables
    return _build(RunConfig, data, "")


def _switch_policy_kind(data: dict[str, Any], kind: Any) -> None:
    """An override ``policy.kind=K`` switches the back-end: the ``[policy]`` settings given before it
    (in the file or earlier overrides) that ``K`` does not take are left out, logged, so
    ``policy.kind=tiny`` works on a config written for vLLM. Settings given after it are checked
    against ``K`` as usual."""
    table = data.get("policy")
    if not isinstance(table, dict) or kind not in POLICY_KINDS or table.get("kind", "hf") == kind:
        return
    takes = {f.name for f in dataclasses.fields(POLICY_KINDS[kind])}
    dropped = [k for k in table if k not in takes]
    for key in dropped:
        del table[key]
    if dropped:
        log.info("policy.kind=%s: the settings %s of the earlier kind are not used", kind, ", ".join(dropped))


def shipped_configs() -> dict[str, Path]:
    """Configs shipped with toolgym, by name (``demo`` -> ``toolgym/training/configs/demo.toml``)."""
    folder = Path(str(resources.files("toolgym.training") / "configs"))
    return {p.stem: p for p in sorted(folder.glob("*.toml"))}


def resolve_config_path(path: str | Path) -> Path:
    """A TOML file path, or the name of a shipped config; unknown names answer "did you mean"."""
    return resolve_shipped(path, shipped_configs(), "config file", "Shipped configs")


def resolve_shipped(path: str | Path, shipped: Mapping[str, Path], what: str, listing: str) -> Path:
    """``path`` when it is a file (it wins over a shipped file of the same name), else the shipped file
    named ``path`` (with or without ``.toml``); else a ConfigError saying ``what`` was not found, with a
    "did you mean" and the shipped names after ``listing``."""
    candidate = Path(path)
    if candidate.is_file():
        return candidate
    name = str(path).removesuffix(".toml")
    if name in shipped:
        return shipped[name]
    raise ConfigError(
        f"{what} not found: {path}.{did_you_mean(str(path), shipped)} "
        f"{listing}: {', '.join(shipped) or 'none'}"
    )


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare word: a string


def _set_dotted(data: dict[str, Any], keys: list[str], value: Any) -> None:
    node: Any = data
    for depth, key in enumerate(keys):
        last = depth == len(keys) - 1
        if isinstance(node, list):  # [[env]] tables: address one by position (env.1.weight=2)
            if not key.isdigit() or int(key) >= len(node):
                raise ConfigError(
                    f"override {'.'.join(keys)}: {'.'.join(keys[:depth])} is a list of {len(node)} tables; "
                    f"address one by its position, e.g. {'.'.join([*keys[:depth], '0', *keys[depth:]][: depth + 2])}"
                )
            key = int(key)  # type: ignore[assignment]
        elif not isinstance(node, dict):
            raise ConfigError(f"override {'.'.join(keys)}: {keys[depth - 1]!r} is a value, not a section")
        if last:
            node[key] = value
        elif isinstance(node, dict):
            node = node.setdefault(key, {})
        else:
            node = node[key]


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"[{prefix.rstrip('.')}] must be a table of settings, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            moved = {
                o.rsplit(".", 1)[1]: n
                for o, n in RENAMED.items()
                if o.startswith(prefix) and o.count(".") == 1
            }
            hint = did_you_mean(key, [*fields, *moved])
            for old, new in moved.items():  # a misspelt key of an earlier release: name today's key
                hint = hint.replace(f"{old!r}?", f"{new!r}?")
            raise ConfigError(
                f"unknown config key {prefix + key!r}.{hint} "
                f"Known keys of [{prefix.rstrip('.') or 'top level'}]: {', '.join(fields)}"
            )
        hint = hints[key]
        args = typing.get_args(hint)
        if hint == PolicyConfig:  # a union of tables, narrowed by its ``kind``
            kwargs[key] = _build_policy(value, f"{prefix}{key}.")
        elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value, f"{prefix}{key}.")
        elif (
            typing.get_origin(hint) is tuple
            and args
            and isinstance(args[0], type)
            and dataclasses.is_dataclass(args[0])
        ):
            if not isinstance(value, list | tuple):
                raise ConfigError(f"{prefix}{key} must be a list of tables, got {value!r}")
            label = "env" if key == "envs" else key  # written as [[env]] tables
            kwargs[key] = tuple(_build(args[0], v, f"{prefix}{label}.{i}.") for i, v in enumerate(value))
        else:
            kwargs[key] = _coerce(value, hint, prefix + key)
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, name: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{name} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{name} must be a list, got {value!r}")
        return _deep_tuple(value)
    if origin in (Mapping, dict) or hint is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{name} must be a table, got {value!r}")
        return dict(value)
    return value


def _deep_tuple(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_deep_tuple(v) for v in value)
    return value


def to_dict(config: Any) -> dict[str, Any]:
    """The config as plain JSON-able data (written next to every run)."""
    return json_safe(dataclasses.asdict(config))


def json_safe(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value
