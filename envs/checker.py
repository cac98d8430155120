"""toolgym's environment checker: gymnasium's ``check_env`` plus the contract toolgym adds on top.

Gymnasium's checker (:func:`gymnasium.utils.env_checker.check_env`) covers the API: spaces, the
``reset``/``step`` signatures and types, seeding of ``np_random``. A toolgym environment promises more,
and :func:`check_env` checks that too, using only the public protocol (``reset``/``step``/``close``,
``info`` keys, ``options``), so it works for any environment that claims the contract, subclass of
:class:`~toolgym.env.ToolEnv` or not:

* **versioned id** — a registered environment's id is ``<namespace>/<Name>-v<N>`` (a behaviour change
  bumps ``N``);
* **reset info** — ``info`` holds ``task_id``, ``allowed_tools`` and ``max_turns``;
* **seeding** — the same seed gives the same task and the same first observation; with more than one
  task, different seeds do not all give the same task;
* **sparse terminal reward** — the reward is 0 on every step that does not end the episode, and
  ``max_turns`` non-terminal turns truncate the episode (``env/truncated`` in the metrics); a step
  after the end raises :class:`~toolgym.errors.ToolgymError` asking for ``reset``;
* **the model's mistakes are observations** — a call to an unknown tool and malformed calls (bad
  JSON, lone tags, a JSON array) come back as ``tool`` messages starting with ``Error: ``, never as
  exceptions, with reward 0 and the episode still running;
* **tool restriction** — ``options={"tools": []}`` keeps a non-empty subset (the terminal tool, so
  an episode can always end) and an unknown tool name is a :class:`~toolgym.errors.ConfigError`;
* **mid-episode unlocks** — ``options={"unlocks": [{"tool": T, "after": {"turn": 1}}]}`` (see
  :mod:`toolgym.unlocks`) withholds a non-terminal tool ``T`` at reset and, after turn 1, appends its
  schema to the observation, reports it in ``info["unlocked"]`` and allows it; a rule for an unknown
  tool is a :class:`~toolgym.errors.ConfigError` at reset;
* **close** — ``close()`` may be called twice (an error from the second call propagates).

The checker closes the environment when it is done (the last check), so pass one made for it:
``check_env(gymnasium.make(env_id))``. A failed check raises :class:`EnvCheckError` (an
``AssertionError``, as gymnasium's checker raises) whose message says which promise broke and what was
seen. It never scores an answer, so it needs no verifier backend (no Docker engine for
``toolgym/CodeExec-v0``).
"""

from __future__ import annotations

from typing import Any

import gymnasium
from gymnasium.utils.env_checker import check_env as gymnasium_check_env

from toolgym.errors import ConfigError, ToolgymError

__all__ = ["MALFORMED_ACTIONS", "EnvCheckError", "check_env"]

#: Assistant turns that are malformed tool calls; each must come back as an ``Error: `` observation.
MALFORMED_ACTIONS = (
    "<tool_call>{not json</tool_call>",
    "<tool_call>",
    "</tool_call>",
    "<tool_call>[]</tool_call>",
)
_UNKNOWN_TOOL = "toolgym_check_no_such_tool"
_UNKNOWN_CALL = f'<tool_call>{{"name": "{_UNKNOWN_TOOL}", "arguments": {{}}}}</tool_call>'


class EnvCheckError(AssertionError):
    """An environment broke a promise of the toolgym environment contract (see the module docstring)."""


def _require(condition: bool, message: str) -> None:
    # Not ``assert``: the checks must also run under ``python -O``.
    if not condition:
        raise EnvCheckError(message)


def check_env(env: gymnasium.Env, *, seeds: int = 8, skip_gymnasium: bool = False) -> None:
    """Check ``env`` against gymnasium's checker and toolgym's contract, then close it.

    Args:
        env: a fresh environment (wrapped, as ``gymnasium.make`` returns it, or not).
        seeds: how many seeds the seeding checks reset with (``0 .. seeds - 1``).
        skip_gymnasium: leave out gymnasium's own checker (for a caller that has just run it).

    Raises:
        EnvCheckError: a broken promise, naming it and what was seen.
        AssertionError: from gymnasium's checker.
    """
    name = env.spec.id if env.spec is not None else type(env.unwrapped).__name__
    if env.spec is not None:
        _require(
            "/" in env.spec.id and env.spec.version is not None,
            f"{name}: register toolgym environments as '<namespace>/<Name>-v<N>' (versioned, so a "
            "behaviour change can bump the version)",
        )
    if not skip_gymnasium:
        gymnasium_check_env(env.unwrapped)
    _check_seeding(env, name, seeds)
    _check_sparse_reward_and_truncation(env, name)
    _check_malformed_calls(env, name)
    _check_tool_restriction(env, name)
    _check_unlocks(env, name)
    env.close()
    env.close()  # close() is idempotent: a second call that raises fails the check with its error


def _reset(env: gymnasium.Env, name: str, **kwargs: Any) -> tuple[list, dict]:
    obs, info = env.reset(**kwargs)
    missing = [key for key in ("task_id", "allowed_tools", "max_turns") if key not in info]
    _require(not missing, f"{name}: reset() info lacks {missing} (toolgym envs report them at every reset)")
    return obs, info


