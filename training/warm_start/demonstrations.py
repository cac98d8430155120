"""Warm start: a short rejection-sampled fine-tune on the policy's own successful episodes.

Why. A 135M model rarely finds reward on its own in a multi-turn tool task: it writes malformed calls,
answers without searching, or answers with a whole sentence. GRPO learns only from groups whose
rewards differ, so most early groups carry no signal. The warm start samples the *untrained* policy on
the training tasks, keeps the episodes the verifier rewarded (``reward >= min_reward``, no parse
error, status ``ok``), and fine-tunes on their sampled tokens: the model is taught nothing it did not
already produce, only to produce its own successes more often (rejection sampling, as in expert
iteration / STaR). RL then starts from a policy whose groups have variance.

Contract:

* only the trainer's task list is sampled (the train split): held-out tasks never enter the warm start;
* the loss is the mean negative log-likelihood of mask-1 tokens (the policy's own sampled ids, kept
  exactly: the same receipts as RL are checked); prompt, tool output and harness text are never trained;
* the result is recorded (``warm_start.json`` in the run directory: episodes sampled, kept, mean reward,
  loss per epoch, the weights' hash) and is part of the checkpoint, so a resumed run never repeats it;
* it is deterministic for a seeded policy on one machine and software stack, and checked so: a run
  that reuses another's warm start loads its step-0 export, or rebuilds it when the weights are not
  on disk (only that run's ``config.json`` and ``warm_start.json``, or its result file, are), and the
  weights it ends with must have the recorded hash;
* its gain is reported separately from RL's: a run with ``train.optim.lr = 0`` keeps the warm start and
  is the control that isolates the RL updates.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from toolgym.agents.policies.base import RulePolicy
from toolgym.agents.rollout import run_episode
from toolgym.core import Harness, Policy, SamplingParams, Trajectory
from toolgym.env import ToolEnv
from toolgym.errors import ConfigError
from toolgym.registry import env_reference_rule, make
from toolgym.run_files import write_atomic
from toolgym.training.config.sections import WarmStartConfig
from toolgym.training.learn.grpo import check_token_receipt
from toolgym.training.learn.scoring import SequenceScorer

if TYPE_CHECKING:
    import torch

__all__ = ["WarmStartResult", "fine_tune", "rejection_sample", "sampled_nll"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmStartResult:
    """What the warm start did; written to ``warm_start.json`` and kept in the checkpoint."""

    sampled: int
    kept: int
    tasks_with_success: int
    tasks: int
    mean_reward: float
    mean_kept_reward: float
    epoch_losses: tuple[float, ...]
    tokens: int
    seconds: float
    infra_errors: int = 0
    kept_task_ids: tuple[str, ...] = field(default_factory=tuple)
    #: the tools the demonstrations' prompt offered (empty: every tool of the environment)
    tools: tuple[str, ...] = field(default_factory=tuple)
    #: the warm-started weights' hash (``weights_sha256``): what a rebuilt or reused warm start is checked by
    weights_sha256: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "sampled": self.sampled,
            "kept": self.kept,
            "tasks_with_success": self.tasks_with_success,
            "tasks": self.tasks,
            "mean_reward": self.mean_reward,
            "mean_kept_reward": self.mean_kept_reward,
            "epoch_losses": list(self.epoch_losses),
            "tokens": self.tokens,
            "seconds": self.seconds,
            "infra_errors": self.infra_errors,
            "kept_task_ids": list(self.kept_task_ids),
            "tools": list(self.tools),
            "weights_sha256": self.weights_sha256,
        }

    def write(self, run_dir: str | Path) -> Path:
        path = Path(run_dir) / "warm_start.json"
        write_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")  # never through a planted link
        return path


def reference_demonstrator(
    env_id: str, env_kwargs: dict[str, Any], policy: Any, rule: str = ""
) -> Callable[[str], Policy]:
    """``task_id -> policy`` playing the environment module's reference rule ``rule`` (empty: the one it
    names for ``env_kwargs``; :func:`toolgym.registry.env_reference_rule`) in ``policy``'s own tokenizer
    and chat template (``warm_start.source = "reference"``)."""

    tokenizer, template = getattr(policy, "tokenizer", None), getattr(policy, "template", None)
    if tokenizer is None:
        raise ConfigError(
            "warm_start.source = 'reference' needs a policy with a tokenizer; use warm_start.source = "
            "'self' (rejection sampling)"
        )
    try:
        _, rule_for = env_reference_rule(env_id, env_kwargs, rule)
    except ConfigError as exc:
        raise ConfigError(
            f"warm_start.source = 'reference': {exc}; or use warm_start.source = 'self'"
        ) from None
    probe = make(env_id, **env_kwargs)
    try:
        tasks = {t.id: t for t in cast(ToolEnv, probe.unwrapped).tasks}
    finally:
        probe.close()
    return lambda task_id: RulePolicy(
        rule_for(tasks[task_id]), name="reference", tokenizer=tokenizer, template=template
    )


def _usable(trajectory: Trajectory, min_reward: float) -> bool:
    return (
        trajectory.status == "ok"
        and trajectory.reward >= min_reward
        and trajectory.metrics.get("env/parse_errors", 0.0) == 0.0
        and sum(trajectory.loss_mask) > 0
    )


async def rejection_sample(
    make_env: Callable[[], Any],
    policy: Policy,
    harness: Harness,
    task_ids: Sequence[str],
    config: WarmStartConfig,
    *,
    seed: int,
    max_tokens: int,
    max_total_tokens: int,
    progress: Callable[[int, int], None] | None = None,
    policy_for: Callable[[str], Policy] | None = None,
) -> tuple[list[Trajectory], list[Trajectory]]:
    """Sample ``config.samples`` episodes per task; return ``(all episodes, kept episodes)``.

    ``policy_for(task_id)``, when given, supplies the policy of each episode (a reference
    demonstrator); otherwise ``policy`` samples every episode.

    Episode ``j`` of task ``i`` is seeded ``seed + i * samples + j`` (deterministic for a seeded
    policy). Kept episodes are those passing :func:`_usable`, at most ``keep_per_task`` per task (best
    rewards first, ties in sampling order).
    """

    ids = list(task_ids)
    if config.tasks and config.tasks < len(ids):
        ids = random.Random(seed).sample(ids, config.tasks)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=config.temperature)
    options_tools = {"tools": list(config.tools)} if config.tools else {}
    semaphore = asyncio.Semaphore(config.concurrency)
    envs: list[Any] = []
    total, done = len(ids) * config.samples, 0

    async def one(i: int, j: int, task_id: str) -> Trajectory:
        nonlocal done
        async with semaphore:
            env = envs.pop() if envs else make_env()
            try:
                trajectory = await run_episode(
                    env,
                    policy_for(task_id) if policy_for is not None else policy,
                    harness,
                    seed=seed + i * config.samples + j,
                    options={"task_id": task_id, **options_tools},
                    sampling=sampling,
                    max_total_tokens=max_total_tokens,
                )
            finally:
                envs.append(env)
        done += 1
        if progress is not None:
            progress(done, total)
        return trajectory

    try:
        episodes = await asyncio.gather(
            *(one(i, j, task_id) for i, task_id in enumerate(ids) for j in range(config.samples))
        )
    finally:
        for env in envs:
            env.close()
    kept: list[Trajectory] = []
    for i in range(len(ids)):
        mine = [
            t
            for t in episodes[i * config.samples : (i + 1) * config.samples]
            if _usable(t, config.min_reward)
        ]
        mine.sort(key=lambda t: -t.reward)  # stable: ties stay in sampling order
        kept.extend(mine[: config.keep_per_task] if config.keep_per_task else mine)
    return list(episodes), kept


def sampled_nll(model: torch.nn.Module, chunk: Sequence[Trajectory]) -> tuple[torch.Tensor, int]:
    """Summed negative log-likelihood of the chunk's mask-1 tokens, and how many there are.

    Only the positions that predict a sampled token go through the output layer
    (``logits_to_keep``): a SearchQA episode is ~800 tokens of which ~80 are sampled, and full-vocabulary
    logits over every position would cost ~10x the memory (a micro-batch of 8 episodes needed ~18 GB
    that way on SmolLM2's 49k vocabulary). The values equal :func:`~toolgym.training.learn.loss.token_logprobs`
    at those positions (temperature 1), as a test checks.
    """
    import torch

    device = next(model.parameters()).device
    length = max(len(t.token_ids) for t in chunk)
    ids = torch.zeros((len(chunk), length), dtype=torch.long)
    valid = torch.zeros((len(chunk), length), dtype=torch.long)
    mask = torch.zeros((len(chunk), length), dtype=torch.float32)
    for row, t in enumerate(chunk):
        ids[row, : len(t.token_ids)] = torch.tensor(t.token_ids, dtype=torch.long)
        valid[row, : len(t.token_ids)] = 1
        mask[row, : len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=torch.float32)
    mask[:, 0] = 0.0  # the first token has no prefix to predict it from
    targets = torch.nonzero(mask.any(dim=0)).squeeze(-1)  # positions holding a sampled token (any row)
    if targets.numel() == 0:
        return torch.zeros((), device=device, requires_grad=True), 0
    ids, valid, mask, targets = ids.to(device), valid.to(device), mask.to(device), targets.to(device)
    logits = model(input_ids=ids, attention_mask=valid, logits_to_keep=targets - 1).logits.float()
    logp = torch.log_softmax(logits, dim=-1)  # [B, K, V]: position targets[k] - 1 predicts targets[k]
    taken = torch.gather(logp, -1, ids[:, targets].unsqueeze(-1)).squeeze(-1)
    weights = mask[:, targets]
    return -(taken * weights).sum(), int(weights.sum().item())


def shared_nll(
    model: torch.nn.Module, chunk: Sequence[Trajectory], *, checkpoint_layers: bool = False
) -> tuple[torch.Tensor, int, Callable[[], None]]:
    """:func:`sampled_nll` with the chunk's common prefix computed once; also returns ``finish``.

    Demonstrations start with the same system text, tool schemas and worked turn (about 470 of a
    SearchQA episode's ~800 tokens), so the chunk is scored through a
    :class:`~toolgym.training.learn.scoring.SequenceScorer`: the prefix runs once, each row only its own
    suffix. Call ``finish()`` right after ``nll.backward()``: it sends the prefix's share of the
    gradient through the prefix once. The value and the gradient equal :func:`sampled_nll`'s (a test
    checks both within 1e-5); without a common prefix of two tokens this is :func:`sampled_nll`.
    ``checkpoint_layers``: the suffixes' decoder layers run checkpointed (same value and gradient).
    """
    import torch

    seqs = [t.token_ids for t in chunk]
    masks = [[0, *t.loss_mask[1:]] for t in chunk]  # the first token has no prefix to predict it from
    scorer = (
        SequenceScorer(model, seqs, masks=masks, checkpoint=checkpoint_layers) if len(chunk) > 1 else None
    )
    if scorer is None or not scorer.shared:
        nll, tokens = sampled_nll(model, chunk)
        return nll, tokens, lambda: None
    logp = scorer.logprobs(seqs, masks)
    weights = torch.zeros(logp.shape, dtype=logp.dtype, device=logp.device)
    for row, mask in enumerate(masks):
        weights[row, : len(mask)] = torch.tensor(mask, dtype=logp.dtype)
    return -(logp * weights).sum(), int(sum(map(sum, masks))), scorer.backward


def fine_tune(
    model: torch.nn.Module,
    trajectories: Sequence[Trajectory],
    config: WarmStartConfig,
    *,
    seed: int,
    lock: Any = None,
    progress: Callable[[int, int], None] | None = None,
    checkpoint_layers: bool = False,
) -> list[float]:
    """Minimise the mean NLL of the trajectories' mask-1 tokens; returns the mean loss of each epoch.

    One optimizer step per micro-batch, on that micro-batch's mean token NLL. ``lock`` (the policy's
    weights lock) is held around each update so a concurrent sampler never sees half-updated weights.
    ``progress(done, total)`` is called after every optimizer step (``total``: epochs x micro-batches).
    ``checkpoint_layers`` (``train.batching.checkpoint_layers``): the shared-prefix path's suffix passes
    run their decoder layers checkpointed.
    """
    import torch

    trajectories = [v for t in trajectories for v in t.segment_views()]  # a compacted episode: each segment
    if not trajectories:
        return []
    for trajectory in trajectories:
        check_token_receipt(trajectory)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr)
    order = list(range(len(trajectories)))
    rng = random.Random(seed)
    losses: list[float] = []
    total = config.epochs * -(-len(order) // config.micro_batch)
    done = 0
    for _ in range(config.epochs):
        rng.shuffle(order)
        epoch_nll, epoch_tokens = 0.0, 0
        for start in range(0, len(order), config.micro_batch):
            chunk = [trajectories[k] for k in order[start : start + config.micro_batch]]
            optimizer.zero_grad(set_to_none=True)
            nll, tokens, finish = shared_nll(model, chunk, checkpoint_layers=checkpoint_layers)
            (nll / max(tokens, 1)).backward()
            finish()
            if lock is not None:
                with lock:
                    optimizer.step()
            else:
                optimizer.step()
            epoch_nll += float(nll.detach())
            epoch_tokens += tokens
            done += 1
            if progress is not None:
                progress(done, total)
        losses.append(epoch_nll / max(epoch_tokens, 1))
    optimizer.zero_grad(set_to_none=True)
    return losses


def summarize(
    episodes: Sequence[Trajectory],
    kept: Sequence[Trajectory],
    losses: Sequence[float],
    started: float,
    *,
    tools: tuple[str, ...] = (),
) -> WarmStartResult:
    """The :class:`WarmStartResult` of one warm start."""
    scored = [t for t in episodes if t.status != "infra_error"]
    tasks = {t.task_id for t in episodes}
    return WarmStartResult(
        sampled=len(episodes),
        kept=len(kept),
        tasks_with_success=len({t.task_id for t in kept}),
        tasks=len(tasks),
        mean_reward=sum(t.reward for t in scored) / max(len(scored), 1),
        mean_kept_reward=sum(t.reward for t in kept) / max(len(kept), 1),
        epoch_losses=tuple(losses),
        tokens=sum(sum(v.loss_mask) for t in kept for v in t.segment_views()),
        seconds=time.perf_counter() - started,
        infra_errors=len(episodes) - len(scored),
        kept_task_ids=tuple(sorted({t.task_id for t in kept})),
        tools=tools,
    )
