"""A toolgym environment as an OpenEnv environment: ``toolgym serve ENV_ID --openenv``.

OpenEnv (the ``openenv-core`` package) serves an ``Environment`` subclass over HTTP and WebSocket with
its own server (``openenv.core.env_server.create_app``) and drives it with its own clients
(``EnvClient``, or ``GenericEnvClient`` for plain dictionaries). :class:`OpenEnvAdapter` is that
subclass for any registered toolgym environment, so a lab's OpenEnv tooling uses toolgym's
environments unchanged:

* the action is :class:`ToolgymAction` ``{"text": "<the assistant's raw turn>"}``;
* the observation is :class:`ToolgymObservation`: the new chat ``messages``, the step's ``info``
  (tool schemas at reset; the answer and metrics at the end), ``terminated`` and ``truncated`` (OpenEnv
  has one ``done``: either), and OpenEnv's ``reward`` (0 until the terminal step);
* ``reset`` takes ``seed`` and toolgym's options as keyword arguments: ``task_id``, ``task_index``,
  ``tools``, ``unlocks`` (mid-episode unlock rules, :mod:`toolgym.unlocks`).

What does not map: OpenEnv's ``step`` has no separate truncation flag (``done`` covers both; the
observation carries the two), its ``episode_id`` is only recorded (toolgym chooses the task by
``task_id``), and its ``timeout_s`` is ignored (each toolgym tool has its own time limit). Errors:
an exception the environment raises is OpenEnv's server error response (``InfraError`` and verifier
bugs alike); use ``toolgym serve`` without ``--openenv`` where that distinction must reach the client.

Serving it: ``toolgym serve ENV_ID --openenv`` runs OpenEnv's application behind toolgym's guards
(:mod:`toolgym.serving.openenv_server`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from toolgym.errors import MissingDependencyError
from toolgym.spaces import MAX_ACTION_CHARS

__all__ = ["MAX_ACTION_CHARS", "OpenEnvAdapter", "ToolgymAction", "ToolgymObservation"]


def _openenv() -> tuple[Any, Any, Any, Any, Any]:
    try:
        from openenv.core.env_server.interfaces import Environment
        from openenv.core.env_server.types import Action, Observation, State
        from pydantic import Field  # OpenEnv's messages are pydantic models
    except ImportError as exc:
        raise MissingDependencyError("openenv-core", "openenv", "the OpenEnv adapter") from exc
    return Environment, Action, Observation, State, Field


_Environment, _Action, _Observation, _State, _Field = _openenv()


class ToolgymAction(_Action):  # type: ignore[misc, valid-type]
    """One assistant turn, as raw text (tool calls in the environment's ``<tool_call>`` format)."""

    text: str = _Field(max_length=MAX_ACTION_CHARS)


class ToolgymObservation(_Observation):  # type: ignore[misc, valid-type]
    """The chat messages a reset or step produced, its info, and toolgym's two end flags."""

    messages: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    terminated: bool = False
    truncated: bool = False


class OpenEnvAdapter(_Environment):  # type: ignore[misc, valid-type]
    """A registered toolgym environment behind OpenEnv's ``Environment`` interface."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # one toolgym environment per session: nothing shared

    def __init__(self, env_id: str, env_kwargs: Mapping[str, Any] | None = None) -> None:
        from toolgym.registry import make

        super().__init__()
        self.env_id = env_id
        self.env = make(env_id, **dict(env_kwargs or {}))
        self.base: Any = self.env.unwrapped
        self._state = _State(episode_id=None, step_count=0)

    @staticmethod
    def _options(
        task_id: str | None,
        task_index: int | None,
        tools: list[str] | None,
        unlocks: list[dict[str, Any]] | None,
    ) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if task_id is not None:
            options["task_id"] = task_id
        if task_index is not None:
            options["task_index"] = task_index
        if tools is not None:
            options["tools"] = tools
        if unlocks is not None:
            options["unlocks"] = unlocks
        return options

    def _reset_result(self, obs: Any, info: Any, episode_id: str | None) -> ToolgymObservation:
        self._state = _State(
            episode_id=episode_id or info.get("task_id"), step_count=0, task_id=info.get("task_id")
        )
        return ToolgymObservation(messages=obs, info=_plain(info), done=False, reward=0.0)

    def _step_result(self, result: tuple[Any, Any, bool, bool, Any]) -> ToolgymObservation:
        obs, reward, terminated, truncated, info = result
        self._state.step_count += 1
        done = bool(terminated or truncated)
        return ToolgymObservation(
            messages=obs,
            info=_plain(info),
            done=done,
            reward=float(reward),
            terminated=terminated,
            truncated=truncated,
        )

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        task_id: str | None = None,
        task_index: int | None = None,
        tools: list[str] | None = None,
        unlocks: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> ToolgymObservation:
        obs, info = self.env.reset(seed=seed, options=self._options(task_id, task_index, tools, unlocks))
        return self._reset_result(obs, info, episode_id)

    async def reset_async(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        task_id: str | None = None,
        task_index: int | None = None,
        tools: list[str] | None = None,
        unlocks: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> ToolgymObservation:
        obs, info = await self.base.areset(
            seed=seed, options=self._options(task_id, task_index, tools, unlocks)
        )
        return self._reset_result(obs, info, episode_id)

    def step(
        self, action: ToolgymAction, timeout_s: float | None = None, **kwargs: Any
    ) -> ToolgymObservation:
        return self._step_result(self.env.step(action.text))

    async def step_async(
        self, action: ToolgymAction, timeout_s: float | None = None, **kwargs: Any
    ) -> ToolgymObservation:
        return self._step_result(await self.base.astep(action.text))

    @property
    def state(self) -> Any:
        return self._state

    def close(self) -> None:
        self.env.close()


def _plain(info: Any) -> dict[str, Any]:
    return dict(json.loads(json.dumps(info, default=str)))