def _check_seeding(env: gymnasium.Env, name: str, seeds: int) -> None:
    first = [_reset(env, name, seed=s) for s in range(seeds)]
    again = [_reset(env, name, seed=s) for s in range(seeds)]
    for s, ((obs_a, info_a), (obs_b, info_b)) in enumerate(zip(first, again, strict=True)):
        _require(
            info_a["task_id"] == info_b["task_id"],
            f"{name}: reset(seed={s}) chose task {info_a['task_id']!r}, then {info_b['task_id']!r}: "
            "the same seed must choose the same task",
        )
        _require(obs_a == obs_b, f"{name}: reset(seed={s}) twice gave different first observations")
    task_ids = getattr(env.unwrapped, "task_ids", None)
    if callable(task_ids) and len(task_ids()) > 1 and seeds > 1:
        chosen = {info["task_id"] for _, info in first}
        _require(
            len(chosen) > 1,
            f"{name}: seeds 0..{seeds - 1} all chose task {chosen.pop()!r}; the seed must drive the choice",
        )


def _check_sparse_reward_and_truncation(env: gymnasium.Env, name: str) -> None:
    _, info = _reset(env, name, seed=0)
    limit = int(info["max_turns"])
    for turn in range(1, limit + 1):
        obs, reward, terminated, truncated, info = env.step(_UNKNOWN_CALL)
        _require(
            reward == 0.0 and not terminated,
            f"{name}: turn {turn}, a call to an unknown tool, gave reward {reward!r} and "
            f"terminated={terminated}; the reward is 0 until the terminal step",
        )
        _require(
            bool(obs) and str(obs[0].get("content", "")).startswith(f"Error: unknown tool '{_UNKNOWN_TOOL}'"),
            f"{name}: a call to an unknown tool must come back as an 'Error: unknown tool ...' "
            f"observation, got {obs!r}",
        )
        _require(
            truncated == (turn == limit),
            f"{name}: turn {turn} of max_turns={limit} gave truncated={truncated}",
        )
    _require(
        info.get("metrics", {}).get("env/truncated") == 1.0,
        f"{name}: the truncating step's info['metrics'] must hold env/truncated = 1.0, got {info.get('metrics')!r}",
    )
    try:
        env.step("one more turn")
    except ToolgymError as exc:
        _require("call reset" in str(exc), f"{name}: step() after the end must say 'call reset', said {exc}")
    else:
        raise EnvCheckError(f"{name}: step() after the episode ended must raise ToolgymError (call reset)")


def _check_malformed_calls(env: gymnasium.Env, name: str) -> None:
    _reset(env, name, seed=1)
    for action in MALFORMED_ACTIONS:
        try:
            obs, reward, terminated, truncated, _ = env.step(action)
        except ToolgymError as exc:
            raise EnvCheckError(
                f"{name}: the malformed call {action!r} raised {exc!r}; it must become an observation"
            ) from exc
        _require(
            bool(obs) and all(m["role"] == "tool" and m["content"].startswith("Error: ") for m in obs),
            f"{name}: the malformed call {action!r} must give 'Error: ' tool messages, got {obs!r}",
        )
        _require(
            reward == 0.0 and not terminated,
            f"{name}: the malformed call {action!r} gave reward {reward!r}, terminated={terminated}",
        )
        if truncated:
            _reset(env, name, seed=1)


def _check_tool_restriction(env: gymnasium.Env, name: str) -> None:
    _, info = _reset(env, name, seed=0)
    tools = set(info["allowed_tools"])
    _, restricted = _reset(env, name, seed=0, options={"tools": []})
    kept = set(restricted["allowed_tools"])
    _require(
        bool(kept) and kept <= tools and (kept < tools or len(tools) == 1),
        f"{name}: options={{'tools': []}} must keep only the terminal tool(s) of {sorted(tools)}, "
        f"kept {sorted(kept)}",
    )
    try:
        _reset(env, name, seed=0, options={"tools": [_UNKNOWN_TOOL]})
    except ConfigError as exc:
        _require(
            "unknown tool" in str(exc), f"{name}: an unknown tool name must say 'unknown tool', said {exc}"
        )
    else:
        raise EnvCheckError(f"{name}: options={{'tools': [{_UNKNOWN_TOOL!r}]}} must raise ConfigError")


def _check_unlocks(env: gymnasium.Env, name: str) -> None:
    _, info = _reset(env, name, seed=0)
    _, restricted = _reset(env, name, seed=0, options={"tools": []})
    optional = [t for t in info["allowed_tools"] if t not in restricted["allowed_tools"]]
    if optional and int(info["max_turns"]) >= 2:
        tool = optional[0]
        _, info = _reset(env, name, seed=0, options={"unlocks": [{"tool": tool, "after": {"turn": 1}}]})
        _require(
            tool not in info["allowed_tools"],
            f"{name}: a tool with an unlock rule must be withheld at reset, but {tool!r} is allowed",
        )
        obs, _, terminated, truncated, step_info = env.step(_UNKNOWN_CALL)
        unlocked = [u.get("tool") for u in step_info.get("unlocked", [])]
        _require(
            not (terminated or truncated)
            and unlocked == [tool]
            and tool in step_info.get("allowed_tools", []),
            f"{name}: the rule 'unlock {tool!r} after turn 1' must fire after turn 1 (info['unlocked'] and "
            f"info['allowed_tools'] name it), got info {step_info!r}",
        )
        _require(
            bool(obs) and f'"name": "{tool}"' in str(obs[-1].get("content", "")),
            f"{name}: the step that unlocks {tool!r} must end its observation with the tool's schema, "
            f"got {obs!r}",
        )
    try:
        _reset(env, name, seed=0, options={"unlocks": [{"tool": _UNKNOWN_TOOL, "after": {"turn": 1}}]})
    except ConfigError as exc:
        _require(
            "unknown tool" in str(exc),
            f"{name}: an unlock rule for an unknown tool must say 'unknown tool', said {exc}",
        )
    else:
        raise EnvCheckError(
            f"{name}: an unlock rule for the unknown tool {_UNKNOWN_TOOL!r} must raise ConfigError"
        )
