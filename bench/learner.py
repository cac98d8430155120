"""Benchmark the learner step, side by side: prefix sharing off, per group, per step; full vs LoRA.

Usage::

    python bench/learner.py [--config learn] [--groups 6] [--modes full-unshared,full-group,full-step,lora-step]
                            [--lora-rank 16] [--rounds 2] [--trajectories FILE] [--threads 2] [--sample] [--smoke]

The shapes are a shipped config's (``--config``; ``learn``: SmolLM2-135M-Instruct on CPU,
``toolgym/SearchQA-v0``, groups of 4, 64 tokens per turn, 2 turns, micro-batches of 4), built as the
trainer builds them. ``--groups`` groups of the config's first tasks, with the tools ``answer`` and
``search``, are made once and saved to ``--trajectories`` (reused when the file exists):

- by default through the real environment and rollout loop with scripted assistant turns of the
  config's turn length (a search call whose query differs per sample, then an answer call, right in
  every other sample), so the prompt, the search results between the turns, the rewards and the
  token layout are real and only the sampled tokens (and their behaviour logprobs, 0.0) are canned;
- with ``--sample``, sampled by the config's own policy (real completions; slow on a loaded machine).

Each round times one learner step (the gradient over every sequence of the step, clipping, the AdamW
step) in each mode, alternating, from the same weights and optimizer state each time:
``full-unshared`` (a full forward and backward pass per sequence), ``full-group`` (each group's
common prefix once), ``full-step`` (what the trainer does: the prompt all groups share once per
step, each group's own prefix once on top of it) and ``lora-step`` (the same with LoRA adapters of
``--lora-rank``, base weights frozen). ``full-step-tokens`` (not in the default list) is ``full-step``
with micro-batches by a token budget (``train.batching.micro_batch_tokens = --micro-batch-tokens``,
by default the count's own bound: ``micro_batch`` x ``env.max_total_tokens``) instead of by count:
longest sequences first, as many to a pass as fit. ``full-step-2`` (not in the default list) is ``full-step`` shared by
two learner processes over gloo (``train.learners.count = 2``): each computes half the groups' gradient,
the sums are all-reduced, both step the optimizer; the weights reach the second process before the
timed step. ``fsdp2-step-2`` is ``full-step-2`` with the model split between the two processes
(``train.learners.shard = "fsdp2"``: FSDP2 shards; the timed step includes gathering the new weights into
rank 0's whole copy). ``full-step-softmax`` is ``full-step`` scoring each row through a log-softmax
over its whole logits (how the learner scored before
:mod:`~toolgym.training.learn.chosen_logprobs`: the logits, their log-softmax and their gradients
are each ``rows x vocabulary`` floats). ``full-step-checkpoint`` is ``full-step`` with the decoder
layers checkpointed (``train.batching.checkpoint_layers``: each keeps only its input and runs again in
the backward pass). Each process uses ``--threads`` threads.

Reported per mode: trainable parameters, seconds per step (best of the rounds), learner tokens/s
(every token of every trained sequence, divided by the step's time: the same work in every mode),
and memory: how far RSS rose above its level before the step (sampled every 10 ms). Loss and
gradient norm are printed too: the full modes agree up to float rounding.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import dataclasses
import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from memory import PeakRSS, self_peak_mb  # bench/memory.py (this script's folder is on sys.path)

from toolgym.agents.chat.chatml import IM_END
from toolgym.agents.policies.base import ScriptedPolicy
from toolgym.agents.rollout import read_trajectories, run_episode, write_trajectories
from toolgym.core import SamplingParams, Trajectory
from toolgym.training.config import load_config
from toolgym.training.distributed.learners import LearnerGroup
from toolgym.training.learn import chosen_logprobs
from toolgym.training.learn.grpo import StepPlan, StepSettings, accumulate_gradients, plan_step
from toolgym.training.learn.lora import trainable_count
from toolgym.training.sampling.workers import make_env
from toolgym.training.trainer import Trainer

TOOLS = ["answer", "search"]


QUERIES = [
    "Panthers defense",
    "points surrendered",
    "Carolina defense points",
    "NFL 2015 defense",
    "Super Bowl 50 Panthers",
    "defense allowed points season",
]


def scripted_turns(policy: ScriptedPolicy, sample: int, max_tokens: int, gold: str) -> list[str]:
    """Two assistant turns of nearly ``max_tokens`` tokens (with ``<|im_end|>``): a search, then an answer.

    Each call is preceded by filler reasoning words until the turn has the demo's length, so the
    calls stay well-formed (the environment runs the search) and every turn is as long as a sampled
    turn that hit the demo's cap.
    """
    search = json.dumps({"name": "search", "arguments": {"query": QUERIES[sample]}})
    # even samples answer correctly, odd ones do not: the group's rewards differ, so it has a gradient
    said = gold if sample % 2 == 0 else f"{300 + sample} points"
    answer = json.dumps({"name": "answer", "arguments": {"answer": said}})
    turns = []
    for payload in (search, answer):
        call = f"<tool_call>{payload}</tool_call>"
        words: list[str] = []
        for phrase in itertools.cycle(("let me look", "this up", "in the documents", "first")):
            if len(policy.tokenizer.encode(" ".join([*words, phrase, call]) + IM_END)) > max_tokens:
                break
            words.append(phrase)
        turns.append(" ".join([*words, call]))
    return turns


async def make_group(trainer: Trainer, index: int, *, sample: bool) -> list[Trajectory]:
    """Group ``index`` of the run's task order with both tools: sampled by the policy, or scripted turns."""
    config = trainer.config
    task = trainer.sampler.task(index)
    envs = [make_env(config.env.id, dict(config.env.kwargs)) for _ in range(config.train.group_size)]
    try:
        episodes = []
        for i, env in enumerate(envs):
            seed = trainer.sampler.episode_seed(index, i)
            sampling = SamplingParams(
                max_tokens=config.sampling.max_tokens, temperature=config.sampling.temperature, seed=seed
            )
            policy = trainer.policy
            if not sample:
                policy = ScriptedPolicy([], tokenizer=trainer.policy.tokenizer)
                policy.template = trainer.policy.template
                gold = next(t.reference[0] for t in env.unwrapped.tasks if t.id == task)
                policy.turns = scripted_turns(policy, i % len(QUERIES), config.sampling.max_tokens, gold)
            episodes.append(
                run_episode(
                    env,
                    policy,
                    trainer.harness,
                    seed=seed,
                    options={"task_id": task, "tools": TOOLS},
                    sampling=sampling,
                    max_total_tokens=config.env.max_total_tokens,
                )
            )
        return list(await asyncio.gather(*episodes))
    finally:
        for env in envs:
            env.close()


