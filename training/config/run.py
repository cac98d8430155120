"""A whole training run's config (:class:`RunConfig`): its tables, and the checks that span several.

``[env]`` (or several ``[[env]]`` tables: a mixture), ``[policy]``, ``[sampling]``, ``[train]``,
``[curriculum]``, ``[warm_start]``, ``[heldout]`` and ``[mixture]``; each table is its own frozen
dataclass (:mod:`~toolgym.training.config.sections`, :mod:`~toolgym.training.config.policy`,
:mod:`~toolgym.training.config.train`), and what no single table can check is checked here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolgym.errors import ConfigError, did_you_mean
from toolgym.training.config.policy import (
    HFPolicyConfig,
    PolicyConfig,
    VLLMPolicyConfig,
    VLLMServerPolicyConfig,
)
from toolgym.training.config.sections import (
    CurriculumConfig,
    EnvConfig,
    HeldoutConfig,
    MixtureConfig,
    SamplingConfig,
    WarmStartConfig,
)
from toolgym.training.config.train import TrainConfig

__all__ = ["RunConfig", "check_mixture"]


@dataclass(frozen=True)
class RunConfig:
    """A whole training run: every table of its TOML file."""

    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=HFPolicyConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
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
        budget = self.train.batching.micro_batch_tokens
        for env in self.envs:
            if 0 < budget < env.max_total_tokens:
                raise ConfigError(
                    f"train.batching.micro_batch_tokens ({budget}) is smaller than one sequence of env "
                    f"{env.name!r} can be (max_total_tokens = {env.max_total_tokens}): raise it to at least "
                    f"{env.max_total_tokens}, or set 0 to batch by train.batching.micro_batch alone"
                )
            if (
                isinstance(self.policy, VLLMPolicyConfig | VLLMServerPolicyConfig)
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


def check_mixture(config: RunConfig) -> None:
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
