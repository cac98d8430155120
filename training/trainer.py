"""The async GRPO trainer: rollout workers fill a queue while the learner trains (see ARCHITECTURE.md).

One loop, readable top to bottom (:meth:`Trainer.run`): take the next ``tasks_per_step`` groups from
the queue (dropping those more than ``max_off_policy_steps`` policy versions old), compute
group-relative advantages, take one optimizer step on the token-level clipped loss, sync the weights
and bump the policy version, let the curriculum observe the step, write metrics and trajectories,
checkpoint.

Weight sync, by policy. ``hf`` and ``tiny`` policies sample from the learner's own
module, so the sync is the version bump under the policy's weights lock. A ``vllm`` policy serves its
own copy of the weights in an engine process: the learner loads a separate fp32 transformers model of
the same checkpoint (:func:`~toolgym.training.policies.learner_model`) and, after each optimizer
step, pushes it into the engine in place (:class:`~toolgym.training.weight_sync.VLLMWeightSync`:
pause, reload, relabel, resume; from the learner's worker thread, never the engine's event loop); the engine's ``load_weights`` is what
bumps ``policy_version``. A completion that spans a reload reports the oldest weight version it used,
so the staleness of a group is never understated. Policies whose sampled token ids or logprobs are
not exact (``token_exact = False``, e.g. :class:`~toolgym.agents.http_policy.HTTPPolicy`) are refused:
the loss needs the very tokens and the behaviour logprobs of the sampler.

Run directory layout: ``config.json``, ``metrics.jsonl`` (one line per step), ``trajectories.jsonl``
(one line per consumed sample: ``{"step", "group", "sample", "advantage", "trained", "trajectory"}``),
``curriculum.jsonl`` (stage changes) and ``checkpoint.pt``.

NOTE (determinism): with ``max_off_policy_steps = 0`` every group of step ``s`` is sampled with the
weights of version ``s`` and the run is reproducible bit for bit on CPU, including across a kill and
resume. With look-ahead > 0, which version samples a group depends on timing; resumes then lose and
double-count nothing but are not bitwise identical.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from toolgym.agents.harness import get_harness
from toolgym.core import SamplingParams, ServedPolicy, TrainablePolicy
from toolgym.errors import ConfigError
from toolgym.registry import check_id
from toolgym.trackers import Trackers
from toolgym.training.batching import LossSums, micro_batches, pack_batch, plan_step
from toolgym.training.checkpoint import (
    capture_rng,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
    truncate_to,
)
from toolgym.training.config import TrainConfig, to_dict
from toolgym.training.curriculum import ToolCurriculum
from toolgym.training.export import export_checkpoint
from toolgym.training.loss import check_token_receipt, clipped_pg_loss, mismatch_kl
from toolgym.training.mixture import MixtureSampler, mixture_metrics, observe_curricula, probe_env
from toolgym.training.policies import Closable, build_policy, learner_model, require_trainable
from toolgym.training.prefix import SequenceScorer
from toolgym.training.rewards import shaped_reward
from toolgym.training.rollouts import EnvRoute, Group, InfraGuard, RolloutWorkers, env_factory
from toolgym.training.step_log import LOG_FILES, step_metrics, track_step, write_step, write_train_manifest

__all__ = ["Trainer", "build_policy", "shaped_reward"]  # shaped_reward: re-exported

log = logging.getLogger(__name__)


class Trainer:
    """Owns the policy, optimizer, curriculum and run directory; :meth:`run` is the whole loop."""

    def __init__(
        self,
        config: TrainConfig,
        run_dir: str | Path,
        policy: TrainablePolicy | ServedPolicy | None = None,
        trackers: Trackers | None = None,
    ) -> None:
        self.config = config
        self.trackers = trackers if trackers is not None else Trackers()  # the caller closes them
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(config.train.seed)
        for env in config.envs:  # a wrong id stops the run before a model is loaded
            check_id(env.id)
        if policy is not None:
            require_trainable(policy)
        self._owns_policy = policy is None
        self.policy: TrainablePolicy | ServedPolicy = policy if policy is not None else build_policy(config)
        self.weight_sync: Any = None
        try:
            if isinstance(self.policy, TrainablePolicy) and isinstance(self.policy.model, torch.nn.Module):
                self.model: torch.nn.Module = self.policy.model
            elif isinstance(self.policy, ServedPolicy):
                # NOTE (weight sync): the engine serves its own copy; the learner trains this one and
                # pushes it into the engine after every step.
                from toolgym.training.weight_sync import VLLMWeightSync

                self.weight_sync = VLLMWeightSync(self.policy)
                self.model = learner_model(self.policy.model_dir, config.policy.learner_device)
            else:
                raise ConfigError(
                    f"{type(self.policy).__name__}.model is a {type(self.policy.model).__name__}, not a "
                    "torch.nn.Module, and the policy serves no model_dir: there is nothing to train"
                )
        except BaseException:
            self.close()
            raise
        self._weights_lock: AbstractContextManager[Any] = (
            self.policy.weights_lock if isinstance(self.policy, TrainablePolicy) else threading.RLock()
        )
        tc = config.train
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=tc.lr,
            weight_decay=tc.weight_decay,
            betas=tc.betas,
        )
        self.reference = None
        if tc.kl_coef > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        # One curriculum, harness and task list per environment ([[env]] tables; one for a plain [env]).
        self.env_names = [env.name for env in config.envs]
        self.harnesses = [get_harness(env.harness) for env in config.envs]
        self.curricula = [
            ToolCurriculum(
                dataclasses.replace(config.curriculum, stages=env.stages or config.curriculum.stages)
            )
            for env in config.envs
        ]
        self.curriculum, self.harness = self.curricula[0], self.harnesses[0]
        probes = [probe_env(e.id, e.kwargs, e.task_ids, e.task_limit) for e in config.envs]
        self.env_task_ids = [ids for ids, _ in probes]
        if config.is_mixture:
            self.task_ids = [
                f"{n}:{t}" for n, ids in zip(self.env_names, self.env_task_ids, strict=True) for t in ids
            ]
            self.env_fingerprint: dict[str, Any] = {
                "id": "mixture",
                "envs": {n: fp for n, (_, fp) in zip(self.env_names, probes, strict=True)},  # dotted diffs
                "weights": {e.name: e.weight for e in config.envs},
            }
        else:
            self.task_ids, self.env_fingerprint = self.env_task_ids[0], probes[0][1]
        self.sampler = MixtureSampler(
            self.env_task_ids,
            [e.weight for e in config.envs],
            group_size=tc.group_size,
            seed=tc.seed,
            config=config.mixture,
        )
        self.warm_started = False
        self.step = 0
        self.next_group = 0
        self.dropped_groups = 0
        self.infra_guard = InfraGuard(tc.max_infra_groups)
        self.last_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        sizes = {
            name: (self.run_dir / name).stat().st_size if (self.run_dir / name).exists() else 0
            for name in LOG_FILES
        }
        return {
            "step": self.step,
            "next_group": self.next_group,
            "policy_version": self.policy.policy_version,
            "dropped_groups": self.dropped_groups,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "curriculum": self.curriculum.state_dict(),
            "curricula": [c.state_dict() for c in self.curricula],
            "mixture": self.sampler.state_dict(),
            "rng": capture_rng(),
            "log_sizes": sizes,
            "warm_started": self.warm_started,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        saved_curricula = state.get("curricula", [state["curriculum"]])
        if len(saved_curricula) != len(self.curricula):
            raise ConfigError(
                f"{self.run_dir}'s checkpoint trained {len(saved_curricula)} environment(s), the config lists "
                f"{len(self.curricula)}: train into a new --out"
            )
        for curriculum, saved in zip(self.curricula, saved_curricula, strict=True):
            curriculum.load_state_dict(saved)
        if "mixture" in state:
            self.sampler.load_state_dict(state["mixture"])
        self.warm_started = bool(state.get("warm_started", False))
        restore_rng(state["rng"])
        self.step, self.next_group = int(state["step"]), int(state["next_group"])
        version = int(state["policy_version"])
        if self.weight_sync is not None and version != self.policy.policy_version:
            if version < self.policy.policy_version:
                raise ConfigError(
                    f"the vLLM engine already serves version {self.policy.policy_version}, newer than the "
                    f"checkpoint's {version}: resume with a fresh engine"
                )
            self.weight_sync.sync(self.model, version)  # the engine serves the restored weights
        # an engine already at ``version`` is this process's own, which these weights came from
        self.policy.policy_version = version
        self.dropped_groups = int(state["dropped_groups"])
        for name, size in state["log_sizes"].items():
            truncate_to(self.run_dir / name, int(size))

    def close(self) -> None:
        """Release the weight-sync folder, and the policy when this trainer built it. Idempotent."""
        if self.weight_sync is not None:
            self.weight_sync.close()
        if self._owns_policy and isinstance(self.policy, Closable):
            self.policy.close()

    def resume(self) -> bool:
        """Continue from the run directory's checkpoint, if it has one."""
        state = load_checkpoint(self.run_dir)
        if state is None:
            for name in LOG_FILES:  # lines of an attempt that died before its first checkpoint
                truncate_to(self.run_dir / name, 0)
            return False
        self.load_state_dict(state)
        log.info("resumed %s at step %d (next group %d)", self.run_dir, self.step, self.next_group)
        return True

    # ------------------------------------------------------------------ the loop
    async def run(self) -> list[dict[str, float]]:
        """Train until ``train.steps``; returns this call's per-step metrics."""
        tc = self.config.train
        (self.run_dir / "config.json").write_text(json.dumps(to_dict(self.config), indent=2))
        write_train_manifest(
            self.run_dir,
            self.config,
            self.env_fingerprint,
            self.task_ids,
            model_dir=getattr(self.policy, "model_dir", None),
            resuming=self.step > 0 or self.warm_started,
        )
        factories = [
            env_factory(tc.backend, env.id, dict(env.kwargs), ray_env_actors=tc.ray_env_actors)
            for env in self.config.envs
        ]

        def release() -> None:
            for _, free in factories:
                free()

        try:
            await self._warm_start(factories[0][0])  # before any rollout worker samples
        except BaseException:
            release()
            raise
        routes = [
            EnvRoute(make, harness, curriculum.reset_options, env.max_total_tokens)
            for (make, _), harness, curriculum, env in zip(
                factories, self.harnesses, self.curricula, self.config.envs, strict=True
            )
        ]
        workers = RolloutWorkers(
            envs=routes,
            policy=self.policy,
            sampler=self.sampler,
            sampling=SamplingParams(
                max_tokens=self.config.sampling.max_tokens, temperature=self.config.sampling.temperature
            ),
            workers=tc.rollout_workers,
            queue_size=tc.queue_size,
            per_step=tc.tasks_per_step,
            max_ahead=tc.max_off_policy_steps,
            start=self.next_group,
        )
        pending: dict[int, Group] = {}
        history: list[dict[str, float]] = []
        mixed = self.config.is_mixture
        try:
            from rich.progress import Progress

            with Progress(transient=True) as progress:
                bar = progress.add_task("training", total=tc.steps, completed=self.step)
                while self.step < tc.steps:
                    t0 = time.perf_counter()
                    groups, stale = await self._collect(workers, pending)
                    wait = time.perf_counter() - t0
                    t1 = time.perf_counter()
                    learn = await asyncio.to_thread(self._learn, groups)
                    # the mixture's weights move before the gate opens (see training.mixture's NOTE)
                    self.sampler.observe([g.env for g in groups], [g.trajectories for g in groups])
                    # NOTE (staleness): the gate opens only after the update, so with look-ahead 0
                    # every group of the next step is sampled by the new weights.
                    await workers.advance(self.next_group)
                    self.step += 1
                    events = observe_curricula(self.curricula, self.env_names if mixed else None, groups)
                    metrics = step_metrics(
                        groups,
                        learn,
                        config=self.config,
                        step=self.step,
                        policy_version=self.policy.policy_version,
                        stale=stale,
                        dropped_groups=self.dropped_groups,
                        wait=wait,
                        t_learn=time.perf_counter() - t1,
                        curriculum=mixture_metrics(self, groups) if mixed else self.curriculum.metrics(),
                    )
                    names = self.env_names if mixed else None
                    write_step(self.run_dir, self.step, groups, learn, metrics, events, names)
                    track_step(self.trackers, self.step, groups, learn, metrics)
                    self.last_metrics = metrics
                    history.append(metrics)
                    if tc.checkpoint_every and self.step % tc.checkpoint_every == 0 or self.step == tc.steps:
                        save_checkpoint(self.run_dir, self.state_dict())
                        export_checkpoint(self.run_dir, self.model, self.policy, step=self.step)
                    progress.update(
                        bar, completed=self.step, description=f"reward {metrics['reward/mean']:.3f}"
                    )
        finally:
            try:
                await workers.close()
            finally:
                release()
        return history

    async def _warm_start(self, make: Any) -> None:
        """The configured warm start, once per run (:mod:`toolgym.training.warm_start`), checkpointed.

        It runs before the rollout workers sample anything (they wait for version 0 to be consumed),
        ends with a weight sync and a version bump like an RL step, and is saved as a step-0
        checkpoint and export, so a resumed run never repeats it and the warm-started policy can be
        evaluated on its own (``run:DIR@0``).
        """
        ws = self.config.warm_start
        if not ws.enabled or self.warm_started:
            return
        from rich.progress import Progress

        from toolgym.training.warm_start import (
            fine_tune,
            reference_demonstrator,
            rejection_sample,
            summarize,
        )

        started = time.perf_counter()
        policy_for = (
            reference_demonstrator(self.config.env.id, dict(self.config.env.kwargs), self.policy)
            if ws.source == "reference"
            else None
        )
        with Progress(transient=True) as progress:
            bar = progress.add_task(f"warm start ({ws.source}): episodes", total=None)
            episodes, kept = await rejection_sample(
                make,
                self.policy,
                self.harness,
                self.task_ids,
                ws,
                seed=self.config.train.seed + 1_000_003,
                max_tokens=self.config.sampling.max_tokens,
                max_total_tokens=self.config.env.max_total_tokens,
                progress=lambda done, total: progress.update(bar, completed=done, total=total),
                policy_for=policy_for,
            )
        log.info("warm start: kept %d of %d episodes; fine-tuning", len(kept), len(episodes))
        losses = await asyncio.to_thread(
            fine_tune, self.model, kept, ws, seed=self.config.train.seed, lock=self._weights_lock
        )
        with self._weights_lock:
            if self.weight_sync is not None:
                self.weight_sync.sync(self.model, self.policy.policy_version + 1)
            else:
                self.policy.policy_version += 1
        if self.reference is not None:  # the KL anchors to the warm-started policy
            self.reference.load_state_dict(self.model.state_dict())
        self.warm_started = True
        result = summarize(episodes, kept, losses, started)
        result.write(self.run_dir)
        log.info("warm start: %s", result.to_dict())
        save_checkpoint(self.run_dir, self.state_dict())
        export_checkpoint(self.run_dir, self.model, self.policy, step=0)

    async def _collect(
        self, workers: RolloutWorkers, pending: dict[int, Group]
    ) -> tuple[list[Group], list[int]]:
        """The next ``tasks_per_step`` fresh groups, in index order; stale ones are dropped and counted."""
        tc = self.config.train
        groups: list[Group] = []
        staleness: list[int] = []
        while len(groups) < tc.tasks_per_step:
            while self.next_group not in pending:
                error = workers.failed()
                if error is not None:
                    raise error
                try:
                    group = await asyncio.wait_for(workers.queue.get(), timeout=0.5)
                except TimeoutError:
                    continue
                pending[group.index] = group
            group = pending.pop(self.next_group)
            self.infra_guard.observe(group)  # raises InfraDown when the infrastructure stays down
            self.next_group += 1
            age = self.policy.policy_version - group.policy_version
            if age > tc.max_off_policy_steps:
                self.dropped_groups += 1
                await workers.advance(self.next_group)  # a replacement may start now, at this version
                continue
            staleness.append(age)
            groups.append(group)
        return groups, staleness

    def _learn(self, groups: Sequence[Group]) -> dict[str, Any]:
        """One optimizer step on the groups' mask-1 tokens (runs in a thread; the workers keep sampling).

        Plan the step (learner rewards -> group advantages -> the samples that train), accumulate the
        clipped loss's gradient micro-batch by micro-batch, then clip, step and sync the weights. With
        ``train.share_prefix`` each group is scored on its own, its shared prompt prefix computed once
        (:mod:`toolgym.training.prefix`: same logprobs and gradient, a fraction of the compute);
        without it the step's samples stream through micro-batches in order, each a full forward pass.
        """
        tc = self.config.train
        plan = plan_step(
            [g.trajectories for g in groups],
            scales=[self.sampler.scale(g.env) for g in groups],
            format_credit=tc.format_credit,
            answer_tool=tc.answer_tool,
            normalize_std=tc.normalize_std,
            skip_zero_variance=tc.skip_zero_variance,
        )
        for sample in plan.samples:
            check_token_receipt(sample.trajectory)
        total = plan.tokens  # every micro-batch's loss is divided by the step's token count
        sums = LossSums()
        self.optimizer.zero_grad(set_to_none=True)
        for unit in plan.groups if tc.share_prefix else (plan.samples,):
            seqs = [s.trajectory.token_ids for s in unit]
            temperature, share_prefix = self.config.sampling.temperature, tc.share_prefix
            masks = [s.trajectory.loss_mask for s in unit]  # where the loss reads logprobs
            policy = SequenceScorer(
                self.model, seqs, temperature=temperature, share_prefix=share_prefix, masks=masks
            )
            reference = None
            if self.reference is not None:  # the KL's reference model: scored the same way, no graph
                reference = SequenceScorer(
                    self.reference,
                    seqs,
                    grad=False,
                    temperature=temperature,
                    share_prefix=share_prefix,
                    masks=masks,
                )
            for chunk in micro_batches(unit, tc.micro_batch):
                batch = pack_batch(chunk, device=policy.device)
                read = [s.trajectory.loss_mask for s in chunk]
                logp = policy.logprobs(batch.sequences, read)
                terms = clipped_pg_loss(
                    logp,
                    batch.behaviour,
                    batch.advantages,
                    batch.mask,
                    clip_low=tc.clip_low,
                    clip_high=tc.clip_high,
                    kl_coef=tc.kl_coef,
                    logp_ref=None if reference is None else reference.logprobs(batch.sequences, read),
                    num_tokens=total,
                )
                terms.loss.backward()
                sums = sums.add(terms, mismatch_kl(batch.behaviour, logp, batch.mask, total))
            policy.backward()  # the shared prefix's share of the gradient, once per group
        grad_norm = 0.0
        sync: dict[str, float] = {}
        # NOTE (weight sync): an hf/tiny policy samples from this very module; the update and the
        # version bump happen under its weights lock so that no completion mixes two weight versions.
        # A vLLM engine is updated in place (its load_weights sets policy_version); completions that
        # span the reload report their oldest version, so staleness stays conservative.
        with self._weights_lock:
            if plan.samples:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.max_grad_norm))
                self.optimizer.step()
            if self.weight_sync is not None:
                sync = self.weight_sync.sync(self.model, self.policy.policy_version + 1)
            else:
                self.policy.policy_version += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {
            "advantages": plan.advantages,
            "zero_variance": plan.zero_variance,
            "trained": {id(s.episode or s.trajectory) for s in plan.samples},
            **sums.as_dict(),
            "grad_norm": grad_norm,
            "tokens": total,
            "sync": sync,
        }
