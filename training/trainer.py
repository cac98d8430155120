"""The async GRPO trainer (see ARCHITECTURE.md): rollout workers sample while the learner trains.

One loop, readable top to bottom (:meth:`Trainer.run`):

1. **collect** the step's groups from the workers, in index order: a group sampled more than
   ``max_off_policy_steps`` versions ago is dropped (stale); with ``dynamic_sampling`` a group without
   reward variance is dropped too and a replacement admitted, until ``tasks_per_step`` informative
   groups or ``max_groups_per_step`` drawn;
2. **learn** (:mod:`toolgym.training.learn.grpo`): rewards, advantages, plan, the loss's gradient;
3. **publish**: wait for every group admitted at the current weights to finish (so each group is
   sampled by one version, whatever the scheduling), take the optimizer step, sync the weights and
   bump the version;
4. **observe**: the curricula, the mixture's weights and the task filter see the step's groups, and
   the next groups are admitted; write metrics and trajectories, checkpoint, and every
   ``heldout.every`` steps put a point on the held-out curve.

Weight sync, by policy. ``hf`` and ``tiny`` policies sample from the learner's own module, so the
sync is the version bump under the policy's weights lock. A ``vllm`` policy serves its own copy in an
engine process: the learner loads a separate fp32 transformers model of the same checkpoint
(:func:`~toolgym.training.policy_build.learner_model`) and pushes it into the engine in place after each
step (:class:`~toolgym.training.weight_sync.VLLMWeightSync`); the engine's ``load_weights`` is what
bumps ``policy_version``. Policies whose sampled token ids or logprobs are not exact (``token_exact =
False``, e.g. :class:`~toolgym.agents.policies.http.HTTPPolicy`) are refused.

Run directory layout: ``config.json``, ``metrics.jsonl`` (one line per step), ``trajectories.jsonl``
(one line per consumed sample: ``{"step", "group", "sample", "advantage", "trained", "trajectory"}``,
plus ``"dropped"`` for a group dynamic sampling or staleness left out), ``curriculum.jsonl`` (stage
changes), ``heldout_curve.jsonl`` and ``checkpoint.pt``.

NOTE (determinism): the learner admits every group, labelled with the weight version of that moment,
and drains them before it publishes the next version (:class:`~toolgym.training.sampling.workers.RolloutWorkers`),
so which weights sample which group never depends on timing, look-ahead included: two runs of one
config sample the same groups with the same weights, and with a policy whose sampling does not
depend on batch composition (``tiny``) they are identical bit for bit. A resume is exact with
``max_off_policy_steps = 0``; with look-ahead the groups sampled ahead at the checkpoint are sampled
again by the checkpoint's weights.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from toolgym.agents.eval.evaluate import left_out_warning
from toolgym.agents.policies.vllm_log import ENGINE_LOG
from toolgym.core import SamplingParams, ServedPolicy, TrainablePolicy
from toolgym.errors import CheckpointError, ConfigError
from toolgym.procs import descendants, record_processes, stop_leftovers
from toolgym.records.trackers import Trackers
from toolgym.registry import check_id
from toolgym.run_files import write_atomic
from toolgym.training.checkpoint import (
    capture_rng,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
    truncate_to,
)
from toolgym.training.config import RunConfig, to_dict
from toolgym.training.config.policy import EngineConfig
from toolgym.training.distributed.learners import LearnerGroup
from toolgym.training.export import export_checkpoint
from toolgym.training.heldout.curve import curve_point
from toolgym.training.learn.grpo import StepPlan, StepResult, StepSettings, plan_step
from toolgym.training.learn.lora import apply_lora
from toolgym.training.learn.loss import LossSums
from toolgym.training.learn.optim import LearnerOptimizer
from toolgym.training.learn.rewards import shaped_reward
from toolgym.training.learn.step_guard import StepGuard, nonfinite_logprobs
from toolgym.training.memory_estimate import MemoryEstimate, estimate_memory, out_of_memory
from toolgym.training.policy_build import Closable, build_policy, learner_model, require_trainable
from toolgym.training.policy_handle import PolicyHandle
from toolgym.training.progress import RunProgress
from toolgym.training.sampling.collect import StepCollector
from toolgym.training.sampling.mixture import MixtureSampler, RunEnvs, mixture_metrics, observe_curricula
from toolgym.training.sampling.reward_control import shuffled_references
from toolgym.training.sampling.task_filter import PassRateFilter, task_pool
from toolgym.training.sampling.workers import EnvRoute, Group, RolloutWorkers, env_factory
from toolgym.training.step_log import (
    LOG_FILES,
    group_records,
    step_metrics,
    track_step,
    write_step,
    write_train_manifest,
)
from toolgym.training.warm_start.phase import WarmStartPhase
from toolgym.training.weight_sync import VLLMWeightSync, file_dtype

__all__ = ["Trainer", "build_policy", "shaped_reward"]  # shaped_reward: re-exported

log = logging.getLogger(__name__)


class Trainer:
    """Owns the policy, optimizer, curriculum and run directory; :meth:`run` is the whole loop."""

    def __init__(
        self,
        config: RunConfig,
        run_dir: str | Path,
        policy: TrainablePolicy | ServedPolicy | None = None,
        trackers: Trackers | None = None,
        progress: RunProgress | None = None,
    ) -> None:
        self.config = config
        self.trackers = trackers if trackers is not None else Trackers()  # the caller closes them
        self.progress = progress if progress is not None else RunProgress()
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(config.train.seed)
        for env in config.envs:  # a wrong id stops the run before a model is loaded
            check_id(env.id)

        # checked before a model loads; the processes start at the first step
        self.learners = LearnerGroup.for_run(config, self.run_dir)
        if policy is not None:
            require_trainable(policy)
        self._owns_policy = policy is None
        self.policy: TrainablePolicy | ServedPolicy = policy if policy is not None else self._start_policy()
        weight_sync: VLLMWeightSync | None = None
        tc = config.train
        try:
            if isinstance(self.policy, TrainablePolicy) and isinstance(self.policy.model, torch.nn.Module):
                self.model: torch.nn.Module = self.policy.model
            elif isinstance(self.policy, ServedPolicy):
                # NOTE (weight sync): the engine serves its own copy; the learner trains this one and
                # pushes it into the engine after every step.

                dtype = file_dtype(config.policy.dtype, config.policy.learner_device)
                base = config.policy.weights_dir if isinstance(config.policy, EngineConfig) else ""
                weight_sync = VLLMWeightSync(self.policy, dtype=dtype, base=base or None)
                self.model = learner_model(self.policy.model_dir, config.policy.learner_device)
            else:
                raise ConfigError(
                    f"{type(self.policy).__name__}.model is a {type(self.policy.model).__name__}, not a "
                    "torch.nn.Module, and the policy serves no model_dir: there is nothing to train"
                )
            apply_lora(self.model, tc.lora, seed=tc.seed)  # no-op at lora_rank = 0
        except BaseException:
            if weight_sync is not None:
                weight_sync.close()
            self.close()
            raise
        self.handle = PolicyHandle(self.policy, self.model, weight_sync)
        self.optimizer = LearnerOptimizer.from_config(self.model.parameters(), tc.optim, tc.steps)
        self.reference = None
        if tc.loss.kl_coef > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.memory = self._estimate_memory()
        envs = RunEnvs.of(config)  # one curriculum, harness and task list per environment
        self.env_names, self.harnesses, self.curricula = envs.names, envs.harnesses, envs.curricula
        self.env_task_ids, self.task_ids, self.env_fingerprint = envs.by_env, envs.task_ids, envs.fingerprint
        self.curriculum, self.harness = self.curricula[0], self.harnesses[0]
        self.sampler = MixtureSampler(
            self.env_task_ids,
            [e.weight for e in config.envs],
            group_size=tc.group_size,
            seed=tc.seed,
            config=config.mixture,
        )
        self.task_filter = (
            PassRateFilter(format_credit=tc.format_credit, answer_tool=tc.answer_tool)
            if tc.task_filter == "pass_rate"
            else None
        )
        self.warm_started = False
        self.step = 0
        self.curve_steps: list[int] = []  # steps with a held-out curve point
        self.collector = StepCollector(config.train, self.progress)
        self.guard = StepGuard(self.run_dir, tc.max_nonfinite_steps)
        self.last_metrics: dict[str, float] = {}
        #: train.reward_control = "shuffled": task id -> the task whose reference scores its episodes
        self.score_as: dict[str, str] | None = None
        if tc.reward_control == "shuffled":  # refused here, before any rollout or warm start
            try:
                if config.is_mixture:
                    raise ConfigError(
                        "train.reward_control = 'shuffled' is for a run on one environment, not a mixture"
                    )
                self.score_as = shuffled_references(self.task_ids, tc.seed)
            except ConfigError:
                self.close()
                raise

    def _start_policy(self) -> TrainablePolicy | ServedPolicy:
        """Build the config's policy; record the processes it started (a private per-user record, see
        toolgym.procs) after stopping those an earlier, killed run in this directory left running."""
        if stopped := stop_leftovers(self.run_dir):
            message = (
                f"stopped {len(stopped)} process(es) an earlier run in {self.run_dir} started and left "
                f"running when it was killed (pids {', '.join(map(str, stopped))}: its policy's engine)"
            )
            log.warning(message)
            self.progress.line(message)
        before = descendants()
        policy = build_policy(self.config, log_file=self.run_dir / ENGINE_LOG)
        record_processes(self.run_dir, descendants() - before)
        return policy

    def _estimate_memory(self) -> MemoryEstimate | None:
        """Tell the user what the config will take (:mod:`toolgym.training.memory_estimate`); a model
        the probe cannot run gets a warning, not a stopped run (the estimate is advice)."""
        try:
            estimate = estimate_memory(self.config, self.model)
        except Exception as exc:  # noqa: BLE001 - the estimate is advice; the run does not depend on it
            message = f"no memory estimate: a probe forward pass of the learner's model failed ({exc!r})"
            log.warning(message)
            self.progress.warn(message)
            return None
        log.info(estimate.describe())
        self.progress.note(estimate.describe())
        return estimate

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        sizes = {
            name: (self.run_dir / name).stat().st_size if (self.run_dir / name).exists() else 0
            for name in LOG_FILES
        }
        return {
            "step": self.step,
            **self.collector.state_dict(),  # next_group, dropped_groups, groups_seen
            "policy_version": self.policy.policy_version,
            "model": self.model.state_dict(),
            "optimizer": self.learners.optimizer_state(self.optimizer),  # sharded: gathered
            "curriculum": self.curriculum.state_dict(),
            "curricula": [c.state_dict() for c in self.curricula],
            "mixture": self.sampler.state_dict(),
            "task_filter": self.task_filter.state_dict() if self.task_filter else None,
            "curve_steps": list(self.curve_steps),
            "rng": capture_rng(),
            "log_sizes": sizes,
            "warm_started": self.warm_started,
            "learners": self.learners.world,
            "guard": self.guard.state_dict(),
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
        if self.task_filter is not None and state.get("task_filter"):
            self.task_filter.load_state_dict(state["task_filter"])
        self.curve_steps = [int(s) for s in state.get("curve_steps", [])]
        self.collector.load_state_dict(state)
        saved_world = int(state.get("learners", 1))
        if saved_world != self.learners.world:  # a checkpoint is rank 0's whole state: any size resumes
            self.progress.line(
                f"resuming a checkpoint written with {saved_world} learner(s) on {self.learners.world}"
            )
        self.warm_started = bool(state.get("warm_started", False))
        self.guard.load_state_dict(state.get("guard", {}))
        restore_rng(state["rng"])
        self.step = int(state["step"])
        version = int(state["policy_version"])
        self.handle.restore(version)
        sizes = _log_sizes(state.get("log_sizes"), self.run_dir)
        for name, size in sizes.items():
            truncate_to(self.run_dir / name, size)
        for name in set(LOG_FILES) - set(sizes):  # a log newer than the checkpoint
            truncate_to(self.run_dir / name, 0)

    def close(self, *, keep_policy: bool = False) -> None:
        """Release the weight-sync folder, and the policy when this trainer built it (unless
        ``keep_policy``: the caller takes it over, e.g. the held-out evaluation its vLLM engine), and stop
        the other learner processes. Idempotent."""
        learners = getattr(self, "learners", None)
        if learners is not None:
            learners.close()
        handle = getattr(self, "handle", None)  # none when the start failed before it was made
        if handle is not None:
            handle.close()
        if self._owns_policy and not keep_policy and isinstance(self.policy, Closable):
            self.policy.close()

    def resume(self) -> bool:
        """Continue from the run directory's checkpoint, if it has one."""
        state = load_checkpoint(self.run_dir)
        if state is None:
            for name in LOG_FILES:  # lines of an attempt that died before its first checkpoint
                truncate_to(self.run_dir / name, 0)
            return False
        self.load_state_dict(state)
        log.info("resumed %s at step %d (next group %d)", self.run_dir, self.step, self.collector.next_group)
        return True

    # ------------------------------------------------------------------ the loop
    async def run(self) -> list[dict[str, float]]:
        """Train until ``train.steps``; returns this call's per-step metrics.

        The phases: the run's records, what comes before the first rollout (the warm start, the curve's
        first point, the task pool), the rollout workers, then :meth:`_step` until the last step.
        """
        tc = self.config.train
        self._write_records()
        factories = [
            env_factory(
                tc.rollouts.backend, env.id, dict(env.kwargs), ray_env_actors=tc.rollouts.ray_env_actors
            )
            for env in self.config.envs
        ]

        def release() -> None:
            for _, free in factories:
                free()

        try:
            await self._before_rollouts(factories[0][0])
        except BaseException:
            release()
            raise
        workers = self._rollout_workers([make for make, _ in factories])
        self.collector.start(workers, self.policy.policy_version)
        history: list[dict[str, float]] = []
        try:
            with self.progress.task("training", total=tc.steps, completed=self.step) as bar:
                while self.step < tc.steps:
                    history.append(await self._step(workers))
                    bar.update(self.step, note=_step_note(history[-1]))
            self.learners.finish(self.model, self.step)  # every learner ends with rank 0's weights
        finally:
            try:
                await workers.close()
            finally:
                release()
        return history

    def _write_records(self) -> None:
        """The run's config and run manifest, written (again) at every start."""
        write_atomic(self.run_dir / "config.json", json.dumps(to_dict(self.config), indent=2))
        write_train_manifest(
            self.run_dir,
            self.config,
            self.env_fingerprint,
            self.task_ids,
            model_dir=getattr(self.policy, "model_dir", None),
            resuming=self.step > 0 or self.warm_started,
        )

    async def _before_rollouts(self, make_env: Callable[[], Any]) -> None:
        """The warm start (before any rollout worker samples), the curve's first point and the task pool."""
        await self.warm_start(make_env)
        if self.config.heldout.every and self.step == 0:
            await self._curve()
        pool = await task_pool(self.config, self.run_dir, self.task_ids, self.progress, self.policy)
        if pool is not None:
            self.sampler.samplers[0].task_ids = pool

    async def warm_start(self, make_env: Callable[[], Any]) -> None:
        """The configured warm start, once (a resumed run never repeats it): its weights, published like an
        RL step's, the KL's anchor, and a step-0 checkpoint and export, so the warm-started policy can be
        evaluated on its own (``run:DIR@0``; the held-out control arm)."""
        if not self.config.warm_start.enabled or self.warm_started:
            return
        phase = WarmStartPhase(
            self.config, self.policy, self.model, self.handle.lock, self.harness, self.task_ids, self.progress
        )
        result = await phase.weights(make_env)
        self.optimizer.reload_masters()  # a bf16 model's fp32 masters still hold the weights before it
        self.handle.publish()
        if self.reference is not None:
            self.reference.load_state_dict(self.model.state_dict())
        self.warm_started = True
        result.write(self.run_dir)
        save_checkpoint(self.run_dir, self.state_dict())
        export_checkpoint(self.run_dir, self.model, self.policy, step=0)

    def _rollout_workers(self, makes: Sequence[Callable[[], Any]]) -> RolloutWorkers:
        """The workers that sample every environment's episodes with the training policy."""
        routes = [
            EnvRoute(make, harness, self._options_for(curriculum), env.max_total_tokens)
            for make, harness, curriculum, env in zip(
                makes, self.harnesses, self.curricula, self.config.envs, strict=True
            )
        ]
        return RolloutWorkers(
            envs=routes,
            policy=self.policy,
            sampler=self.sampler,
            sampling=SamplingParams(
                max_tokens=self.config.sampling.max_tokens, temperature=self.config.sampling.temperature
            ),
            workers=self.config.train.rollouts.workers,
            start=self.collector.next_group,
            skip=self.task_filter.skip if self.task_filter is not None else None,
        )

    async def _step(self, workers: RolloutWorkers) -> dict[str, float]:
        """One step: collect the groups, learn from them, let the samplers and curricula see them, log,
        measure the curve when due, admit the next wave, write the step and checkpoint when due."""
        tc, hc = self.config.train, self.config.heldout
        t0 = time.perf_counter()
        kept, stale, dropped = await self.collector.collect(
            workers, self.policy.policy_version, self.step + 1
        )
        wait, t1 = time.perf_counter() - t0, time.perf_counter()
        result = await self._learn(kept, workers)
        guarded = self.guard.observe(self.step + 1, result.skipped, [g.trajectories for g in kept])
        drawn = [*kept, *(g for g, why in dropped if why != "stale")]
        # the mixture's weights and the task filter move before the next groups are admitted
        self.sampler.observe([g.env for g in drawn], [g.trajectories for g in drawn])
        if self.task_filter is not None:
            self.task_filter.observe([(g.task_id, g.trajectories) for g in drawn])
        self.step += 1
        mixed = self.config.is_mixture
        names = self.env_names if mixed else None
        events = observe_curricula(self.curricula, names, drawn)
        records = group_records(kept, result, dropped)
        curriculum = (
            mixture_metrics(
                self.env_names, self.curricula, self.sampler, self.config.curriculum.success_threshold, drawn
            )
            if mixed
            else self.curriculum.metrics()
        )
        if self.task_filter is not None:
            curriculum = {**curriculum, **self.task_filter.metrics()}
        metrics = step_metrics(
            records,
            result,
            config=self.config,
            step=self.step,
            policy_version=self.policy.policy_version,
            stale=stale,
            dropped_groups=self.collector.dropped_groups,
            wait=wait,
            t_learn=time.perf_counter() - t1,
            curriculum=curriculum,
        )
        metrics.update(guarded)
        episodes = [t for r in records for t in r.group.trajectories]
        left_out = sum(t.status == "infra_error" for t in episodes)
        if warning := left_out_warning(f"step {self.step}", left_out, len(episodes)):
            self.progress.warn(warning)
        # the curve before the next wave is admitted: no rollout runs beside it
        if hc.every and self.step % hc.every == 0:
            metrics.update({k: v for k, v in (await self._curve()).items() if k != "step"})
        self.collector.admit_next(workers, self.policy.policy_version)
        write_step(self.run_dir, self.step, records, metrics, events, names)
        track_step(self.trackers, self.step, records, metrics)
        self.last_metrics = metrics
        if tc.checkpoint_every and self.step % tc.checkpoint_every == 0 or self.step == tc.steps:
            save_checkpoint(self.run_dir, self.state_dict())
            export_checkpoint(self.run_dir, self.model, self.policy, step=self.step)
        return metrics

    def _options_for(self, curriculum: Any) -> Callable[[str], dict[str, Any]]:
        """A training episode's reset options: the curriculum's, and with ``train.reward_control =
        "shuffled"`` the task whose reference scores it (:mod:`toolgym.training.sampling.reward_control`)."""
        score_as = self.score_as
        if score_as is None:
            return cast(Callable[[str], dict[str, Any]], curriculum.reset_options)
        return lambda task_id: {**curriculum.reset_options(task_id), "score_as": score_as[task_id]}

    async def _learn(self, groups: Sequence[Group], workers: RolloutWorkers | None = None) -> StepResult:
        """Steps 2-3: plan and accumulate the gradient (in a thread, the workers keep sampling), then
        wait for the current version's groups and publish the update."""
        tc = self.config.train
        plan = plan_step(
            [g.trajectories for g in groups],
            scales=[self.sampler.scale(g.env) for g in groups],
            format_credit=tc.format_credit,
            answer_tool=tc.answer_tool,
            normalize_std=tc.normalize_std,
            skip_zero_variance=tc.skip_zero_variance,
        )
        self.optimizer.zero_grad()
        skipped = "logprobs" if nonfinite_logprobs(plan) else ""  # NOTE (guard): training/learn/step_guard.py
        losses = LossSums()
        reduced: dict[str, float] = {}
        if not skipped:
            try:
                losses, reduced = await asyncio.to_thread(
                    self.learners.accumulate,  # one learner: accumulate_gradients itself
                    self.model,
                    self.optimizer,
                    plan,
                    config=self.config,
                    step=self.step + 1,
                    settings=StepSettings.of(
                        tc, temperature=self.config.sampling.temperature, reference=self.reference
                    ),
                )
            except torch.OutOfMemoryError as exc:
                self.optimizer.zero_grad()
                raise out_of_memory(self.config, self.step + 1, exc, self.memory) from exc
        lr = self.optimizer.lr
        signal = bool(plan.samples)
        if signal and workers is not None:
            await workers.drain(self.policy.policy_version)  # NOTE (determinism): see the module docstring
        grad_norm = 0.0
        sync: dict[str, float] = {}  # a step without signal, or skipped, publishes nothing
        if signal and not skipped:
            grad_norm, sync = await asyncio.to_thread(self._publish, plan, losses.finite())
            if self.optimizer.last_skipped:
                skipped = "gradient" if losses.finite() else "loss"
        self.optimizer.zero_grad()
        updated = signal and not skipped
        return StepResult(
            advantages=plan.advantages,
            trained=plan.trained(),
            informative=len(plan.groups),
            zero_variance=plan.zero_variance,
            losses=losses,
            tokens=plan.tokens,
            sequences=len(plan.samples),
            grad_norm=grad_norm,
            lr=lr,
            updated=updated,
            sync={**sync, **reduced},
            skipped=skipped,
        )

    def _publish(self, plan: StepPlan, finite_loss: bool = True) -> tuple[float, dict[str, float]]:
        """The optimizer step, published as the next weight version (:meth:`PolicyHandle.publish`); a
        step the optimizer skipped (a non-finite loss or gradient) publishes nothing."""
        grad_norm = 0.0

        def step() -> bool:
            nonlocal grad_norm
            grad_norm = self.learners.optimizer_step(
                self.model, self.optimizer, self.config.train.optim.max_grad_norm, finite_loss=finite_loss
            )
            return not self.optimizer.last_skipped

        timings = self.handle.publish(step)
        return grad_norm, timings

    @property
    def heldout_train_ids(self) -> list[str]:
        """The training tasks of the environment the held-out evaluation draws from (its own ids: a
        mixture's ``task_ids`` are ``name:task_id`` and would never equal a held-out id)."""
        return list(self.env_task_ids[self.config.heldout_index])

    async def _curve(self) -> dict[str, float]:
        """A held-out curve point of the current weights (``heldout.every``), once per step."""

        if self.step in self.curve_steps:
            return {}
        with self.progress.task(f"held-out curve at step {self.step}"):
            point = await curve_point(
                self.config, self.run_dir, self.policy, self.step, self.heldout_train_ids
            )
        self.curve_steps.append(self.step)
        self.progress.line(f"held-out curve at step {self.step}: {_curve_note(point)}")
        return point


