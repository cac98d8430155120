"""A training run's config: frozen dataclasses with the TOML file's shape, loaded from TOML and overrides.

:mod:`run` (:class:`RunConfig`, the whole file, and the checks that span tables), :mod:`train`
(``[train]`` and its sub-tables ``[train.loss]``, ``[train.optim]``, ``[train.lora]``,
``[train.batching]``, ``[train.rollouts]``, ``[train.learners]``), :mod:`policy` (``[policy]``, one
table per ``kind``), :mod:`sections` (``[env]``, ``[sampling]``, ``[curriculum]``, ``[warm_start]``,
``[heldout]``, ``[mixture]``), :mod:`load` (TOML, overrides, keys of earlier releases, back to plain
data) and :mod:`help` (``toolgym train --help-config`` and its JSON schema, from the docstrings). The
tables import no runtime code: every runtime module takes the table it needs, typed.
"""

from __future__ import annotations

from toolgym.training.config.load import (
    RENAMED,
    json_safe,
    load_config,
    renamed_keys,
    resolve_config_path,
    resolve_shipped,
    shipped_configs,
    to_dict,
)
from toolgym.training.config.policy import (
    HFPolicyConfig,
    PolicyConfig,
    TinyPolicyConfig,
    VLLMPolicyConfig,
    VLLMServerPolicyConfig,
)
from toolgym.training.config.run import RunConfig
from toolgym.training.config.sections import (
    CurriculumConfig,
    EnvConfig,
    HeldoutConfig,
    MixtureConfig,
    SamplingConfig,
    WarmStartConfig,
)
from toolgym.training.config.train import (
    BatchingConfig,
    LearnersConfig,
    LoraConfig,
    LossConfig,
    OptimConfig,
    RolloutsConfig,
    TrainConfig,
)

__all__ = [
    "RENAMED",
    "BatchingConfig",
    "CurriculumConfig",
    "EnvConfig",
    "HFPolicyConfig",
    "HeldoutConfig",
    "LearnersConfig",
    "LoraConfig",
    "LossConfig",
    "MixtureConfig",
    "OptimConfig",
    "PolicyConfig",
    "RolloutsConfig",
    "RunConfig",
    "SamplingConfig",
    "TinyPolicyConfig",
    "TrainConfig",
    "VLLMPolicyConfig",
    "VLLMServerPolicyConfig",
    "WarmStartConfig",
    "json_safe",
    "load_config",
    "renamed_keys",
    "resolve_config_path",
    "resolve_shipped",
    "shipped_configs",
    "to_dict",
]
