"""Scale-out on Ray (``train.rollouts.backend = "ray"``): environments run in Ray actors, the learner drives them.

Design. An :class:`EnvActor` is a Ray actor process that builds environments by registered id (through
:func:`toolgym.registry.make`, exactly as the in-process backend does) and hosts several of
them at once, one per *slot*, stepping them concurrently on the actor's event loop. The learner sees a
slot as a :class:`ActorEnv`: a gymnasium environment whose ``areset``/``astep`` are actor calls, so
:func:`toolgym.agents.rollout.run_episode`, the only rollout loop, drives it unchanged. An
:class:`EnvActorPool` owns the actors and hands out slots round-robin; it is what
:class:`~toolgym.training.sampling.workers.RolloutWorkers` calls to make an environment.

Why environment workers, and the rollout loop and policy stay with the learner:

* token fidelity: only chat messages (text) cross the process boundary; the sequence, its loss mask,
  behaviour logprobs and token hash are built by the same loop with the same tokenizer as in-process,
  so a seed gives the same trajectory on either backend (a test checks this on SearchQA);
* staleness accounting: completions are stamped with ``policy_version`` by the learner's own policy,
  and the CPU weight sync stays what it is in-process (one shared module, updated and versioned under
  its weights lock). Rollout actors holding a policy copy would instead need the state dict broadcast
  after every step and a model per process: worth it for GPU inference engines, not on CPU, where what
  parallelises across processes is the environment side (search, sandboxes, verifiers).

Failures keep their meaning across the boundary. An exception raised by the environment is re-raised
in the learner as itself: an :class:`~toolgym.errors.InfraError` makes an ``infra_error`` trajectory, a
verifier bug stops training. An actor that dies (out of memory, killed) is an ``InfraError`` for the
episodes it was running; Ray restarts it and the next reset of each of its slots starts afresh.

Ray's lifecycle: the pool joins a running Ray (``ray.init`` already called, or ``RAY_ADDRESS`` set to
a cluster) or starts a local instance, and shuts down only a connection it opened itself
(:mod:`toolgym.training.distributed.ray_cluster`, shared with the learner actors).
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any, cast

import gymnasium

from toolgym.core import AsyncToolEnv, Message
from toolgym.env import MessagesSpace, TextSpace
from toolgym.errors import ConfigError, InfraError
from toolgym.registry import make
from toolgym.training.distributed.ray_cluster import (
    acquire_ray,
    adopt_sys_path,
    release_ray,
    require_ray,
    user_sys_path,
)

__all__ = ["EnvActor", "EnvActorPool", "ActorEnv"]

log = logging.getLogger(__name__)


def _async_side(env: gymnasium.Env[Any, Any]) -> AsyncToolEnv:
    """The async side of a made environment: its unwrapped toolgym environment (see AsyncToolEnv)."""
    return cast(AsyncToolEnv, env.unwrapped)


class EnvActor:
    """Hosts environments of one id, one per slot, inside a Ray actor process (see the module docstring).

    Slots are created on first reset. After a restart (the process died) the actor is rebuilt empty:
    a step on a slot it does not hold is an :class:`InfraError` (the episode's state is lost).
    """

    def __init__(self, env_id: str, kwargs: dict[str, Any], sys_path: list[str]) -> None:
        adopt_sys_path(sys_path)
        self.env_id, self.kwargs = env_id, dict(kwargs)
        self._envs: dict[int, gymnasium.Env[Any, Any]] = {}

    def _make(self) -> gymnasium.Env:
        return make(self.env_id, **self.kwargs)  # by registered id, as the in-process backend

    def describe(self) -> tuple[Any, int]:
        """The environment's spec and ``max_turns`` (also validates the id early, with "did you mean")."""
        env = self._make()
        try:
            return env.spec, int(_async_side(env).max_turns)
        finally:
            env.close()

    async def areset(
        self, slot: int, seed: int | None, options: dict[str, Any] | None
    ) -> tuple[list[Message], dict[str, Any]]:
        if slot not in self._envs:
            self._envs[slot] = self._make()
        return await _async_side(self._envs[slot]).areset(seed=seed, options=options)

    async def astep(self, slot: int, action: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        env = self._envs.get(slot)
        if env is None:
            raise InfraError(
                f"environment slot {slot} of {self.env_id} is gone (its actor was restarted); "
                "the episode cannot continue, the next reset starts a new one"
            )
        return await _async_side(env).astep(action)

    async def aclose(self, slot: int) -> None:
        env = self._envs.pop(slot, None)
        if env is None:
            return
        aclose = getattr(env.unwrapped, "aclose", None)
        if aclose is not None:
            await aclose()
        env.close()

    def pid(self) -> int:
        """The actor's process id (for diagnostics and failure tests)."""
        return os.getpid()


class ActorEnv(gymnasium.Env[list[Message], str]):
    """One slot of an :class:`EnvActor`, seen from the learner as an ordinary toolgym environment."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, actor: Any, slot: int, spec: Any, max_turns: int) -> None:
        self._actor, self._slot = actor, slot
        self.spec = spec
        self.max_turns = max_turns
        self.observation_space = MessagesSpace()
        self.action_space = TextSpace()
        self._closed = False

    @property
    def slot(self) -> int:
        return self._slot

    @property
    def episode_metrics(self) -> dict[str, float]:
        """None on this side: the episode's metrics live in the actor's environment (and steps' info)."""
        return {}

    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        return await self._await(self._actor.areset.remote(self._slot, seed, options))

    async def astep(self, action: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        return await self._await(self._actor.astep.remote(self._slot, action))

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._await(self._actor.aclose.remote(self._slot), on_actor_error="ignore")

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        super().reset(seed=seed)
        return self._get(self._actor.areset.remote(self._slot, seed, options))

    def step(self, action: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        return self._get(self._actor.astep.remote(self._slot, action))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._get(self._actor.aclose.remote(self._slot), on_actor_error="ignore")

    async def _await(self, ref: Any, on_actor_error: str = "raise") -> Any:
        ray = require_ray()
        try:
            return await ref
        except ray.exceptions.RayError as exc:
            return self._translate(ray, exc, on_actor_error)

    def _get(self, ref: Any, on_actor_error: str = "raise") -> Any:
        ray = require_ray()
        try:
            return ray.get(ref)
        except ray.exceptions.RayError as exc:
            return self._translate(ray, exc, on_actor_error)

    def _translate(self, ray: ModuleType, exc: BaseException, on_actor_error: str) -> None:
        # NOTE (errors): the environment's own exception comes back as itself, so InfraError still means
        # infra_error and a verifier bug still stops training; Ray's own failures are infrastructure.
        if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, BaseException):
            raise exc.cause from exc
        if on_actor_error == "ignore":
            log.warning("environment actor unreachable while closing slot %d: %s", self._slot, exc)
            return None
        raise InfraError(
            f"environment actor of slot {self._slot} failed ({type(exc).__name__}): {exc}"
        ) from exc


class EnvActorPool:
    """Ray actors hosting the training environments; :meth:`make` is the rollout workers' env factory.

    Args:
        env_id: registered gymnasium id (``module:id`` works: the actors get the learner's import path).
        kwargs: keyword arguments for ``gymnasium.make``.
        actors: actor processes; environments are spread over them round-robin.
        num_cpus: CPUs Ray reserves per actor.
    """

    def __init__(
        self, env_id: str, kwargs: dict[str, Any], *, actors: int = 2, num_cpus: float = 1.0
    ) -> None:
        if actors < 1:
            raise ConfigError(f"train.rollouts.ray_env_actors must be >= 1, got {actors}")
        ray = acquire_ray(actors * num_cpus)
        self._holds_ray = True
        try:
            available = ray.cluster_resources().get("CPU", 0.0)
            if available < actors * num_cpus:
                raise ConfigError(
                    f"train.rollouts.ray_env_actors = {actors} needs {actors * num_cpus:g} CPUs but the Ray cluster "
                    f"has {available:g}: lower train.rollouts.ray_env_actors or add nodes"
                )
            # NOTE (restarts): a call caught by an actor's death is retried on the restarted actor, where a
            # reset simply starts the episode and a step finds its slot gone (an InfraError, as it must).
            remote = ray.remote(EnvActor).options(num_cpus=num_cpus, max_restarts=-1, max_task_retries=3)
            self._actors = [remote.remote(env_id, dict(kwargs), user_sys_path()) for _ in range(actors)]
            try:
                self.spec, self.max_turns = ray.get(self._actors[0].describe.remote())
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, BaseException):
                    raise exc.cause from exc
                raise
        except BaseException:
            self.close()
            raise
        self._slots = 0
        log.info("%d Ray environment actors for %s", actors, env_id)

    @property
    def actors(self) -> list[Any]:
        return list(self._actors)

    def make(self) -> ActorEnv:
        """A new environment slot on the next actor in turn."""
        slot = self._slots
        self._slots += 1
        return ActorEnv(self._actors[slot % len(self._actors)], slot, self.spec, self.max_turns)

    def close(self) -> None:
        """Kill the actors, and disconnect from (or shut down) Ray if this pool connected."""
        ray = require_ray()
        for actor in getattr(self, "_actors", []):
            ray.kill(actor)
        self._actors = []
        if self._holds_ray:
            self._holds_ray = False
            release_ray()