def _step_note(metrics: dict[str, float]) -> str:
    return (
        f"reward {metrics['reward/mean']:.3f}, informative groups {int(metrics['groups/informative'])}"
        f"/{int(metrics['groups/drawn'])}, tokens {int(metrics['loss/tokens'])}, learn {metrics['time/learn']:.1f} s"
    )


def _curve_note(point: dict[str, float]) -> str:
    return ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in point.items() if k.endswith("/reward"))


def _log_sizes(saved: Any, run_dir: Path) -> dict[str, int]:
    """The checkpoint's ``log_sizes``, checked to name only the logs the trainer writes (``LOG_FILES``,
    bare names: a checkpoint is data, and a name such as ``../x`` or ``/etc/x`` would truncate a file
    outside the run) with sizes that are non-negative integers.

    Raises:
        CheckpointError: anything else, named.
    """
    if not isinstance(saved, dict):
        raise CheckpointError(f"{run_dir}'s checkpoint has no log_sizes table (got {type(saved).__name__})")
    out: dict[str, int] = {}
    for name, size in saved.items():
        if name not in LOG_FILES:
            raise CheckpointError(
                f"{run_dir}'s checkpoint names {str(name)[:200]!r} among its logs, which is none of the files "
                f"a run writes ({', '.join(LOG_FILES)}); it was not written by toolgym, so nothing is truncated. "
                "Train into a new --out, or remove checkpoint.pt to start this run again"
            )
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CheckpointError(f"{run_dir}'s checkpoint gives {name} the size {size!r}: not a byte count")
        out[name] = size
    return out