MODES = {  # lora, share_prefix, share_across_groups, learner processes
    "full-unshared": (False, False, False, 1),
    "full-group": (False, True, False, 1),
    "full-step": (False, True, True, 1),
    "full-step-tokens": (False, True, True, 1),
    "lora-step": (True, True, True, 1),
    "full-step-2": (False, True, True, 2),
    "fsdp2-step-2": (False, True, True, 2),
    "full-step-softmax": (False, True, True, 1),
    "full-step-checkpoint": (False, True, True, 1),
}
BY_TOKENS = {"full-step-tokens"}  # micro-batches by --micro-batch-tokens, not by count
#: the log-softmax over every row's whole logits, as before the chunked path (chosen_logprobs)
FULL_VOCABULARY = {"full-step-softmax"}
SHARDED = {"fsdp2-step-2"}
CHECKPOINTED = {
    "full-step-checkpoint"
}  # train.batching.checkpoint_layers: decoder layers recomputed  # the learners split the model with FSDP2 (train.learners.shard = "fsdp2")
DEFAULT_MODES = "full-unshared,full-group,full-step,lora-step"


@contextlib.contextmanager
def full_vocabulary(on: bool) -> Iterator[None]:
    """With ``on``, score through each row's whole logits (no model counts as having a plain head)."""
    if not on:
        yield
        return
    plain = chosen_logprobs.lm_parts
    chosen_logprobs.lm_parts = lambda model: None
    try:
        yield
    finally:
        chosen_logprobs.lm_parts = plain


