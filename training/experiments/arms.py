"""Experiment arms: several training runs that differ in one named thing, run and compared as a set.

``toolgym train --config BASE --arms ARMS.toml --out DIR`` trains every arm of ``ARMS.toml`` into an
ordinary run directory ``DIR/<arm>/`` (one after another, on this machine:
:mod:`toolgym.training.experiments.arms_run`), then pairs each arm's held-out evaluation
(``DIR/<arm>/heldout/trained``) with the baseline arm's on the same tasks and seeds
(:mod:`toolgym.training.experiments.arms_results`) and writes ``DIR/arms.json``, ``DIR/arms.md`` and
``DIR/arms.tex``. ``toolgym report DIR`` draws every arm's curves on shared plots
(:mod:`toolgym.training.experiments.arms_report`).

The arms file::

    description = "tool curriculum: progressive unlock vs every tool vs unlock inside the episode"
    config = "learn"             # the base config (a file beside this one, or a shipped name);
                                 # --config on the command line replaces it
    baseline = "progressive"     # every other arm is compared with this one (default: the first)
    allow = []                   # ["env"]: arms may train on other environments (a mixture ablation)

    [set]                        # settings of every arm, over the base config
    warm_start.tools = ["answer", "search"]

    [[arm]]
    name = "progressive"
    [arm.set]                    # this arm's own settings: the same dotted keys as toolgym train KEY=VALUE
    curriculum.stages = [["answer", "search"], ["answer", "search", "open"]]

    [[arm]]
    name = "all-tools"
    set = { "curriculum.stages" = [] }

Settings are layered base config -> ``[set]`` -> command-line ``KEY=VALUE`` -> the arm's ``set``. A
table merges into the config key by key (``env.kwargs = { max_turns = 3 }`` changes ``max_turns``
only, as TOML's dotted keys do); a list or a value replaces.

What the arms share, checked on the resolved configs before any model loads (an arm that changes one
of them is refused, by name): the held-out set (``heldout.n``, ``split``, ``seed``, ``harnesses``,
``kwargs``, token budgets, engine, and the environment it is drawn from), the seeds (``train.seed``),
the training environments and their task selection (unless ``allow = ["env"]``) and the starting
policy (``policy.kind``, ``policy.model``, the tiny model's size). With a warm start the first arm
makes it and every other arm loads it (``warm_start.reuse``), so an arm that changes what decides
the warm start (``warm_start.identity.warm_start_identity``, the first stage's tools) is refused too;
later arms also reuse the first arm's held-out ``base`` and ``control`` evaluations
(``heldout.reuse``) instead of running them again. After each arm trains, its run manifest must pose
the same environment as the first arm's (:func:`toolgym.records.manifest.manifest_differences`).

Resume: ``DIR/arms_plan.json`` holds every arm's resolved config; running the same command again skips
finished arms (``DIR/<arm>/arm.json``), resumes an interrupted one from its checkpoint, and refuses an
arm whose settings changed since it started.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from toolgym.errors import ConfigError, did_you_mean
from toolgym.records.manifest import flatten
from toolgym.records.trackers import check_trackers
from toolgym.registry import check_id
from toolgym.training.config import RunConfig, TinyPolicyConfig, load_config, resolve_shipped, to_dict
from toolgym.training.warm_start.identity import warm_start_identity, warm_start_tools

__all__ = [
    "ALLOWABLE",
    "PLAN",
    "Arm",
    "ArmsPlan",
    "ArmsSpec",
    "command_line",
    "load_arms",
    "plan_arms",
    "resolve_arms_path",
    "shipped_arms",
    "toml_literal",
]

PLAN = "arms_plan.json"
_TOP_KEYS = ("description", "config", "baseline", "allow", "set", "arm")
_ARM_KEYS = ("name", "description", "set")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
#: What ``allow`` may let arms differ in: only the training environments (never the held-out set,
#: the seeds or the starting policy, without which the arms are not paired).
ALLOWABLE = ("env",)
#: Settings the plan may add itself (paths into DIR); left out when a resumed plan is compared.
_INJECTED = ("warm_start.reuse", "heldout.reuse")


@dataclass(frozen=True)
class Arm:
    """One arm: its name and its own settings, as dotted ``KEY=VALUE`` overrides."""

    name: str
    overrides: tuple[str, ...] = ()
    description: str = ""


@dataclass(frozen=True)
class ArmsSpec:
    """An arms file as read (see the module docstring); ``shared`` are the ``[set]`` overrides."""

    path: Path
    arms: tuple[Arm, ...]
    baseline: str
    config: str | None = None
    shared: tuple[str, ...] = ()
    allow: tuple[str, ...] = ()
    description: str = ""


@dataclass(frozen=True)
class ArmsPlan:
    """What the set will run: every arm's overrides (as passed to ``toolgym train``) and resolved config."""

    spec: ArmsSpec
    config_path: str | None
    overrides: Mapping[str, tuple[str, ...]]
    configs: Mapping[str, RunConfig]
    warm_start_from: str | None = None  # the arm whose warm start the others load
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def names(self) -> list[str]:
        return [arm.name for arm in self.spec.arms]


