"""What every learner rank runs in a step, and the checks between ranks (the replicated learner).

:func:`shard_groups` / :func:`shard_plan` split a step's groups between the ranks by token count;
:class:`ReplicatedStep` is one rank's share of a step's gradient, summed over ranks by hand after both
backward phases of the shared-prefix scorer (:mod:`toolgym.training.distributed.learners` explains why), and
:func:`reduce_sums` the step's loss sums; :func:`fingerprint` / :func:`agree` compare the ranks' copies
(:class:`LearnersDiverged`). Pure or collective pieces only: starting, stopping and the messages
between ranks are :mod:`toolgym.training.distributed.learners`; the sharded form is :mod:`toolgym.training.distributed.fsdp`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

import torch

from toolgym.errors import ConfigError, RunStopped
from toolgym.training.learn.grpo import StepPlan, StepSettings, accumulate_gradients
from toolgym.training.learn.loss import LossSums

__all__ = [
    "LearnersDiverged",
    "ReplicatedStep",
    "agree",
    "check_learners",
    "torch_dist",
    "fingerprint",
    "reduce_sums",
    "shard_groups",
    "shard_plan",
    "torchrun_rank",
]

BUCKET = 1 << 24  # gradient elements summed per all_reduce call (64 MiB of fp32)


def shard_groups(sizes: Sequence[int], world: int) -> list[list[int]]:
    """Group indices per rank, balanced by ``sizes`` (token counts): the largest group goes to the
    least loaded rank, ties to the lower index, each rank's list in increasing order. Deterministic."""
    load = [0] * world
    shards: list[list[int]] = [[] for _ in range(world)]
    for g in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        shards[rank].append(g)
        load[rank] += sizes[g]
    return [sorted(s) for s in shards]


def shard_plan(plan: StepPlan, rank: int, world: int) -> StepPlan:
    """Rank ``rank``'s share of ``plan`` (:func:`shard_groups` over each group's token count)."""
    sizes = [sum(len(s.trajectory.token_ids) for s in group) for group in plan.groups]
    mine = shard_groups(sizes, world)[rank]
    return replace(plan, groups=tuple(plan.groups[g] for g in mine))


def torchrun_rank() -> tuple[int, int] | None:
    """``(rank, world_size)`` when this process was started by torchrun with more than one rank."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ or "TOOLGYM_DIST_BACKEND" in os.environ:
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return (int(os.environ.get("RANK", "0")), world) if world > 1 else None


def check_learners(learners: int, backend: str, device: str) -> None:
    """Refuse a process group this machine cannot build (NCCL without CUDA, or with a CPU learner)."""
    if learners < 2:
        return
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError(
            "train.learners.backend = 'nccl' needs CUDA, and torch sees no CUDA device: use 'gloo' on CPU"
        )
    if backend == "nccl" and device == "cpu":
        raise ConfigError(
            "train.learners.backend = 'nccl' with policy.learner_device = 'cpu': NCCL reduces CUDA tensors"
        )


def torch_dist() -> Any:
    import torch.distributed as dist

    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed: train with train.learners.count = 1")
    return dist


class LearnersDiverged(RunStopped):
    """The learners' copies of the model differ: a bug (every rank takes the same step). The run stops;
    a rerun resumes from rank 0's checkpoint and gives every learner those weights again."""


def fingerprint(model: torch.nn.Module) -> torch.Tensor:
    """Per parameter, the fp64 sum and sum of squares of its values: equal on every rank whose copy
    is bit for bit the same (and, in practice, different on any that is not)."""
    rows = [
        torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
        for p in model.parameters()
    ]
    return torch.stack(rows).flatten()


def agree(model: torch.nn.Module, world: int) -> None:
    """Gather every rank's :func:`fingerprint` and raise :class:`LearnersDiverged` unless all are equal."""
    mine = fingerprint(model)  # on the parameters' device: NCCL gathers CUDA tensors
    everyone = [torch.empty_like(mine) for _ in range(world)]
    torch_dist().all_gather(everyone, mine)
    everyone = [t.cpu() for t in everyone]
    differ = [r for r in range(1, world) if not torch.equal(everyone[r], everyone[0])]
    if differ:
        raise LearnersDiverged(
            f"learner rank(s) {differ} hold weights that differ from rank 0's (largest fingerprint gap "
            f"{max(float((everyone[r] - everyone[0]).abs().max()) for r in differ):.3g}): the ranks did not "
            "take the same optimizer step"
        )


def local_gradients(
    model: torch.nn.Module, plan: StepPlan, rank: int, world: int, settings: StepSettings
) -> LossSums:
    """Accumulate this rank's share of the step into ``.grad`` (no collective), each token weighed by
    the whole step's denominators; a rank with no group this step adds nothing."""
    mine = shard_plan(plan, rank, world)
    if not mine.groups:
        return LossSums()
    return accumulate_gradients(
        model, mine, settings, step_tokens=plan.tokens, step_sequences=len(plan.samples)
    )


def reduce_sums(sums: LossSums, device: torch.device) -> LossSums:
    """The step's loss sums added over ranks (every rank calls this; fp64 on ``device``)."""
    totals = torch.tensor(
        [getattr(sums, f.name) for f in fields(LossSums)], dtype=torch.float64, device=device
    )
    torch_dist().all_reduce(totals)
    return LossSums(**{f.name: float(v) for f, v in zip(fields(LossSums), totals.tolist(), strict=True)})


class ReplicatedStep:
    """One learner step's gradient on this rank's share, summed over ranks (every rank runs this)."""

    def __init__(self, model: torch.nn.Module, world: int, rank: int) -> None:
        self.model, self.world, self.rank = model, world, rank
        self.params = [p for p in model.parameters() if p.requires_grad]

    def run(self, plan: StepPlan, settings: StepSettings) -> tuple[LossSums, float]:
        agree(self.model, self.world)
        sums = local_gradients(self.model, plan, self.rank, self.world, settings)
        t0 = time.perf_counter()
        self._reduce_grads()
        reduced = reduce_sums(sums, self.params[0].device)
        return reduced, time.perf_counter() - t0

    def _reduce_grads(self) -> None:
        """Sum ``.grad`` over ranks in fp32 buckets; a parameter no rank produced a gradient for keeps
        ``None`` (as in one process, where the optimizer then skips it)."""
        dist = torch_dist()
        device = self.params[0].device
        present = torch.tensor([p.grad is not None for p in self.params], dtype=torch.int32, device=device)
        dist.all_reduce(present)
        live = [p for p, n in zip(self.params, present.tolist(), strict=True) if n > 0]
        start = 0
        while start < len(live):
            bucket: list[torch.nn.Parameter] = []
            size = 0
            while start < len(live) and (not bucket or size + live[start].numel() <= BUCKET):
                bucket.append(live[start])
                size += live[start].numel()
                start += 1
            flat = torch.cat(
                [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(torch.float32)
                    for p in bucket
                ]
            )
            dist.all_reduce(flat)
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p).to(p.dtype).clone()
                offset += n
