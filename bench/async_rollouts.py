"""Benchmark async vs synchronous rollouts side by side: same episodes, same policy, same tools.

Usage::

    python bench/async_rollouts.py [--episodes 24] [--concurrency 8] [--latency 0.1] [--rounds 2]

The environment (registered here as ``toolgym-bench/Latency-v0``) has a ``lookup`` tool that sleeps
``--latency`` seconds per call, like a sandbox or a remote search call (about 100 ms). The policy
issues two lookups and then answers; each turn's tokens are scored by a real torch model (the trainer's
tiny byte-level Llama), so generation costs real CPU time. Synchronous mode runs the episodes one after
another (``await`` each); async mode runs them through ``run_episode`` concurrently, at most
``--concurrency`` at a time, as the trainer's rollout workers do. Both modes alternate over ``--rounds``
and the best time of each is kept; the result is the speed-up ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence

import gymnasium
import torch

from toolgym.agents.chat.chatml import IM_END
from toolgym.agents.harness import BareHarness
from toolgym.agents.rollout import run_episode
from toolgym.core import Completion, FunctionTool, Message, SamplingParams, Score, Task, Tool
from toolgym.env import ToolEnv
from toolgym.training.tiny_policy import TinyPolicy

ENV_ID = "toolgym-bench/Latency-v0"


class _Verifier:
    def score(self, task: Task, answer: object, trajectory: Sequence[Message]) -> Score:
        return Score(float(answer == task.reference))


class LatencyEnv(ToolEnv):
    """Tasks answered after tool calls that each take ``latency`` seconds."""

    def __init__(self, latency: float = 0.1) -> None:
        super().__init__(max_turns=4)
        self.latency = latency
        self.tasks = [Task(id=f"q{i}", prompt=f"What is word {i}?", reference=f"word{i}") for i in range(64)]
        self.verifier = _Verifier()

    async def episode_tools(self, task: Task) -> Sequence[Tool]:
        async def lookup(key: str) -> str:
            await asyncio.sleep(self.latency)
            return f"{key} -> word{key[1:]}"

        schema = {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}
        answer = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
        return [
            FunctionTool("lookup", "Look up a key.", schema, lookup),
            FunctionTool("answer", "Answer.", answer, terminal=True),
        ]


class ScriptedModelPolicy(TinyPolicy):
    """Emits a fixed plan (lookup, lookup, answer) but scores every emitted token with the model.

    The token ids and logprobs are real forward passes of the tiny model over the emitted text, so a
    turn costs what teacher-forced generation of that length costs; the run is deterministic.
    """

    def _generate(self, token_ids: list[int], sampling: SamplingParams) -> Completion:
        turn = sum(
            1 for i in range(len(token_ids) - 1) if token_ids[i] == 256 and token_ids[i + 1] == ord("a")
        )
        task = self.tokenizer.decode(token_ids).split("What is word ")[1].split("?")[0]
        if turn <= 2:
            text = f'<tool_call>{{"name": "lookup", "arguments": {{"key": "q{task}"}}}}</tool_call>'
        else:
            text = f'<tool_call>{{"name": "answer", "arguments": {{"answer": "word{task}"}}}}</tool_call>'
        ids = self.tokenizer.encode(text + IM_END)
        seq = torch.tensor([list(token_ids) + ids])
        logp = torch.log_softmax(self.model(input_ids=seq).logits[0, -len(ids) - 1 : -1].float(), dim=-1)
        lps = [float(logp[i, t]) for i, t in enumerate(ids)]
        return Completion(tuple(ids), tuple(lps), text, "stop", self.policy_version)


async def run_sync(policy: ScriptedModelPolicy, envs: list[gymnasium.Env], n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        traj = await run_episode(envs[0], policy, BareHarness(), seed=i, options={"task_index": i})
        assert traj.reward == 1.0, traj.error or traj.messages[-1]
    return time.perf_counter() - start


async def run_async(policy: ScriptedModelPolicy, envs: list[gymnasium.Env], n: int) -> float:
    pool: asyncio.Queue[gymnasium.Env] = asyncio.Queue()
    for env in envs:
        pool.put_nowait(env)

    async def one(i: int) -> None:
        env = await pool.get()
        try:
            traj = await run_episode(env, policy, BareHarness(), seed=i, options={"task_index": i})
            assert traj.reward == 1.0, traj.error or traj.messages[-1]
        finally:
            pool.put_nowait(env)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - start


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--latency", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    if ENV_ID not in gymnasium.registry:
        gymnasium.register(id=ENV_ID, entry_point=f"{__name__}:LatencyEnv")
    torch.set_num_threads(1)
    policy = ScriptedModelPolicy(hidden=args.hidden, layers=2)
    envs = [gymnasium.make(ENV_ID, latency=args.latency) for _ in range(args.concurrency)]
    sync_times, async_times = [], []
    for _ in range(args.rounds):
        sync_times.append(await run_sync(policy, envs, args.episodes))
        async_times.append(await run_async(policy, envs, args.episodes))
    for env in envs:
        await env.unwrapped.aclose()
    best_sync, best_async = min(sync_times), min(async_times)
    result = {
        "episodes": args.episodes,
        "tool_calls_per_episode": 2,
        "tool_latency_s": args.latency,
        "concurrency": args.concurrency,
        "sync_s": round(best_sync, 3),
        "async_s": round(best_async, 3),
        "speedup": round(best_sync / best_async, 2),
    }
    print(f"{'mode':<8}{'best of ' + str(args.rounds) + ' (s)':>18}{'episodes/s':>12}")
    print(f"{'sync':<8}{best_sync:>18.2f}{args.episodes / best_sync:>12.2f}")
    print(f"{'async':<8}{best_async:>18.2f}{args.episodes / best_async:>12.2f}")
    print(f"speed-up (sync / async): {best_sync / best_async:.2f}x")
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
