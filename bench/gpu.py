"""Benchmark the transformers sampler against plain ``model.generate``: tokens/s and device-busy share.

Usage::

    python bench/gpu.py [--device cuda] [--shapes 135m,1b] [--episodes 8,32,64] [--turns 3]
                        [--max-tokens 64] [--samplers generate,static,continuous-sdpa,continuous] [--out FILE.json]
    python bench/gpu.py --device cpu --smoke

Side by side in one process, on models of a real shape with random weights (built from the shipped
SmolLM2-135M's config and tokenizer, or ``--shape-dir``, e.g. ``.gpu/model-shape`` on a machine without
the embedded model: ``135m`` is that config, ``1b`` the same with hidden 2048, intermediate 8192, 16
layers, 32 heads, 8 key/value heads, about 1.07B parameters). Throughput does not depend on the
weights' values.

The work: ``N`` concurrent multi-turn episodes. Each starts from a shared prefix (a system prompt's
worth of tokens) and its own question; each turn samples at temperature 1 up to its own length (drawn
between a quarter of ``--max-tokens`` and all of it, fixed by the episode and turn, so turns end at
different times as real ones do), then appends a tool result's worth of tokens. Samplers:

* ``generate``: what any user could write: each turn of ``max_batch`` episodes at a time, left-padded,
  through ``model.generate(do_sample=True)`` to the longest turn of the batch (the tokens counted are
  each turn's own).
* ``static``: ``HFPolicy(batching="static", attn_implementation="sdpa")``, the sampler before
  continuous batching (each batch to its last row's end, logits copied to the host and sampled row by
  row, transformers' ``sdpa``).
* ``continuous-sdpa``: continuous batching with transformers' ``sdpa`` (the scheduler's share).
* ``continuous``: ``HFPolicy()``, rows joining and leaving between decode steps, the batch sampled on
  the device, grouped-query SDPA (:mod:`toolgym.agents.policies.hf_attention`).

Columns: aggregate sampled tokens/s, its ratio to ``generate`` and to ``static``, the device-busy share
(time inside the model's forward passes over the wall time: on CUDA timed by events, so a step waiting
for kernel launches still counts as busy, an upper bound; on CPU the rest is the host's own work:
sampling, scheduling, bookkeeping), and for ``continuous`` how many of its first turns' tokens differ
when the same request runs alone (``--alone`` requests: the logits' rounding with the batch's shape).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from toolgym.agents.policies.hf import HFPolicy
from toolgym.agents.policies.spec import resolve_model_dir
from toolgym.core import SamplingParams

SHAPES = {
    "135m": {},
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
}
SAMPLERS = ("generate", "static", "continuous-sdpa", "continuous")


@dataclass(frozen=True)
class Work:
    """The episodes' tokens: shared prefix, questions, tool results and each turn's length."""

    prefix: list[int]
    questions: list[list[int]]
    tools: list[list[list[int]]]  # [episode][turn]
    lengths: list[list[int]]  # [episode][turn]

    @classmethod
    def make(
        cls, episodes: int, turns: int, max_tokens: int, sizes: tuple[int, int, int], vocab: int
    ) -> Work:
        rng = random.Random(0)

        def ids(n: int) -> list[int]:
            return [rng.randrange(1000, vocab) for _ in range(n)]

        prefix_n, question_n, tool_n = sizes
        return cls(
            prefix=ids(prefix_n),
            questions=[ids(question_n) for _ in range(episodes)],
            tools=[[ids(tool_n) for _ in range(turns)] for _ in range(episodes)],
            lengths=[
                [rng.randint(max(1, max_tokens // 4), max_tokens) for _ in range(turns)]
                for _ in range(episodes)
            ],
        )


@dataclass
class Row:
    shape: str
    episodes: int
    sampler: str
    tokens: int
    seconds: float
    tokens_per_s: float
    busy: float
    vs_generate: float | None = None
    vs_static: float | None = None
    alone_differs: str = ""


class ForwardClock:
    """Time inside the model's forward passes (CUDA events on a GPU, the host clock on a CPU)."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: list[Any] = []
        self.seconds = 0.0
        self._start: Any = None
        self._handles = [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._exit),
        ]

    def _enter(self, *args: Any) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def _exit(self, *args: Any) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.spans.append((self._start, end))
        else:
            self.seconds += time.perf_counter() - self._start

    def total(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return self.seconds + sum(a.elapsed_time(b) for a, b in self.spans) / 1000
        return self.seconds

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def build_shape(name: str, shape_dir: Path, root: Path, dtype: torch.dtype) -> Path:
    """A model directory of shape ``name`` with random weights and the shape's tokenizer files."""
    target = root / name
    shutil.copytree(shape_dir, target, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.gguf"))
    config = transformers.AutoConfig.from_pretrained(shape_dir)
    for key, value in SHAPES[name].items():
        setattr(config, key, value)
    if SHAPES[name]:
        config.head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(target)
    return target


def sampling(work: Work, episode: int, turn: int) -> SamplingParams:
    return SamplingParams(max_tokens=work.lengths[episode][turn], temperature=1.0, seed=episode * 1000 + turn)


async def run_policy(
    policy: HFPolicy, work: Work
) -> tuple[int, list[tuple[list[int], SamplingParams, tuple[int, ...]]]]:
    """Every episode at once; returns the sampled tokens and each first turn's (prompt, params, ids)."""
    first: list[Any] = [None] * len(work.questions)

    async def episode(e: int) -> int:
        prompt, sampled = work.prefix + work.questions[e], 0
        for t, tool in enumerate(work.tools[e]):
            params = sampling(work, e, t)
            completion = await policy.generate(prompt, params)
            if t == 0:
                first[e] = (list(prompt), params, completion.token_ids)
            sampled += len(completion.token_ids)
            prompt = prompt + list(completion.token_ids) + tool
        return sampled

    tokens = sum(await asyncio.gather(*(episode(e) for e in range(len(work.questions)))))
    return tokens, first


def run_generate(model: Any, work: Work, batch: int, device: torch.device, pad: int) -> int:
    """Each turn of ``batch`` episodes at a time through ``model.generate``; the turns' own tokens."""
    prompts = [work.prefix + q for q in work.questions]
    tokens = 0
    for t in range(len(work.tools[0])):
        for start in range(0, len(prompts), batch):
            rows = list(range(start, min(start + batch, len(prompts))))
            width = max(len(prompts[e]) for e in rows)
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for i, e in enumerate(rows):
                ids[i, width - len(prompts[e]) :] = torch.tensor(prompts[e])
                mask[i, width - len(prompts[e]) :] = 1
            longest = max(work.lengths[e][t] for e in rows)
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    max_new_tokens=longest,
                    min_new_tokens=longest,
                    pad_token_id=pad,
                )
            for i, e in enumerate(rows):
                own = out[i, width : width + work.lengths[e][t]].tolist()
                tokens += len(own)
                prompts[e] = prompts[e] + own + work.tools[e][t]
    return tokens


def measure(args: argparse.Namespace, model_dir: Path, shape: str, episodes: int) -> list[Row]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    work = Work.make(episodes, args.turns, args.max_tokens, args.sizes, config.vocab_size)
    batch = min(args.max_batch, episodes)
    rows = []
    for sampler in args.samplers:
        if sampler == "generate":
            model = (
                transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
            )
            clock = ForwardClock(model, device)
            pad = config.eos_token_id if isinstance(config.eos_token_id, int) else 0
            start = time.perf_counter()
            tokens = run_generate(model, work, batch, device, pad)
            seconds = time.perf_counter() - start
            first = None
        else:
            policy = HFPolicy(
                model_dir,
                device=args.device,
                dtype=args.dtype,
                max_batch=batch,
                batching="static" if sampler == "static" else "continuous",
                attn_implementation=None if sampler == "continuous" else "sdpa",
                seed=0,
            )
            model = policy.model
            clock = ForwardClock(model, device)
            start = time.perf_counter()
            tokens, first = asyncio.run(run_policy(policy, work))
            seconds = time.perf_counter() - start
        busy = clock.total() / seconds
        clock.close()
        row = Row(
            shape, episodes, sampler, tokens, round(seconds, 2), round(tokens / seconds, 1), round(busy, 3)
        )
        if sampler == "continuous" and first is not None and args.alone:
            row.alone_differs = alone_differences(policy, first[: args.alone])
        if sampler != "generate":
            policy.close()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        print(
            f"  {shape} {episodes:>3} episodes {sampler:<10} {row.tokens_per_s:>9.1f} tok/s  busy {row.busy:.0%}",
            flush=True,
        )
    by = {r.sampler: r.tokens_per_s for r in rows}
    for r in rows:
        r.vs_generate = round(r.tokens_per_s / by["generate"], 2) if "generate" in by else None
        r.vs_static = round(r.tokens_per_s / by["static"], 2) if "static" in by else None
    return rows


def alone_differences(
    policy: HFPolicy, first: Sequence[tuple[list[int], SamplingParams, tuple[int, ...]]]
) -> str:
    """Tokens of batched first turns that differ when each request runs alone (after the first difference
    every later token may differ too, so the first one is what counts)."""

    async def again() -> list[tuple[int, ...]]:
        return [(await policy.generate(prompt, params)).token_ids for prompt, params, _ in first]

    alone = asyncio.run(again())
    differ = sum(1 for (_, _, batched), solo in zip(first, alone, strict=True) if batched != solo)
    return f"{differ}/{len(first)} requests"


def table(rows: list[Row]) -> str:
    lines = [
        "| shape | episodes | sampler | tokens | s | tokens/s | vs generate | vs static | busy | alone differs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.shape} | {r.episodes} | {r.sampler} | {r.tokens} | {r.seconds} | {r.tokens_per_s} | "
            f"{r.vs_generate if r.vs_generate is not None else ''} | {r.vs_static if r.vs_static is not None else ''} | "
            f"{r.busy:.0%} | {r.alone_differs} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="", help="default bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--shapes", default="135m,1b")
    parser.add_argument("--episodes", default="8,32,64")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--max-batch", type=int, default=64, help="rows decoded together (capped by the episodes)"
    )
    parser.add_argument(
        "--sizes", default="256,48,32", help="tokens of the shared prefix, a question, a tool result"
    )
    parser.add_argument("--samplers", default=",".join(SAMPLERS))
    parser.add_argument("--alone", type=int, default=8, help="continuous first turns re-run alone")
    parser.add_argument(
        "--shape-dir", default="", help="config and tokenizer to shape from (default: the embedded model)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: torch's default)")
    parser.add_argument("--out", default="", help="write the rows as JSON here too")
    parser.add_argument("--smoke", action="store_true", help="seconds: 135m, 4 episodes, 2 short turns")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shapes, args.episodes, args.turns, args.max_tokens, args.sizes, args.alone = (
            "135m",
            "4",
            2,
            8,
            "32,8,8",
            2,
        )
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.sizes = tuple(int(x) for x in args.sizes.split(","))
    args.samplers = [s for s in args.samplers.split(",") if s]
    unknown = sorted(set(args.samplers) - set(SAMPLERS)) + sorted(set(args.shapes.split(",")) - set(SHAPES))
    if unknown:
        parser.error(
            f"unknown sampler or shape: {', '.join(unknown)} (samplers {SAMPLERS}, shapes {tuple(SHAPES)})"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    shape_dir = Path(args.shape_dir) if args.shape_dir else resolve_model_dir(None)
    rows: list[Row] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="toolgym-bench-gpu-") as tmp:
        for shape in args.shapes.split(","):
            model_dir = build_shape(shape, shape_dir, Path(tmp), getattr(torch, args.dtype))
            print(
                f"{shape}: {args.device}, {args.dtype}, turns {args.turns} x up to {args.max_tokens} tokens",
                flush=True,
            )
            for episodes in (int(n) for n in args.episodes.split(",")):
                rows += measure(args, model_dir, shape, episodes)
    print()
    print(table(rows))
    print(f"\nbench/gpu.py: {len(rows)} rows in {time.perf_counter() - started:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