# ----------------------------------------------------------------------------- the file
def shipped_arms() -> dict[str, Path]:
    """Arms files shipped with toolgym, by name (``curriculum`` -> ``training/configs/arms/curriculum.toml``)."""
    folder = Path(str(resources.files("toolgym.training") / "configs" / "arms"))
    return {p.stem: p for p in sorted(folder.glob("*.toml"))}


def resolve_arms_path(path: str | Path) -> Path:
    """An arms file, or the name of a shipped one; unknown names answer "did you mean"."""
    return resolve_shipped(path, shipped_arms(), "arms file", "Shipped arms files")


def toml_literal(value: Any) -> str:
    """``value`` written as a TOML literal, so it round-trips through ``toolgym train KEY=VALUE``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_literal(v)}" for k, v in value.items()) + "}"
    raise ConfigError(f"a setting of type {type(value).__name__} ({value!r}) cannot be an override")


def _overrides(table: Any, where: str) -> tuple[str, ...]:
    """A ``set`` table as ``KEY=VALUE`` overrides: tables merge key by key, lists and values replace."""
    if not isinstance(table, Mapping):
        raise ConfigError(f'{where}: set must be a table of settings (e.g. set = {{ "train.optim.lr" = 0 }})')
    out: list[str] = []

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, Mapping) and value:
                walk(value, dotted + ".")
            else:
                out.append(f"{dotted}={toml_literal(value)}")

    walk(table, "")
    return tuple(out)


def _check_keys(table: Mapping[str, Any], known: Sequence[str], where: str) -> None:
    for key in table:
        if key not in known:
            raise ConfigError(
                f"{where}: unknown key {key!r}.{did_you_mean(key, known)} Known keys: {', '.join(known)}"
            )


def load_arms(path: str | Path) -> ArmsSpec:
    """Read and check an arms file: its arms, names, baseline and keys (not yet the configs).

    Raises:
        ConfigError: not TOML, no arms or only one, an arm without a name, a name used twice or unfit
            for a directory, a baseline that is not an arm, an unknown key (did you mean).
    """
    import tomllib

    path = resolve_arms_path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from exc
    _check_keys(data, _TOP_KEYS, str(path))
    tables = data.get("arm", [])
    if not isinstance(tables, list) or not tables:
        raise ConfigError(
            f"{path} has no arms: add [[arm]] tables, each with a name and the settings it changes "
            '(name = "baseline", then name = "no-curriculum" with set = { "curriculum.stages" = [] })'
        )
    arms: list[Arm] = []
    for i, table in enumerate(tables):
        where = f"{path}: arm #{i + 1}"
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where} must be a table ([[arm]])")
        _check_keys(table, _ARM_KEYS, where)
        name = table.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigError(
                f"{where}: name must be letters, digits, '-' or '_' (it names the arm's run directory), "
                f"got {name!r}"
            )
        if name in (a.name for a in arms):
            raise ConfigError(f"{path}: arm name {name!r} is used twice; each arm needs its own name")
        arms.append(
            Arm(name, _overrides(table.get("set", {}), f"{where} ({name})"), table.get("description", ""))
        )
    if len(arms) < 2:
        raise ConfigError(
            f"{path} has one arm ({arms[0].name!r}): an arms file compares arms with a baseline, so it "
            "needs at least two; for one run use toolgym train without --arms"
        )
    names = [a.name for a in arms]
    baseline = data.get("baseline", names[0])
    if baseline not in names:
        raise ConfigError(
            f"{path}: baseline {baseline!r} is not an arm of the set ({', '.join(names)})."
            f"{did_you_mean(str(baseline), names)}"
        )
    allow = data.get("allow", [])
    if not isinstance(allow, list) or any(a not in ALLOWABLE for a in allow):
        raise ConfigError(
            f"{path}: allow may list only {', '.join(map(repr, ALLOWABLE))} (arms that train on other "
            f"environments), got {allow!r}: the held-out set, the seeds and the starting policy always "
            "stay equal, or the arms are not paired"
        )
    config = data.get("config")
    if config is not None and (path.parent / str(config)).is_file():
        config = str(path.parent / str(config))  # a base config beside the arms file
    return ArmsSpec(
        path=path,
        arms=tuple(arms),
        baseline=baseline,
        config=config,
        shared=_overrides(data.get("set", {}), f"{path}: [set]"),
        allow=tuple(allow),
        description=str(data.get("description", "")),
    )


# ----------------------------------------------------------------------------- the plan and its checks
def _shared(config: RunConfig) -> dict[str, Any]:
    """What every arm must keep equal, as flat dotted keys (``env.*`` is what ``allow = ["env"]`` frees)."""
    hc, pc, held_env = config.heldout, config.policy, config.heldout_env
    envs = [
        {"id": e.id, "kwargs": dict(e.kwargs), "task_limit": e.task_limit, "task_ids": list(e.task_ids)}
        for e in config.envs
    ]
    held: dict[str, Any] = {
        "heldout.split": hc.split,
        "heldout.seed": hc.seed,
        "heldout.harnesses": list(hc.harnesses),
        "heldout.kwargs": dict(hc.kwargs),
        "heldout.max_tokens": hc.max_tokens,
        "heldout.max_total_tokens": hc.max_total_tokens or held_env.max_total_tokens,
        "heldout.engine": hc.engine or ("vllm" if pc.kind == "vllm" else "hf"),
        # the held-out tasks come from one environment (heldout.env, else the first), with the
        # held-out kwargs over its own
        "heldout.env": {"id": held_env.id, "kwargs": {**dict(held_env.kwargs), **dict(hc.kwargs)}},
    }
    values = {
        "heldout.n": hc.n,
        **(held if hc.n else {}),  # without a held-out evaluation there is no held-out set to share
        "train.seed": config.train.seed,
        "policy.kind": pc.kind,
        "policy.model": pc.model,
        "policy.hidden": pc.hidden if isinstance(pc, TinyPolicyConfig) else None,
        "policy.layers": pc.layers if isinstance(pc, TinyPolicyConfig) else None,
    }
    return {**flatten(json.loads(json.dumps(values, default=str))), **_env_keys(envs)}


def _env_keys(envs: list[dict[str, Any]]) -> dict[str, Any]:
    named = {"env": envs[0]} if len(envs) == 1 else {"env": {str(i): e for i, e in enumerate(envs)}}
    return flatten(json.loads(json.dumps(named, default=str)))


def _warm_start_keys(config: RunConfig) -> dict[str, Any]:
    """What decides a warm start (as :func:`~toolgym.training.warm_start.reuse.reused_warm_start` checks it)."""
    out = warm_start_identity(to_dict(config))
    out["the warm start's tools (warm_start.tools, else the first curriculum stage)"] = sorted(
        warm_start_tools(config)
    )
    return out


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _differences(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, ours, theirs)`` where two flattened settings differ (an empty table counts as absent)."""

    def get(flat: Mapping[str, Any], key: str) -> Any:
        value = flat.get(key)
        return None if value == {} else value

    out: list[tuple[str, Any, Any]] = []
    for k in sorted(set(ours) | set(theirs)):
        a, b = get(ours, k), get(theirs, k)
        if a == b:
            continue
        if isinstance(a, Mapping) and isinstance(b, Mapping):  # a table: name the keys that differ in it
            out.extend(
                (f"{k}.{sub}", a.get(sub), b.get(sub))
                for sub in sorted(set(a) | set(b))
                if a.get(sub) != b.get(sub)
            )
        else:
            out.append((k, a, b))
    return out