def timed_step(
    trainer: Trainer,
    plan: StepPlan,
    *,
    share: bool,
    across: bool,
    learners: LearnerGroup | None = None,
    budget: int = 0,
    checkpoint: bool = False,
) -> tuple[float, PeakRSS, float, float]:
    """One learner step (gradient over the plan, clip, optimizer step): seconds, memory, loss, grad norm.

    With ``learners`` (a data-parallel group, already given these weights): the gradient is shared
    between its processes and summed (what ``train.learners.count = N`` does); memory is this process's.
    """
    tc = trainer.config.train
    trainer.optimizer.zero_grad()
    settings = StepSettings(
        loss=tc.loss,
        micro_batch=len(plan.samples) if budget else tc.batching.micro_batch,
        micro_batch_tokens=budget,
        temperature=trainer.config.sampling.temperature,
        share_prefix=share,
        checkpoint_layers=checkpoint,
    )
    with PeakRSS() as memory:
        t0 = time.perf_counter()
        if learners is not None:
            sums, _ = learners.accumulate(
                trainer.model, trainer.optimizer, plan, config=trainer.config, step=1, settings=settings
            )
        else:
            sums = accumulate_gradients(
                trainer.model, plan, dataclasses.replace(settings, share_across_groups=across)
            )
        if learners is not None:  # sharded: each rank steps its shards, rank 0 gathers the weights
            norm = learners.optimizer_step(trainer.model, trainer.optimizer, tc.optim.max_grad_norm)
        else:
            norm = trainer.optimizer.step(tc.optim.max_grad_norm)
        seconds = time.perf_counter() - t0
    return seconds, memory, sums.pg, norm


