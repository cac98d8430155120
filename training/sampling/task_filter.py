"""Train-split task selection: which training tasks RL spends its rollouts on.

Two signals, both from the training split only. :func:`reference_pool` (``train.task_pool =
"reference"``), once before training: the tasks the environment's scripted reference solver solves
with the tools the agent has. :class:`PassRateFilter` (``train.task_filter = "pass_rate"``), while
training: skip questions the policy currently solves always or never.

A group whose learner rewards are all equal carries no gradient; on a small model most such groups
are tasks it never solves (or, later, always solves). :class:`PassRateFilter` remembers, per training
task, whether its last group had reward variance. When the epoch order comes back to a task whose last
group had none, that task is passed over once (its rollouts are saved) and tried again the time after,
so a task the policy has learned to solve, or has become able to, is not shut out for good.

Only training groups feed it (never held-out tasks); its state is part of the checkpoint, and the
learner consults it only when it admits groups, so runs stay reproducible.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from toolgym.agents.harness import get_harness
from toolgym.agents.policies.base import RulePolicy
from toolgym.agents.rollout import run_episode
from toolgym.core import SamplingParams, Trajectory
from toolgym.env import ToolEnv
from toolgym.errors import ConfigError
from toolgym.registry import env_reference_rule, make
from toolgym.run_files import write_atomic
from toolgym.training.config import RunConfig
from toolgym.training.learn.grpo import informative

__all__ = ["PassRateFilter", "reference_pool", "task_pool"]


class PassRateFilter:
    """Per task: did its last group have reward variance? A task whose last group had none is skipped once."""

    def __init__(self, *, format_credit: float = 0.0, answer_tool: str = "answer") -> None:
        self.format_credit, self.answer_tool = format_credit, answer_tool
        self._settled: dict[str, bool] = {}
        self.skipped = 0

    def observe(self, groups: Sequence[tuple[str, Sequence[Trajectory]]]) -> None:
        """Record ``(task_id, trajectories)`` of groups the learner consumed (trained or dropped)."""
        for task_id, trajectories in groups:
            if any(t.status != "infra_error" for t in trajectories):
                self._settled[task_id] = not informative(trajectories, self.format_credit, self.answer_tool)

    def skip(self, task_id: str) -> bool:
        """Whether to pass over ``task_id`` now (each settled verdict is spent by one skip)."""
        if self._settled.get(task_id, False):
            self._settled[task_id] = False
            self.skipped += 1
            return True
        return False

    def metrics(self) -> dict[str, float]:
        seen = len(self._settled)
        settled = sum(self._settled.values())
        return {
            "task_filter/skipped": float(self.skipped),
            "task_filter/settled_share": settled / seen if seen else 0.0,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"settled": dict(self._settled), "skipped": self.skipped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._settled = {str(k): bool(v) for k, v in state["settled"].items()}
        self.skipped = int(state["skipped"])


async def reference_pool(
    env_id: str,
    env_kwargs: Mapping[str, Any],
    task_ids: Sequence[str],
    *,
    rule: str = "",
    min_reward: float,
    max_tokens: int,
    max_total_tokens: int,
    policy: Any = None,
    concurrency: int = 16,
) -> list[str]:
    """The training tasks the environment's ``reference_rule(task)`` solves (``train.task_pool``).

    A scripted solver that may read the task's reference (SearchQA's: search the question, copy a gold
    answer only if the results show it) is played on every training task, through the environment, with
    the run's turn and episode budgets; a task whose demonstration earns ``min_reward`` is one a policy
    could solve with the tools it has, so its groups can carry reward variance. The rest (a gold answer
    no search shows) would mostly give groups of zeros. The demonstrations are tokenised with
    ``policy``'s tokenizer and chat template (so the token budgets mean what they mean in training).
    Model-free and deterministic: seconds for a thousand tasks. Held-out tasks never enter (the list
    is the trainer's training tasks).

    Raises:
        ConfigError: the environment's module has no ``reference_rule``, or it solves no task.
    """
    import asyncio

    try:
        _, rule_for = env_reference_rule(env_id, env_kwargs, rule)
    except ConfigError as exc:
        raise ConfigError(f"train.task_pool = 'reference': {exc}; or use train.task_pool = 'all'") from None
    envs = [make(env_id, **dict(env_kwargs)) for _ in range(concurrency)]
    try:
        tasks = {t.id: t for t in cast(ToolEnv, envs[0].unwrapped).tasks}
        free = list(envs)
        semaphore = asyncio.Semaphore(concurrency)
        sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0)

        async def solves(task_id: str) -> bool:
            async with semaphore:
                env = free.pop()
                try:
                    t = await run_episode(
                        env,
                        RulePolicy(
                            rule_for(tasks[task_id]),
                            name="reference",
                            tokenizer=getattr(policy, "tokenizer", None),
                            template=getattr(policy, "template", None),
                        ),
                        get_harness("bare"),
                        seed=0,
                        options={"task_id": task_id},
                        sampling=sampling,
                        max_total_tokens=max_total_tokens,
                    )
                finally:
                    free.append(env)
            return t.status == "ok" and t.reward >= min_reward

        verdicts = await asyncio.gather(*(solves(t) for t in task_ids))
    finally:
        for env in envs:
            env.close()
    pool = [t for t, ok in zip(task_ids, verdicts, strict=True) if ok]
    if not pool:
        raise ConfigError(
            f"train.task_pool = 'reference': the reference rule solves none of the {len(task_ids)} training "
            f"tasks at reward >= {min_reward}; use train.task_pool = 'all'"
        )
    return pool


async def task_pool(
    config: RunConfig, run_dir: Path, task_ids: Sequence[str], progress: Any, policy: Any = None
) -> list[str] | None:
    """The tasks RL samples under ``train.task_pool`` (``None``: all of them).

    Decided once per run and kept in ``RUN/task_pool.json``, which a resume reads back.
    """

    tc, env = config.train, config.env
    if tc.task_pool == "all":
        return None
    if config.is_mixture:
        raise ConfigError("train.task_pool = 'reference' is for a run on one environment, not a mixture")
    path = Path(run_dir) / "task_pool.json"
    if path.is_file():
        pool = list(json.loads(path.read_text(encoding="utf-8"))["task_ids"])
    else:
        with progress.task(f"task pool: the reference rule on {len(task_ids)} training tasks"):
            pool = await reference_pool(
                env.id,
                env.kwargs,
                task_ids,
                rule=env.reference_rule,
                min_reward=tc.task_pool_min_reward,
                max_tokens=config.sampling.max_tokens,
                max_total_tokens=env.max_total_tokens,
                policy=policy,
            )
        write_atomic(path, json.dumps({"task_ids": pool, "of": len(task_ids)}) + "\n")
    progress.line(f"task pool: {len(pool)} of {len(task_ids)} training tasks")
    return pool