def _why(key: str) -> str:
    if key.startswith("heldout."):
        return "the held-out set"
    if key.startswith("train.seed"):
        return "the seeds"
    if key.startswith("policy."):
        return "the starting policy"
    return 'the training environment and its tasks (allow = ["env"] lets arms differ there)'


def _resolve(config_path: str | None, overrides: Sequence[str], where: str) -> RunConfig:
    try:
        return load_config(config_path, overrides)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def plan_arms(
    arms_path: str | Path,
    config_path: str | None = None,
    overrides: Sequence[str] = (),
    out_dir: str | Path = "",
) -> ArmsPlan:
    """Resolve every arm's config and check that the arms stay comparable, before any model loads.

    Args:
        arms_path: the arms file (or a shipped name).
        config_path: the base config (``--config``; default: the arms file's ``config``).
        overrides: command-line ``KEY=VALUE`` settings of every arm (over ``[set]``, under the arm's own).
        out_dir: the set's directory (the warm start and held-out evaluations reused by later arms live
            there; a stored plan there must agree with this one).

    Raises:
        ConfigError: a bad arms file (:func:`load_arms`), a bad setting of an arm (named, with "did you
            mean"), an arm that changes what the arms share or what decides their shared warm start
            (named, with both values), two arms with the same settings, an unknown environment id, a
            tracker whose package is missing, or a stored plan with other settings for an arm.
    """

    spec = load_arms(arms_path)
    config_path = config_path if config_path is not None else spec.config
    base = [*spec.shared, *overrides]
    configs = {a.name: _resolve(config_path, [*base, *a.overrides], f"arm {a.name!r}") for a in spec.arms}
    first = spec.arms[0].name
    shared = {name: _shared(c) for name, c in configs.items()}
    for name, config in configs.items():
        wrong = [
            d
            for d in _differences(shared[first], shared[name])
            if not (d[0].startswith("env.") and spec.allow)
        ]
        if wrong:
            raise ConfigError(
                f"arm {name!r} changes what the arms must share with arm {first!r}: "
                + "; ".join(
                    f"{k} ({_short(a)} in {first!r}, {_short(b)} here: {_why(k)})" for k, a, b in wrong
                )
                + ". Arms are paired: the same held-out tasks and seeds, training tasks and starting policy; "
                "keep these equal and change only what the arm is about"
            )
        try:
            for env in config.envs:
                check_id(env.id)
            check_trackers(config.train.loggers)
        except ConfigError as exc:
            raise ConfigError(f"arm {name!r}: {exc}") from None
    seen: dict[str, str] = {}
    for name, config in configs.items():
        key = json.dumps(to_dict(config), sort_keys=True)
        if key in seen:
            raise ConfigError(
                f"arms {seen[key]!r} and {name!r} resolve to the same settings: they would train the same run twice"
            )
        seen[key] = name
    out = Path(out_dir) if out_dir else Path(".")
    final = {a.name: (*base, *a.overrides) for a in spec.arms}
    notes: list[str] = []
    warm_from = None
    lead = configs[first]
    if lead.warm_start.enabled:
        keys = _warm_start_keys(lead)
        for name, config in configs.items():
            wrong = _differences(keys, _warm_start_keys(config))
            if wrong:
                raise ConfigError(
                    f"arm {name!r} changes what decides the warm start the arms share (made by arm {first!r}): "
                    + "; ".join(f"{k} ({_short(a)} in {first!r}, {_short(b)} here)" for k, a, b in wrong)
                    + ". Keep the warm start's settings in [set], or start every arm from one warm-started "
                    "export instead (policy.model = RUN/export/step-000000, no [warm_start])"
                )
        if not lead.warm_start.reuse:
            warm_from = first
            for arm in spec.arms[1:]:
                final[arm.name] = (*final[arm.name], f"warm_start.reuse={toml_literal(str(out / first))}")
            notes.append(f"arm {first!r} makes the warm start; every other arm loads it (warm_start.reuse)")
    if lead.heldout.n:
        reusable = [str(out / first / "heldout" / label) for label in ("base", "control")]
        for arm in spec.arms[1:]:
            theirs = [*configs[arm.name].heldout.reuse, *reusable]
            final[arm.name] = (*final[arm.name], f"heldout.reuse={toml_literal(theirs)}")
    if spec.allow:
        notes.append(f"arms may differ in {', '.join(spec.allow)} (allow)")
    configs = {a.name: _resolve(config_path, final[a.name], f"arm {a.name!r}") for a in spec.arms}
    plan = ArmsPlan(spec, config_path, final, configs, warm_from, tuple(notes))
    if out_dir:
        _check_stored_plan(Path(out_dir), plan)
    return plan