def run(trainers: dict[bool, Trainer], args: argparse.Namespace) -> None:
    first = trainers[False]
    print(f"models loaded; load average {os.getloadavg()[0]:.1f}", flush=True)
    if args.trajectories.exists():
        trajectories = read_trajectories(args.trajectories)
        print(f"groups: {len(trajectories)} trajectories from {args.trajectories}")
    else:
        t0 = time.perf_counter()
        trajectories = [
            t for g in range(args.groups) for t in asyncio.run(make_group(first, g, sample=args.sample))
        ]
        args.trajectories.parent.mkdir(parents=True, exist_ok=True)
        write_trajectories(args.trajectories, trajectories, append=False)
        how = "sampled" if args.sample else "scripted"
        print(f"groups: {how} {len(trajectories)} trajectories in {time.perf_counter() - t0:.0f} s")
    size = first.config.train.group_size
    groups = [tuple(trajectories[i : i + size]) for i in range(0, len(trajectories), size)]
    plan = plan_step(groups, format_credit=first.config.train.format_credit, skip_zero_variance=False)
    lengths = [len(t.token_ids) for t in trajectories]
    print(
        f"{len(groups)} groups x {size}: sequence lengths {min(lengths)}-{max(lengths)}, "
        f"{sum(lengths)} tokens, {plan.tokens} sampled; {len(plan.samples)} sequences train"
    )
    state = {
        lora: (
            {k: v.detach().clone() for k, v in t.model.state_dict().items()},
            copy.deepcopy(t.optimizer.state_dict()),
        )
        for lora, t in trainers.items()
    }
    modes = [m for m in args.modes.split(",") if m]
    results: dict[str, list[tuple[float, PeakRSS, float, float]]] = {m: [] for m in modes}
    groups_of: dict[int, LearnerGroup] = {}
    try:
        for r in range(args.rounds):
            for mode in modes:
                lora, share, across, world = MODES[mode]
                trainer = trainers[lora]
                weights, optimizer = state[lora]
                trainer.model.load_state_dict(weights)
                trainer.optimizer.load_state_dict(optimizer)
                learners = None
                if world > 1:  # the other processes get these weights, outside the timed step
                    learners = groups_of.setdefault(world, LearnerGroup(world))  # one process group
                    learners.shard = "fsdp2" if mode in SHARDED else "none"  # taken at the sync below
                    t0 = time.perf_counter()
                    learners.sync(trainer.model, trainer.optimizer, trainer.config)
                    print(f"round {r + 1} {mode}: weights to the learners {time.perf_counter() - t0:.1f} s")
                budget = args.micro_batch_tokens if mode in BY_TOKENS else 0
                with full_vocabulary(mode in FULL_VOCABULARY):
                    results[mode].append(
                        timed_step(
                            trainer,
                            plan,
                            share=share,
                            across=across,
                            learners=learners,
                            budget=budget,
                            checkpoint=mode in CHECKPOINTED,
                        )
                    )
                print(f"round {r + 1} {mode}: {results[mode][-1][0]:.1f} s", flush=True)
    finally:
        for group in groups_of.values():
            group.close()

    tokens = sum(lengths)
    peak = self_peak_mb()
    print(
        f"\nlearner step, {len(groups)} groups x {size} sequences, {tokens} tokens, micro_batch {first.config.train.batching.micro_batch}"
    )
    print(
        "| mode | trainable params | s/step (best) | s/step (median) | tokens/s | RSS rise in step | loss/pg | grad norm |"
    )
    print("|---|---|---|---|---|---|---|---|")
    best = {}
    for mode in modes:
        runs = results[mode]
        best[mode] = min(x[0] for x in runs)
        rise = max(x[1].rise for x in runs) / 2**20
        _, _, pg, norm = runs[0]
        params = trainable_count(trainers[MODES[mode][0]].model)
        print(
            f"| {mode} | {params / 1e6:.2f}M | {best[mode]:.1f} | {statistics.median(x[0] for x in runs):.1f} | "
            f"{tokens / best[mode]:.0f} | {rise:.0f} MiB | {pg:+.6f} | {norm:.6f} |"
        )
    base = modes[0]
    ratios = "; ".join(f"{m}: {best[base] / best[m]:.2f}x the speed of {base}" for m in modes[1:])
    print(f"\n{ratios}; process peak RSS {peak:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="timed steps per mode (alternating)")
    parser.add_argument("--config", default="learn", help="the shipped config whose shapes to use")
    parser.add_argument("--groups", type=int, default=6, help="groups in the step")
    parser.add_argument(
        "--modes",
        default=DEFAULT_MODES,
        help=f"comma-separated, of {', '.join(MODES)} (full-step-2: full-step shared by 2 learner "
        "processes; fsdp2-step-2: the same, the model sharded between them)",
    )
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of the lora-* modes")
    parser.add_argument(
        "--trajectories",
        type=Path,
        default=Path("runs/bench-learner-groups.jsonl"),
        help="the groups' JSONL: reused when it exists, written otherwise",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=0,
        help="the full-step-tokens mode's train.batching.micro_batch_tokens (default: the config's "
        "micro_batch times env.max_total_tokens, the memory bound micro-batches by count promise)",
    )
    parser.add_argument("--sample", action="store_true", help="sample the groups with the policy")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="groups of 2 and the tiny byte-level model instead of SmolLM2: runs the script end to end in "
        "seconds for tests; its numbers mean nothing",
    )
    args = parser.parse_args()
    unknown = [m for m in args.modes.split(",") if m and m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")

    overrides = [
        f"policy.threads={args.threads}",
        "train.skip_zero_variance=false",
        "policy.kind=hf",
        "heldout.n=0",
    ]
    smoke = (
        ["train.group_size=2", "policy.kind=tiny", "policy.hidden=32", "env.max_total_tokens=4096"]
        if args.smoke
        else []
    )
    with tempfile.TemporaryDirectory() as full_dir, tempfile.TemporaryDirectory() as lora_dir:
        trainers: dict[bool, Trainer] = {}
        try:
            trainers[False] = Trainer(load_config(args.config, [*overrides, *smoke]), full_dir)
            if any(MODES[m][0] for m in args.modes.split(",") if m in MODES):
                lora = [f"train.lora.rank={args.lora_rank}"]
                trainers[True] = Trainer(load_config(args.config, [*overrides, *smoke, *lora]), lora_dir)
            if not args.micro_batch_tokens:
                config = trainers[False].config
                args.micro_batch_tokens = config.train.batching.micro_batch * config.env.max_total_tokens
            run(trainers, args)
        finally:
            for trainer in trainers.values():
                trainer.close()


if __name__ == "__main__":
    main()
