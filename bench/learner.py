"""Benchmark the learner step with and without shared-prefix scoring, side by side, on the demo's shapes.

Usage::

    python bench/learner.py [--rounds 2] [--trajectories FILE] [--threads 2] [--sample] [--smoke]

The demo (``training/configs/demo.toml``: SmolLM2-135M-Instruct on CPU, ``toolgym/SearchQA-v0``,
groups of 6, 48 tokens per turn, 2 turns, micro-batches of 3) is built as the trainer builds it. One
group of 6 trajectories of the demo's first task, with both of the demo's tools (``answer`` and
``search``), is made once and saved to ``--trajectories`` (reused when the file exists):

- by default through the real environment and rollout loop with scripted assistant turns of 48 tokens
  each (a search call whose query differs per sample, then an answer call, right in every other
  sample), so the prompt, the search results between the turns, the rewards and the token layout
  are real and only the sampled tokens (and their behaviour logprobs, 0.0) are canned;
- with ``--sample``, sampled by the demo's own policy (real completions; slow on a loaded machine).

Each round then times the trainer's own learner
step (``Trainer._learn``: loss, backward, clipping, AdamW step) on that group with
``train.share_prefix = false`` (a full forward and backward pass per sequence) and ``true`` (the
group's common prompt prefix once), alternating, from the same weights and optimizer state each time.

Reported per mode: seconds per step (best of the rounds), learner tokens/s (every token of every
trained sequence, divided by the step's time: the same work in both modes), and memory: the process's
peak RSS and how far RSS rose above its level before the step (sampled every 10 ms). The loss and
gradient norm of the two modes are printed too; they agree up to float rounding.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import os
import resource
import statistics
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from toolgym.agents.chat import IM_END
from toolgym.agents.policy import ScriptedPolicy
from toolgym.agents.rollout import read_trajectories, run_episode, write_trajectories
from toolgym.core import SamplingParams, Trajectory
from toolgym.training.config import load_config
from toolgym.training.rollouts import Group, make_env
from toolgym.training.trainer import Trainer

TOOLS = ["answer", "search"]


def rss_bytes() -> int:
    """Current resident set size of this process (Linux ``/proc``)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


class PeakRSS:
    """Samples RSS in a thread while a block runs; ``rise`` is the peak above the level at entry."""

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.rise = self.peak - self.start


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


async def make_group(trainer: Trainer, *, sample: bool) -> list[Trajectory]:
    """One group of the demo's first task with both tools: sampled by the policy, or scripted turns."""
    config = trainer.config
    task = trainer.sampler.task(0)
    envs = [make_env(config.env.id, dict(config.env.kwargs)) for _ in range(config.train.group_size)]
    try:
        episodes = []
        for i, env in enumerate(envs):
            seed = trainer.sampler.episode_seed(0, i)
            sampling = SamplingParams(
                max_tokens=config.sampling.max_tokens, temperature=config.sampling.temperature, seed=seed
            )
            policy = trainer.policy
            if not sample:
                policy = ScriptedPolicy([], tokenizer=trainer.policy.tokenizer)
                policy.template = trainer.policy.template
                gold = next(t.reference[0] for t in env.unwrapped.tasks if t.id == task)
                policy.turns = scripted_turns(policy, i, config.sampling.max_tokens, gold)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="timed steps per mode (alternating)")
    parser.add_argument(
        "--trajectories",
        type=Path,
        default=Path("runs/bench-learner-group.jsonl"),
        help="the group's JSONL: reused when it exists, written otherwise",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the demo uses 2)")
    parser.add_argument("--sample", action="store_true", help="sample the group with the policy")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a group of 2 and the tiny byte-level model instead of SmolLM2: runs the script end to end in "
        "seconds for tests; its numbers mean nothing",
    )
    args = parser.parse_args()

    overrides = [f"policy.threads={args.threads}", "train.skip_zero_variance=false"]
    smoke = ["train.group_size=2", "policy.kind=tiny", "policy.tiny_hidden=32"] if args.smoke else []
    config = load_config("demo", [*overrides, *smoke])
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(config, run_dir)
        try:
            run(trainer, args)
        finally:
            trainer.close()


def run(trainer: Trainer, args: argparse.Namespace) -> None:
    print(f"model loaded; load average {os.getloadavg()[0]:.1f}", flush=True)
    if args.trajectories.exists():
        trajectories = read_trajectories(args.trajectories)
        print(f"group: {len(trajectories)} trajectories from {args.trajectories}")
    else:
        t0 = time.perf_counter()
        trajectories = asyncio.run(make_group(trainer, sample=args.sample))
        args.trajectories.parent.mkdir(parents=True, exist_ok=True)
        write_trajectories(args.trajectories, trajectories, append=False)
        how = "sampled" if args.sample else "scripted"
        print(f"group: {how} {len(trajectories)} trajectories in {time.perf_counter() - t0:.0f} s")
    group = Group(index=0, task_id=trajectories[0].task_id, trajectories=tuple(trajectories))
    lengths = [len(t.token_ids) for t in trajectories]
    prefix = 0
    while all(len(t.token_ids) > prefix for t in trajectories) and (
        len({t.token_ids[prefix] for t in trajectories}) == 1
    ):
        prefix += 1
    print(
        f"sequence lengths {lengths}, sampled tokens {[sum(t.loss_mask) for t in trajectories]}, "
        f"common prefix {prefix} tokens, turns {[t.metrics.get('env/turns') for t in trajectories]}"
    )

    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    optimizer = copy.deepcopy(trainer.optimizer.state_dict())
    base = trainer.config
    results: dict[bool, list[tuple[float, PeakRSS, dict]]] = {False: [], True: []}
    for r in range(args.rounds):
        for share in (False, True):
            trainer.model.load_state_dict(weights)
            trainer.optimizer.load_state_dict(optimizer)
            trainer.config = replace(base, train=replace(base.train, share_prefix=share))
            with PeakRSS() as memory:
                t0 = time.perf_counter()
                learn = asyncio.run(trainer._learn([group]))  # the trainer's own learner step
                seconds = time.perf_counter() - t0
            results[share].append((seconds, memory, learn))
            print(f"round {r + 1} share_prefix={str(share).lower()}: {seconds:.1f} s")

    tokens = sum(lengths)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"\nlearner step, 1 group x {len(lengths)} sequences, {tokens} tokens, micro_batch {base.train.micro_batch}"
    )
    print(
        "| share_prefix | s/step (best) | s/step (median) | tokens/s | RSS rise in step | loss/pg | grad norm |"
    )
    print("|---|---|---|---|---|---|---|")
    best = {}
    for share in (False, True):
        runs = results[share]
        best[share] = min(s for s, _, _ in runs)
        rise = max(m.rise for _, m, _ in runs) / 2**20
        learn = runs[0][2]
        print(
            f"| {str(share).lower()} | {best[share]:.1f} | {statistics.median(s for s, _, _ in runs):.1f} | "
            f"{tokens / best[share]:.0f} | {rise:.0f} MiB | {learn.losses.pg:+.6f} | {learn.grad_norm:.6f} |"
        )
    print(
        f"\nspeed-up (best s/step, off / on): {best[False] / best[True]:.2f}x; process peak RSS {peak:.0f} MiB"
    )


if __name__ == "__main__":
    main()