def _comparable(flat: Mapping[str, Any]) -> dict[str, Any]:
    """A flattened config without the settings the plan injects (paths into the set's directory)."""
    return {k: v for k, v in flat.items() if not any(k == i or k.startswith(i + ".") for i in _INJECTED)}


def _check_stored_plan(out_dir: Path, plan: ArmsPlan) -> None:
    """An arm that already started in ``out_dir`` must have the same settings (results of two settings
    never mix in one directory); new arms may join."""
    path = out_dir / PLAN
    if not path.is_file():
        return
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        old = {a["name"]: a["config"] for a in stored["arms"]}
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} is unreadable ({exc}): train the set into a new --out") from None
    defaults = flatten(to_dict(RunConfig()))
    for name, config in plan.configs.items():
        if name not in old or not (out_dir / name).exists():
            continue
        then, now = _comparable(flatten(old[name])), _comparable(flatten(to_dict(config)))
        for key in set(now) - set(then):  # a setting toolgym gained since: at its default, nothing changed
            if key in defaults and now[key] == defaults[key]:
                then[key] = now[key]
        wrong = _differences(then, now)
        if wrong:
            raise ConfigError(
                f"arm {name!r} in {out_dir} was started with other settings: "
                + "; ".join(f"{k} ({_short(a)} there, {_short(b)} now)" for k, a, b in wrong)
                + f". Results of two settings must not mix: train the set into a new --out, or remove {out_dir / name}"
            )


def command_line(plan: ArmsPlan, name: str, out_dir: Path) -> str:
    """The ``toolgym train`` command line that trains (or resumes) one arm on its own."""
    import shlex

    config = ["--config", plan.config_path] if plan.config_path else []
    return shlex.join(["toolgym", "train", *config, "--out", str(out_dir / name), *plan.overrides[name]])
