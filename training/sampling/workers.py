"""Rollout side of the trainer: which task and seed each group gets, and the async workers.

NOTE (seeding): group ``g`` gets its task from a per-epoch permutation seeded by ``(seed, epoch)`` and
sample ``i`` gets episode seed ``SeedSequence([seed, g, i])``; both are pure functions of ``g``, so the
data sampler's whole state is the index of the next group, and a resumed run draws exactly the groups
the uninterrupted run would have drawn.

Failures (the rule is in :mod:`toolgym.errors`). An episode whose environment or policy failed comes
back as an ``infra_error`` trajectory (the environment has already retried the failing call); the
group keeps its other samples, and the learner never trains on the failed ones. An environment that
cannot even be made for an episode (an index that cannot be opened, say) gives an ``infra_error``
trajectory too. :class:`InfraGuard` stops the run with :class:`~toolgym.errors.InfraDown` when the
infrastructure stays down (``train.max_infra_groups`` consecutive groups with no usable sample), so a
run whose engine is gone for good stops with a message instead of spinning; it resumes from its last
checkpoint. Any other exception (a bug, a verifier bug) stops the run at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import gymnasium
import numpy as np

from toolgym.agents.rollout import run_episode
from toolgym.core import Harness, Policy, SamplingParams, Trajectory
from toolgym.errors import ConfigError, InfraDown, InfraError, did_you_mean
from toolgym.registry import make
from toolgym.training.sampling.ray_envs import EnvActorPool

__all__ = ["EnvRoute", "Group", "GroupSampler", "InfraGuard", "RolloutWorkers", "env_factory", "make_env"]

log = logging.getLogger(__name__)


def make_env(env_id: str, kwargs: Mapping[str, Any]) -> gymnasium.Env:
    """An environment by registered id only (never a concrete class): :func:`toolgym.registry.make`.

    Kept for the trainer's config-shaped call (``kwargs`` as one mapping); the id check with "did you
    mean" and the ``infra_retries`` / ``infra_backoff_s`` retry settings live in the registry.
    """
    return make(env_id, **kwargs)


def env_factory(
    backend: str, env_id: str, kwargs: dict, *, ray_env_actors: int = 2
) -> tuple[Callable[[], gymnasium.Env], Callable[[], None]]:
    """The rollout workers' environment factory for ``backend``, and how to release what it holds.

    ``asyncio`` makes environments in this process; ``ray`` makes slots on Ray environment actors
    (:class:`toolgym.training.sampling.ray_envs.EnvActorPool`), driven by the same rollout loop.
    """
    if backend == "ray":
        pool = EnvActorPool(env_id, kwargs, actors=ray_env_actors)
        return pool.make, pool.close
    if backend != "asyncio":
        raise ConfigError(f"unknown backend {backend!r}.{did_you_mean(backend, ['asyncio', 'ray'])}")
    return (lambda: make_env(env_id, kwargs)), (lambda: None)


@dataclass(frozen=True)
class Group:
    """``G`` samples of one task, produced together (``env``: its environment's position in ``[[env]]``)."""

    index: int
    task_id: str
    trajectories: tuple[Trajectory, ...]
    env: int = 0

    @property
    def policy_version(self) -> int:
        """The oldest weights that sampled a usable sample of the group (its age for staleness).

        ``infra_error`` samples are left out: they may have failed before sampling anything, and they
        are never trained on, so they must not make the rest of the group look stale.
        """
        usable = [t.policy_version for t in self.trajectories if t.status != "infra_error"]
        return min(usable) if usable else max(t.policy_version for t in self.trajectories)


class InfraGuard:
    """Counts consecutive groups with no usable sample and stops the run when there are too many.

    Fed the groups in the order the learner consumes them. A group all of whose trajectories are
    ``infra_error`` means the infrastructure failed for every sample, retries included; ``limit`` such
    groups in a row mean it is down (an engine gone for good, a Docker engine that did not come back),
    and :meth:`observe` raises :class:`~toolgym.errors.InfraDown` with the last error. One usable
    sample resets the count.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ConfigError(f"train.max_infra_groups must be >= 1, got {limit}")
        self.limit = limit
        self.consecutive = 0

    def observe(self, group: Group) -> None:
        if any(t.status != "infra_error" for t in group.trajectories):
            self.consecutive = 0
            return
        self.consecutive += 1
        if self.consecutive >= self.limit:
            last = group.trajectories[-1].error or "no error recorded"
            raise InfraDown(
                f"the last {self.consecutive} groups (up to group {group.index}) ended in infra_error for "
                f"every sample, retries included: the infrastructure looks down. Last error: {last}. "
                "Fix it (start the Docker engine, restart the policy's server or engine, repair the "
                "index), then rerun the same command: the run resumes from its last checkpoint. "
                f"(Limit: train.max_infra_groups = {self.limit}.)"
            )


class GroupSampler:
    """Maps a group index to its task id and episode seeds (stateless; see the module note)."""

    def __init__(self, task_ids: Sequence[str], *, group_size: int, seed: int) -> None:
        if not task_ids:
            raise ConfigError("no tasks to train on: check env.task_ids / env.task_limit")
        self.task_ids = list(task_ids)
        self.group_size = group_size
        self.seed = seed

    def route(self, index: int) -> tuple[int, str]:
        """Group ``index``'s environment (always the one) and task id."""
        return 0, self.task(index)

    def task(self, index: int) -> str:
        epoch, pos = divmod(index, len(self.task_ids))
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.task_ids))
        return self.task_ids[int(order[pos])]

    def episode_seed(self, index: int, sample: int) -> int:
        return int(np.random.SeedSequence([self.seed, index, sample]).generate_state(1)[0])


