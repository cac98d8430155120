"""Scale-out on Ray (``train.backend = "ray"``): environments run in Ray actors, the learner drives them.

Design. An :class:`EnvActor` is a Ray actor process that builds environments by registered id (through
:func:`toolgym.training.rollouts.make_env`, exactly as the in-process backend does) and hosts several of
them at once, one per *slot*, stepping them concurrently on the actor's event loop. The learner sees a
slot as a :class:`RemoteEnv`: a gymnasium environment whose ``areset``/``astep`` are actor calls, so
:func:`toolgym.agents.rollout.run_episode`, the only rollout loop, drives it unchanged. An
:class:`EnvActorPool` owns the actors and hands out slots round-robin; it is what
:class:`~toolgym.training.rollouts.RolloutWorkers` calls to make an environment.

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
a cluster) or starts a local instance, and shuts down only a connection it opened itself.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import gymnasium

from toolgym.core import AsyncToolEnv, Message
from toolgym.env import MessagesSpace, TextSpace
from toolgym.errors import ConfigError, InfraError, MissingDependencyError

__all__ = [
    "EnvActor",
    "EnvActorPool",
    "RemoteEnv",
    "acquire_ray",
    "release_ray",
    "require_ray",
    "user_sys_path",
]

log = logging.getLogger(__name__)

#: Object store of a local instance: only chat messages travel through it.
LOCAL_OBJECT_STORE_BYTES = 256 * 1024**2


def require_ray() -> ModuleType:
    """The ``ray`` module, or a fix-it error naming the extra that installs it."""
    try:
        import ray
    except ImportError as exc:
        raise MissingDependencyError("ray", "ray", "train.backend = 'ray'") from exc
    return ray


#: How many users (environment pools, learner groups) hold the Ray connection this process opened.
_OPENED = {"users": 0}


def acquire_ray(num_cpus: float) -> ModuleType:
    """The ``ray`` module, connected: a running Ray (``ray.init`` already called) is joined and never
    shut down here; otherwise this process connects (``RAY_ADDRESS``) or starts a local instance with
    ``num_cpus`` CPUs, and keeps it until the last :func:`release_ray`."""
    ray = require_ray()
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(include_dashboard=False)
        else:
            ray.init(
                num_cpus=max(1, round(num_cpus)),
                include_dashboard=False,
                object_store_memory=LOCAL_OBJECT_STORE_BYTES,
            )
        _OPENED["users"] = 0
        _OPENED["opened"] = 1
    if _OPENED.get("opened"):
        _OPENED["users"] += 1
    return ray


def release_ray() -> None:
    """One user of :func:`acquire_ray` is done; the last one shuts down a connection this process opened."""
    if not _OPENED.get("opened"):
        return
    _OPENED["users"] -= 1
    if _OPENED["users"] <= 0:
        _OPENED["opened"] = 0
        ray = require_ray()
        if ray.is_initialized():
            ray.shutdown()


def user_sys_path() -> list[str]:
    """Import-path entries added by the user (not the interpreter's own), for the actors.

    Gymnasium's ``module:id`` form imports ``module`` before making the environment; the actors must be
    able to import it too, wherever the learner found it.
    """
    prefixes = {str(Path(p).resolve()) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    out = []
    for entry in sys.path:
        if not entry or not Path(entry).is_dir():
            continue
        resolved = str(Path(entry).resolve())
        if not any(resolved == p or resolved.startswith(p + os.sep) for p in prefixes):
            out.append(resolved)
    return out


def adopt_sys_path(entries: list[str]) -> None:
    """In an actor: put the learner's :func:`user_sys_path` entries first on the import path."""
    for entry in reversed(entries):
        if entry not in sys.path:
            sys.path.insert(0, entry)


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
        from toolgym.training.rollouts import make_env

        return make_env(self.env_id, dict(self.kwargs))

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


class RemoteEnv(gymnasium.Env[list[Message], str]):
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
            raise ConfigError(f"train.ray_env_actors must be >= 1, got {actors}")
        ray = acquire_ray(actors * num_cpus)
        self._holds_ray = True
        try:
            available = ray.cluster_resources().get("CPU", 0.0)
            if available < actors * num_cpus:
                raise ConfigError(
                    f"train.ray_env_actors = {actors} needs {actors * num_cpus:g} CPUs but the Ray cluster "
                    f"has {available:g}: lower train.ray_env_actors or add nodes"
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

    def make(self) -> RemoteEnv:
        """A new environment slot on the next actor in turn."""
        slot = self._slots
        self._slots += 1
        return RemoteEnv(self._actors[slot % len(self._actors)], slot, self.spec, self.max_turns)

    def close(self) -> None:
        """Kill the actors, and disconnect from (or shut down) Ray if this pool connected."""
        ray = require_ray()
        for actor in getattr(self, "_actors", []):
            ray.kill(actor)
        self._actors = []
        if self._holds_ray:
            self._holds_ray = False
            release_ray()
