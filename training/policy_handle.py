"""The trained policy as the trainer owns it, and the one way new weights reach it: :meth:`PolicyHandle.publish`.

A handle holds the policy that samples, the learner's model, the weights lock and, for a served policy
(vLLM), the weight sync. An ``hf``/``tiny`` policy samples from the learner's very module: every change
of its weights and the version bump happen under the policy's weights lock, so no completion mixes two
weight versions. A served policy keeps its own copy: :meth:`publish` pushes the learner's weights into
it (its ``load_weights`` sets the version). The RL step and the warm start publish through it alike.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from toolgym.core import ServedPolicy, TrainablePolicy
from toolgym.errors import ConfigError
from toolgym.training.weight_sync import VLLMWeightSync

__all__ = ["PolicyHandle"]


class PolicyHandle:
    """The policy, the learner's model, the weights lock and the weight sync (``None`` when the policy
    samples from ``model`` itself)."""

    def __init__(
        self,
        policy: TrainablePolicy | ServedPolicy,
        model: torch.nn.Module,
        weight_sync: VLLMWeightSync | None = None,
    ) -> None:
        self.policy = policy
        self.model = model
        self.weight_sync = weight_sync
        self.lock: AbstractContextManager[Any] = (
            policy.weights_lock if isinstance(policy, TrainablePolicy) else threading.RLock()
        )

    @property
    def version(self) -> int:
        """The weight version the policy samples with."""
        return self.policy.policy_version

    def publish(self, update: Callable[[], bool] | None = None) -> dict[str, float]:
        """Run ``update`` (it changes ``model``'s weights; ``False``: it changed nothing, nothing is
        published) under the weights lock, then make ``model``'s weights the policy's next version.
        Returns the weight sync's timings (empty when the policy samples from ``model``)."""
        with self.lock:
            if update is not None and not update():
                return {}
            if self.weight_sync is not None:
                return self.weight_sync.sync(self.model, self.version + 1)
            self.policy.policy_version += 1
            return {}

    def restore(self, version: int) -> None:
        """After ``model`` was loaded from a checkpoint of weight version ``version``: the policy serves
        those weights as that version.

        Raises:
            ConfigError: a served policy's engine already serves a newer version (it is not this run's).
        """
        if self.weight_sync is not None and version != self.version:
            if version < self.version:
                raise ConfigError(
                    f"the vLLM engine already serves version {self.version}, newer than the "
                    f"checkpoint's {version}: resume with a fresh engine"
                )
            self.weight_sync.sync(self.model, version)  # the engine serves the restored weights
        # an engine already at ``version`` is this process's own, which these weights came from
        self.policy.policy_version = version

    def close(self) -> None:
        """Release the weight sync's folder. Idempotent."""
        if self.weight_sync is not None:
            self.weight_sync.close()
