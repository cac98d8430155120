"""The warm-start phase of a training run: the weights it starts RL from, sampled and fine-tuned, or reused.

:class:`WarmStartPhase` holds what the phase needs from the run (its config, the sampling policy, the
learner's model and the weights lock, the harness, the training task ids, the progress display) and
:meth:`WarmStartPhase.weights` leaves the warm-started weights in the model: the demonstrations sampled
and fine-tuned on (:mod:`~toolgym.training.warm_start.demonstrations`), or, with ``warm_start.reuse``,
an earlier run's step-0 export loaded (:mod:`~toolgym.training.warm_start.reuse`) or its warm start
rebuilt where that run kept no weights. Either way the weights must have the hash that run recorded
(:func:`~toolgym.training.warm_start.identity.weights_sha256`). What follows (publishing the weights,
the KL reference, the step-0 checkpoint and export) is the trainer's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from toolgym.core import Harness, Policy
from toolgym.errors import ConfigError
from toolgym.training.config import RunConfig
from toolgym.training.learn.lora import base_weights_trainable
from toolgym.training.sampling.workers import env_factory
from toolgym.training.warm_start.demonstrations import (
    WarmStartResult,
    fine_tune,
    reference_demonstrator,
    rejection_sample,
    summarize,
)
from toolgym.training.warm_start.identity import (
    warm_start_env_kwargs,
    warm_start_seed,
    warm_start_tools,
    weights_sha256,
)
from toolgym.training.warm_start.reuse import hash_refusal, load_warm_start, reused_warm_start

if TYPE_CHECKING:
    import torch

__all__ = ["Progress", "WarmStartPhase"]


class Progress(Protocol):
    """What the phase tells the user through (the run's ``RunProgress``): a line, and a task with a bar."""

    def line(self, text: str) -> None: ...

    def task(
        self, name: str, total: float | None = None, completed: float = 0
    ) -> AbstractContextManager[Any]: ...


@dataclasses.dataclass(frozen=True)
class WarmStartPhase:
    """What the warm start takes from its run: ``policy`` samples the demonstrations (or plays the
    reference rule in its tokenizer), ``model`` is fine-tuned under ``lock`` (the policy's weights lock:
    no completion mixes two weight versions), ``task_ids`` are the run's training tasks."""

    config: RunConfig
    policy: Policy
    model: torch.nn.Module
    lock: AbstractContextManager[Any]
    harness: Harness
    task_ids: Sequence[str]
    progress: Progress

    async def weights(self, make_env: Callable[[], Any]) -> WarmStartResult:
        """Leave the configured warm start's weights in ``model`` and return its record, with their hash.

        With ``warm_start.reuse`` the export of an earlier run with the same settings is loaded, or,
        where that run keeps no weights (its result file, or a run directory without its export), the
        warm start is rebuilt here (``make_env`` makes the run's environments).

        Raises:
            ConfigError: the reused or rebuilt weights differ from the recorded ones (both hashes named).
        """
        ws = self.config.warm_start
        started = time.perf_counter()
        result, source = None, None
        if ws.reuse:
            source = reused_warm_start(ws.reuse, self.config)
            if source.export is not None:
                result = load_warm_start(source, self.model)
                self.progress.line(f"warm start: reused {ws.reuse}")
            else:
                self.progress.line(
                    f"warm start: {ws.reuse} keeps no weights; rebuilding its warm start here, checked by "
                    f"its hash {source.sha256[:12]}"
                )
        if result is None:
            result = await self._sample_and_fine_tune(make_env, started)
        digest = weights_sha256(self.model)
        if source is not None and source.sha256 and digest != source.sha256:
            raise ConfigError(hash_refusal(source, digest))
        self.progress.line(
            f"warm start: done in {time.perf_counter() - started:.0f} s (loss by epoch "
            f"{', '.join(f'{loss:.4f}' for loss in result.epoch_losses)}, weights {digest[:12]})"
        )
        return dataclasses.replace(result, weights_sha256=digest)

    async def _sample_and_fine_tune(self, make_env: Callable[[], Any], started: float) -> WarmStartResult:
        """Sample the demonstrations and fine-tune ``model`` on the kept ones."""
        config, ws = self.config, self.config.warm_start
        tools = warm_start_tools(config)
        kwargs = warm_start_env_kwargs(config)
        policy_for = (
            reference_demonstrator(config.env.id, kwargs, self.policy, config.env.reference_rule)
            if ws.source == "reference"
            else None
        )
        free = None
        if ws.kwargs:  # its own environments: the run's kwargs with warm_start.kwargs over them
            make_env, free = env_factory("asyncio", config.env.id, kwargs)
        try:
            with self.progress.task(f"warm start ({ws.source}): episodes") as bar:
                episodes, kept = await rejection_sample(
                    make_env,
                    self.policy,
                    self.harness,
                    self.task_ids,
                    dataclasses.replace(ws, tools=tuple(tools)),
                    seed=warm_start_seed(config) + 1_000_003,
                    max_tokens=config.sampling.max_tokens,
                    max_total_tokens=config.env.max_total_tokens,
                    progress=lambda done, total: bar.update(done, total=total),
                    policy_for=policy_for,
                )
        finally:
            if free is not None:
                free()
        self.progress.line(f"warm start: kept {len(kept)} of {len(episodes)} episodes; fine-tuning")
        with (
            base_weights_trainable(self.model),  # a full fine-tune, adapters or not
            self.progress.task("warm start: fine-tuning steps") as bar,
        ):
            losses = await asyncio.to_thread(
                fine_tune,
                self.model,
                kept,
                ws,
                seed=warm_start_seed(config),
                lock=self.lock,
                progress=lambda done, total: bar.update(done, total=total),
                checkpoint_layers=config.train.batching.checkpoint_layers,
            )
        return summarize(episodes, kept, losses, started, tools=tuple(tools))
