"""A toolgym environment as a ``verifiers`` environment (the ``verifiers.v1`` stack of verifiers 0.4).

verifiers composes an environment from a *taskset* (the tasks) and an ``Env`` whose ``run`` plays one
task with the run's agents; the agent (a harness program around the model endpoint verifiers is
given) produces each assistant turn. :class:`ToolgymTaskset` lists a toolgym environment's tasks and
:class:`ToolgymEnv` plays one: it resets the toolgym environment, opens the conversation with the
environment's own prompt (system message with the tool schemas, then the task), and from then on
alternates -- the agent's reply is the toolgym action, verbatim; the environment's tool results go
back as the next user turn, wrapped in ``<tool_response>`` tags as in toolgym's chat template --
until the episode terminates or truncates. The verifier's reward is recorded as the trace's
``toolgym_reward``, numeric ``info`` entries of the last step as metrics, and every step
(observation, reward, flags, info) under ``trace.info["toolgym"]``.

verifiers finds tasksets by module name, so the taskset is also importable as the top-level module
``toolgym_verifiers`` (shipped with toolgym)::

    import verifiers.v1 as vf

    config = vf.resolve_env_config({
        "taskset": {"id": "toolgym-verifiers", "env": "toolgym/SearchQA-v0", "env_kwargs": {"split": "test"}},
        "player": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}},
    })
    env = vf.load_environment(config)  # a ToolgymEnv

or from the command line, ``vf-eval toolgym-verifiers --env.taskset.env toolgym/SearchQA-v0 ...``.
``env`` may also be the URL of a ``toolgym serve`` server (the episodes then run there).

What does not map: verifiers' agents call the model through their own harness and chat template, so
toolgym's sampled-token receipts, its ``bare``/``scaffold`` harness and its policies have no place
here; toolgym tool calls are text (``<tool_call>`` tags, as toolgym's prompt asks for), not the
endpoint's native tool calls; a reply is taken as the whole text of the agent's last assistant
message.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from toolgym.errors import ConfigError, MissingDependencyError
from toolgym.parsing import format_tool_response

try:
    import verifiers.v1 as vf
    from pydantic import Field
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError("verifiers", "verifiers", "the verifiers adapter") from exc

__all__ = [
    "ToolgymData",
    "ToolgymEnv",
    "ToolgymEnvConfig",
    "ToolgymTask",
    "ToolgymTaskset",
    "ToolgymTasksetConfig",
]


class ToolgymTasksetConfig(vf.TasksetConfig):
    """Which toolgym environment, built how, and which of its episodes."""

    env: str = "toolgym/SearchQA-v0"
    """A registered toolgym environment id, or the URL of a ``toolgym serve`` server."""
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for building the environment (``split``, ``n_tasks``, ``data`` ...)."""
    seed: int = 0
    """The seed every episode's ``reset`` gets (unless ``resets`` gives one)."""
    resets: list[dict[str, Any]] | None = None
    """Explicit episodes, one per entry: ``{"seed": ..., "options": {...}}`` (``options`` as
    ``reset`` takes them, e.g. ``task_id``). Default: one episode per task of the environment."""


class ToolgymData(vf.TaskData):
    env: str
    env_kwargs: dict[str, Any]
    seed: int
    options: dict[str, Any]


class ToolgymTask(vf.Task[ToolgymData]):
    pass


class ToolgymEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


def _make(env: str, env_kwargs: Mapping[str, Any]) -> Any:
    from toolgym.registry import make

    return make(env, **dict(env_kwargs))


class ToolgymTaskset(vf.Taskset[ToolgymTask, ToolgymTasksetConfig]):
    """One verifiers task per toolgym episode: per task of the environment, or per ``resets`` entry."""

    def load(self) -> Iterator[ToolgymTask]:
        config = self.config
        resets = config.resets
        if resets is None:
            env = _make(config.env, config.env_kwargs)
            try:
                tasks = list(getattr(env.unwrapped, "tasks", ()))
            finally:
                env.close()
            if not tasks:
                raise ConfigError(
                    f"{config.env} lists no tasks; give the episodes explicitly as taskset.resets "
                    '(e.g. [{"seed": 0, "options": {"task_id": "..."}}])'
                )
            resets = [{"options": {"task_id": t.id}} for t in tasks]
        for index, reset in enumerate(resets):
            unknown = set(reset) - {"seed", "options"}
            if unknown or not isinstance(reset.get("options", {}), dict):
                raise ConfigError(
                    f"taskset.resets[{index}] = {reset!r}: expected {{'seed': int, 'options': dict}}"
                    + (f"; unknown keys {sorted(unknown)}" if unknown else "")
                )
            options = dict(reset.get("options", {}))
            name = options.get("task_id") or options.get("task_index")
            yield ToolgymTask(
                ToolgymData(
                    name=f"{config.env}#{name if name is not None else index}",
                    prompt=None,
                    env=config.env,
                    env_kwargs=dict(config.env_kwargs),
                    seed=int(reset.get("seed", config.seed)),
                    options=options,
                ),
                config.task,
            )


def user_turn(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Observation messages as the agent's next turn: tool results become one ``<tool_response>`` user turn."""
    turn: list[dict[str, str]] = []
    pending: list[str] = []
    for message in messages:
        role, content = message["role"], str(message.get("content", ""))
        if role == "tool":
            pending.append(format_tool_response(content))
            continue
        if pending:
            turn.append({"role": "user", "content": "\n".join(pending)})
            pending = []
        turn.append({"role": role, "content": content})
    if pending:
        turn.append({"role": "user", "content": "\n".join(pending)})
    return turn


def reply_text(segment: Any) -> str:
    """The agent's reply, unstripped: the text of the segment's last assistant message."""
    for message in reversed(segment.messages):
        if isinstance(message, vf.AssistantMessage):
            return message.content if isinstance(message.content, str) else str(message.content or "")
    return ""


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


class ToolgymEnv(vf.Env[ToolgymEnvConfig]):
    """Plays one toolgym episode per task with the ``player`` agent (see the module docstring)."""

    async def run(self, task: ToolgymTask, agents: Any) -> None:
        data = task.data
        env = await asyncio.to_thread(_make, data.env, data.env_kwargs)
        try:
            obs, info = await asyncio.to_thread(env.reset, seed=data.seed, options=data.options)
            record: dict[str, Any] = {
                "env": data.env,
                "seed": data.seed,
                "options": data.options,
                "reset": {"observation": _plain(obs), "info": _plain(info)},
                "steps": [],
            }
            total, last_info = 0.0, info
            async with agents.player.interaction(task) as interaction:
                segment = await interaction.turn(user_turn(obs))
                while not segment.terminated:
                    action = reply_text(segment)
                    obs, reward, terminated, truncated, last_info = await asyncio.to_thread(env.step, action)
                    total += float(reward)
                    record["steps"].append(
                        {
                            "action": action,
                            "observation": _plain(obs),
                            "reward": reward,
                            "terminated": terminated,
                            "truncated": truncated,
                            "info": _plain(last_info),
                        }
                    )
                    if terminated or truncated:
                        break
                    segment = await interaction.turn(user_turn(obs))
            trace = interaction.trace
            trace.record_reward("toolgym_reward", total)
            trace.record_metrics(
                {
                    f"toolgym/{k}": float(v)
                    for k, v in last_info.items()
                    if isinstance(v, int | float) and not isinstance(v, bool)
                }
            )
            trace.info["toolgym"] = record
        finally:
            await asyncio.to_thread(env.close)
