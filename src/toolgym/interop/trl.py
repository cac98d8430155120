"""A toolgym environment inside TRL's ``GRPOTrainer`` (its ``environment_factory`` hook).

TRL (1.16+) runs multi-turn tool use itself: each rollout gets one instance from
``environment_factory``, the instance's public methods are the tools the model may call (their
schemas come from type hints and Google-style docstrings, through transformers), ``reset(**row)``
starts an episode from a dataset row, and ``get_reward()`` scores the finished rollout.
:func:`trl_environment` builds such a class for any registered toolgym environment, and
:func:`trl_dataset` the matching dataset (one row per task: the task's prompt as a user message and
its ``task_id``)::

    from trl import GRPOConfig, GRPOTrainer
    from toolgym.interop.trl import trl_dataset, trl_environment

    trainer = GRPOTrainer(
        model="path/to/instruct-model",
        args=GRPOConfig(max_steps=100, ...),
        train_dataset=trl_dataset("toolgym/SearchQA-v0", {"split": "train"}),
        environment_factory=trl_environment("toolgym/SearchQA-v0", {"split": "train"}),
    )

Each tool method plays its call as the episode's own tool call (``step`` with the call as the
assistant's turn), so the model reads exactly the observations a toolgym policy reads, errors
included, and the terminal tool (``answer``/``submit``) ends the episode and sets the reward that
``get_reward`` reports (the verifier's, unchanged; 0 when the rollout never answered).

What does not map: TRL renders the prompt and tool schemas with the model's own chat template (not
toolgym's system prompt and worked example), so the model sees a different context than in toolgym's
own trainer; TRL re-tokenises conversations, so toolgym's sampled-token receipts do not apply; the
``bare``/``scaffold`` harness is toolgym's and has no place here.
"""

from __future__ import annotations

import inspect
import json
import keyword
from collections.abc import Callable, Mapping
from typing import Any

from toolgym.errors import ConfigError, MissingDependencyError, ToolgymError

__all__ = ["TRLEnvironment", "trl_dataset", "trl_environment"]

_TYPES: dict[str, Any] = {"string": str, "integer": int, "number": float, "boolean": bool, "object": dict}
_RESERVED = {"reset", "get_reward"}


class TRLEnvironment:
    """The base of every class :func:`trl_environment` builds (its tool methods are added per env)."""

    env_id: str = ""
    env_kwargs: Mapping[str, Any] = {}

    def __init__(self) -> None:
        from toolgym.registry import make

        self._env = make(self.env_id, **dict(self.env_kwargs))
        self._reward = 0.0
        self._done = True
        self.task_id: str | None = None

    def reset(self, task_id: str | None = None, seed: int | None = None, **row: Any) -> None:
        """Start an episode on the row's task (the prompt is already the dataset's)."""
        options = {"task_id": task_id} if task_id else None
        _, info = self._env.reset(seed=seed, options=options)
        self.task_id = info.get("task_id")
        self._reward, self._done = 0.0, False
        return None

    def get_reward(self) -> float:
        """The verifier's reward of the episode (0 until the terminal tool was called)."""
        return self._reward

    def _call(self, name: str, arguments: Mapping[str, Any]) -> str:
        if self._done:
            return "Error: the episode is over; no more tool calls count"
        action = f"<tool_call>{json.dumps({'name': name, 'arguments': dict(arguments)})}</tool_call>"
        try:
            obs, reward, terminated, truncated, _ = self._env.step(action)
        except ToolgymError as exc:
            return f"Error: {exc}"
        text = "\n".join(str(m["content"]) for m in obs)
        if terminated or truncated:
            self._done = True
            self._reward = float(reward)
        if terminated:
            return text or "Answer recorded."
        if truncated:
            return (text + "\n" if text else "") + "The turn budget is spent: the episode is over."
        return text


def _tool_method(name: str, description: str, parameters: Mapping[str, Any]) -> Callable[..., str]:
    """A method whose signature and Google-style docstring describe the tool, for TRL to read."""
    props: Mapping[str, Any] = parameters.get("properties", {})
    required = set(parameters.get("required", []))
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {"return": str}
    lines = [description.strip() or name, "", "Args:"]
    for arg, spec in props.items():
        if not arg.isidentifier() or keyword.iskeyword(arg):
            raise ConfigError(
                f"tool {name!r}: argument {arg!r} is not a Python identifier; TRL cannot call it"
            )
        kind = spec.get("type", "string")
        item = _TYPES.get(spec.get("items", {}).get("type", "string"), str)
        hint = list[item] if kind == "array" else _TYPES.get(kind, str)  # type: ignore[valid-type]
        if arg not in required:
            hint = hint | None
        annotations[arg] = hint
        default = inspect.Parameter.empty if arg in required else None
        params.append(
            inspect.Parameter(arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=hint)
        )
        lines.append(f"    {arg}: {' '.join(str(spec.get('description', arg)).split())}")
    lines += ["", "Returns:", "    The tool's output."]

    def method(self: TRLEnvironment, *args: Any, **kwargs: Any) -> str:
        bound = signature.bind(self, *args, **kwargs)
        arguments = {k: v for k, v in list(bound.arguments.items())[1:] if v is not None or k in required}
        return self._call(name, arguments)

    signature = inspect.Signature(params, return_annotation=str)
    method.__signature__ = signature  # type: ignore[attr-defined]
    method.__annotations__ = annotations
    method.__name__ = method.__qualname__ = name
    method.__doc__ = "\n".join(lines)
    return method


def trl_environment(env_id: str, env_kwargs: Mapping[str, Any] | None = None) -> type[TRLEnvironment]:
    """A class (TRL's ``environment_factory``) whose instances play episodes of ``env_id``."""
    from toolgym.registry import make

    kwargs = dict(env_kwargs or {})
    probe = make(env_id, **kwargs)
    try:
        _, info = probe.reset(seed=0)
    finally:
        probe.close()
    namespace: dict[str, Any] = {"env_id": env_id, "env_kwargs": kwargs}
    for schema in info["tools"]:
        fn = schema["function"]
        if fn["name"] in _RESERVED or not fn["name"].isidentifier() or fn["name"].startswith("_"):
            raise ConfigError(f"{env_id}: tool name {fn['name']!r} cannot be a TRL environment method")
        namespace[fn["name"]] = _tool_method(fn["name"], fn.get("description", ""), fn["parameters"])
    name = "".join(ch for ch in env_id.split("/")[-1].split("-")[0] if ch.isalnum()) + "TRLEnvironment"
    return type(name, (TRLEnvironment,), namespace)


def trl_dataset(env_id: str, env_kwargs: Mapping[str, Any] | None = None, *, limit: int | None = None) -> Any:
    """A ``datasets.Dataset`` of the environment's tasks: ``prompt`` (a user message) and ``task_id``."""
    try:
        from datasets import Dataset
    except ImportError as exc:
        raise MissingDependencyError("datasets", "trl", "trl_dataset") from exc
    from toolgym.registry import make

    env = make(env_id, **dict(env_kwargs or {}))
    try:
        base: Any = env.unwrapped
        tasks = list(getattr(base, "tasks", ()))
        if not tasks:
            raise ConfigError(f"{env_id} lists no tasks: TRL needs one dataset row per task")
        tasks = tasks[:limit] if limit else tasks
        rows = {
            "prompt": [[{"role": "user", "content": t.prompt}] for t in tasks],
            "task_id": [t.id for t in tasks],
        }
    finally:
        env.close()
    return Dataset.from_dict(rows)
