"""Shared test builders for the training tests: the tiny-run overrides and hand-made trajectories."""

from __future__ import annotations

from collections.abc import Sequence

from toolgym.core import Trajectory, sampled_ids_hash


def tiny_overrides(*, steps: int = 2, tasks_per_step: int = 2, group_size: int = 4) -> list[str]:
    """Config overrides for a seconds-long run: the byte-level tiny model on the toy Letters env."""
    return [
        "env.id=toy_env:toolgym-test/Letters-v0",
        "policy.kind=tiny",
        "policy.hidden=32",
        "sampling.max_tokens=12",
        f"train.steps={steps}",
        f"train.tasks_per_step={tasks_per_step}",
        f"train.group_size={group_size}",
        "train.optim.lr=0.01",
        "train.rollouts.max_off_policy_steps=0",
    ]


def trajectory(
    ids: Sequence[int],
    mask: Sequence[int],
    *,
    logprobs: Sequence[float] | None = None,
    reward: float = 1.0,
    status: str = "ok",
    env_id: str = "x",
    **metrics: float,
) -> Trajectory:
    """A finished episode with the given tokens and loss mask and a valid token receipt.

    ``logprobs`` default to 0.0 per token (the behaviour logprobs a test does not care about).
    """
    return Trajectory(
        env_id=env_id,
        task_id="t",
        seed=0,
        harness="bare",
        allowed_tools=(),
        messages=(),
        token_ids=tuple(ids),
        loss_mask=tuple(mask),
        logprobs=tuple(logprobs) if logprobs is not None else tuple(0.0 for _ in ids),
        reward=reward,
        metrics=dict(metrics),
        status=status,
        policy_version=0,
        timings={},
        token_hash=sampled_ids_hash(ids, mask),
    )
