"""Served environments: step latency of ``ServedEnv`` over loopback vs in-process, and server throughput.

A ``toolgym serve`` process is started per environment (a separate process, as in use). Latency: the
same step (a SearchQA search, a CodeExec ``python`` call) timed in alternation in-process and through
``ServedEnv``, so machine load affects both alike; the overhead is the difference of the medians.
Throughput: short SearchQA episodes (reset, search, answer) from 1, 8 and 64 concurrent clients
(asyncio tasks, one ``ServedEnv`` each) against one server, after one untimed episode per client;
errors are counted, not hidden.

    python bench/serve.py --steps 200 --code-steps 30 --episodes 256
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from toolgym.procs import free_port
from toolgym.registry import make
from toolgym.serving.client import ServedEnv

SEARCH = '<tool_call>{"name": "search", "arguments": {"query": "history of the city"}}</tool_call>'
ANSWER = '<tool_call>{"name": "answer", "arguments": {"answer": "Paris"}}</tool_call>'
PYTHON = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'


def start_server(env_id: str, max_sessions: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "toolgym.cli", "serve", env_id, "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--max-sessions", str(max_sessions)], env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server for {env_id} did not start")
        time.sleep(0.2)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latency(env_id: str, action: str, steps: int, options: dict[str, Any]) -> dict[str, float]:
    proc, url = start_server(env_id, 4)
    native, remote = make(env_id), ServedEnv(url)
    times: dict[str, list[float]] = {"in-process": [], "remote": []}
    try:
        for env in (native, remote):  # warm-up: first search, first container
            env.reset(seed=0, options=options)
            env.step(action)
        for i in range(steps):
            for name, env in (("in-process", native), ("remote", remote)):
                if i % 4 == 0:  # a fresh episode now and then, so no turn budget runs out
                    env.reset(seed=i, options=options)
                start = time.perf_counter()
                env.step(action)
                times[name].append(time.perf_counter() - start)
    finally:
        native.close()
        remote.close()
        proc.terminate()
        proc.wait(30)
    out = {f"{name} p50 ms": statistics.median(t) * 1e3 for name, t in times.items()}
    out.update({f"{name} p99 ms": pct(t, 0.99) * 1e3 for name, t in times.items()})
    out["overhead p50 ms"] = out["remote p50 ms"] - out["in-process p50 ms"]
    return out


async def throughput(url: str, clients: int, episodes: int) -> tuple[float, int]:
    """Steady-state episodes/s: every client connects and plays one untimed episode first (the server
    builds one environment per concurrent session the first time: ~43 ms each for SearchQA)."""
    done, errors = 0, 0
    envs = [await asyncio.to_thread(ServedEnv, url) for _ in range(clients)]

    async def episode(env: ServedEnv, seed: int) -> None:
        await env.areset(seed=seed)
        await env.astep(SEARCH)
        await env.astep(ANSWER)

    async def client(env: ServedEnv) -> None:
        nonlocal done, errors
        while done + errors < episodes:
            try:
                await episode(env, done)
                done += 1
            except Exception as exc:  # counted: the target is none
                errors += 1
                print(f"  error: {type(exc).__name__}: {exc}", file=sys.stderr)

    try:
        await asyncio.gather(*(episode(env, i) for i, env in enumerate(envs)))  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(client(env) for env in envs))
        return done / (time.perf_counter() - start), errors
    finally:
        for env in envs:
            await env.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="SearchQA steps timed per path")
    parser.add_argument("--code-steps", type=int, default=30, help="CodeExec steps timed per path (0: skip)")
    parser.add_argument("--episodes", type=int, default=256, help="episodes per client count")
    args = parser.parse_args()

    rows = [("SearchQA search", latency("toolgym/SearchQA-v0", SEARCH, args.steps, {"task_index": 0}))]
    if args.code_steps:
        options = {"task_id": "HumanEval/0"}
        rows.append(("CodeExec python", latency("toolgym/CodeExec-v0", PYTHON, args.code_steps, options)))
    print("\nstep latency, in-process vs ServedEnv over loopback (same step, alternated)")
    print(
        f"{'step':<16} {'in-proc p50':>11} {'remote p50':>11} {'overhead p50':>13} {'in-proc p99':>11} {'remote p99':>11}"
    )
    for name, r in rows:
        print(
            f"{name:<16} {r['in-process p50 ms']:>9.2f}ms {r['remote p50 ms']:>9.2f}ms "
            f"{r['overhead p50 ms']:>11.2f}ms {r['in-process p99 ms']:>9.2f}ms {r['remote p99 ms']:>9.2f}ms"
        )

    proc, url = start_server("toolgym/SearchQA-v0", 64)
    try:
        print(f"\nSearchQA episodes (reset, search, answer) against one server, {args.episodes} per row")
        print(f"{'clients':>7} {'episodes/s':>11} {'errors':>7}")
        for clients in (1, 8, 64):
            rate, errors = asyncio.run(throughput(url, clients, args.episodes))
            print(f"{clients:>7} {rate:>11.1f} {errors:>7}")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