@dataclass(frozen=True)
class EnvRoute:
    """How the workers play one environment of the run: its factory, harness, reset options and budget.

    ``options_for(task_id)`` gives the episode's ``reset`` options from the curriculum (``tools``,
    ``unlocks``; see :meth:`~toolgym.training.sampling.curriculum.ToolCurriculum.reset_options`).
    """

    make: Callable[[], gymnasium.Env]
    harness: Harness
    options_for: Callable[[str], dict[str, Any]]
    max_total_tokens: int


@dataclass(frozen=True)
class _Job:
    """One admitted group: everything it needs was fixed when it was admitted."""

    index: int
    route: int
    task_id: str
    options: dict[str, Any]
    version: int


class RolloutWorkers:
    """Async workers that sample admitted groups, in index order, each at the version it was admitted at.

    NOTE (determinism): the learner alone decides what is sampled and with which weights. It admits
    groups (:meth:`admit`) at known points of its loop, labelling each with the current policy
    version; a group's task, curriculum options and seeds are fixed at admission, from the sampler's
    and curriculum's state at that moment. Before it publishes the next weights the learner waits for
    every group admitted at the current version (:meth:`drain`), so a group is sampled entirely by
    the weights it was labelled with, however the workers are scheduled. With a deterministic policy
    (per-request seeds, numerics that do not depend on which requests run together) the run is then
    reproducible, look-ahead included. A ``skip(task_id)`` callback (a task filter) may pass over a
    task at admission: that index is never sampled, and the next one is admitted in its place.

    :meth:`next` hands the learner the oldest admitted group once it is finished. Each sample of a
    group runs concurrently, each on its own environment instance from a pool (one pool per
    environment of the run); ``workers`` groups are sampled at once.
    """

    def __init__(
        self,
        *,
        envs: Sequence[EnvRoute],
        policy: Policy,
        sampler: Any,
        sampling: SamplingParams,
        workers: int,
        start: int,
        skip: Callable[[str], bool] | None = None,
    ) -> None:
        self.policy, self.sampler, self.sampling = policy, sampler, sampling  # sampler: route, episode_seed
        self.envs = list(envs)
        self.skip = skip
        self.skipped = 0  # indices passed over by ``skip``
        self._pools: list[asyncio.Queue[gymnasium.Env]] = [asyncio.Queue() for _ in self.envs]
        self._all_envs: list[gymnasium.Env] = []
        self._next_index = start
        self._jobs: asyncio.Queue[_Job] = asyncio.Queue()
        self._order: list[int] = []  # admitted indices not yet handed out, oldest first
        self._done: dict[int, Group] = {}
        self._open: dict[int, int] = {}  # version -> admitted groups of it not finished yet
        self._changed = asyncio.Condition()
        self._tasks = [asyncio.create_task(self._work(), name=f"rollout-{i}") for i in range(workers)]

    @property
    def outstanding(self) -> int:
        """Admitted groups not yet handed to the learner."""
        return len(self._order)

    def admit(self, count: int, version: int) -> None:
        """Admit the next ``count`` groups, sampled at weight ``version`` (a task filter may skip some)."""
        admitted = 0
        while admitted < count:
            index = self._next_index
            self._next_index += 1
            route, task_id = self.sampler.route(index)
            if self.skip is not None and self.skip(task_id):
                self.skipped += 1
                continue
            options = self.envs[route].options_for(task_id)
            self._jobs.put_nowait(_Job(index, route, task_id, options, version))
            self._order.append(index)
            self._open[version] = self._open.get(version, 0) + 1
            admitted += 1

    async def next(self) -> Group:
        """The oldest admitted group, once sampled (a worker's exception is raised here)."""
        if not self._order:
            raise RuntimeError("no group admitted: call admit() first")
        index = self._order[0]
        await self._until(lambda: index in self._done)
        self._order.pop(0)
        return self._done.pop(index)

    async def drain(self, version: int) -> None:
        """Wait until every group admitted at ``version`` or earlier is sampled."""
        await self._until(lambda: not any(n for v, n in self._open.items() if v <= version))

    async def _until(self, done: Callable[[], bool]) -> None:
        """Wait until ``done()`` holds; a worker's exception is raised here instead."""
        async with self._changed:
            while not done():
                error = self.failed()
                if error is not None:
                    raise error
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=0.5)

    async def _env(self, route: int) -> gymnasium.Env:
        if self._pools[route].empty():
            env = self.envs[route].make()
            self._all_envs.append(env)
            return env
        return self._pools[route].get_nowait()

    async def _episode(self, job: _Job, sample: int) -> Trajectory:
        seed = self.sampler.episode_seed(job.index, sample)
        where = self.envs[job.route]
        try:
            env = await self._env(job.route)
        except InfraError as exc:
            log.warning("could not make an environment for group %d: %s", job.index, exc)
            return Trajectory(
                env_id="",
                task_id=job.task_id,
                seed=seed,
                harness=where.harness.name,
                allowed_tools=tuple(sorted(job.options.get("tools") or ())),
                messages=(),
                token_ids=(),
                loss_mask=(),
                logprobs=(),
                reward=0.0,
                metrics={"env/infra_error": 1.0},
                status="infra_error",
                policy_version=job.version,
                error=f"{type(exc).__name__}: {exc}",
            )
        try:
            return await run_episode(
                env,
                self.policy,
                where.harness,
                seed=seed,
                options={"task_id": job.task_id, **job.options},
                sampling=replace(self.sampling, seed=seed),
                max_total_tokens=where.max_total_tokens,
            )
        finally:
            self._pools[job.route].put_nowait(env)

    async def _work(self) -> None:
        while True:
            job = await self._jobs.get()
            samples = [self._episode(job, i) for i in range(self.sampler.group_size)]
            trajectories = await asyncio.gather(*samples)
            group = Group(
                index=job.index, task_id=job.task_id, trajectories=tuple(trajectories), env=job.route
            )
            async with self._changed:
                self._done[job.index] = group
                self._open[job.version] -= 1
                self._changed.notify_all()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        for env in self._all_envs:
            aclose = getattr(env.unwrapped, "aclose", None)
            if aclose is not None:
                await aclose()
            else:
                env.close()
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                raise result

    def failed(self) -> BaseException | None:
        """A worker's exception (a bug or a verifier error), so the learner stops instead of waiting."""
        for task in self._tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                return task.exception()
        return None
