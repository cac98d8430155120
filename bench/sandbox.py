"""Sandbox latency and throughput: warm pool + exec versus ``containers.run`` per call, side by side.

Both paths run the same snippet with the same hardening (the sandbox's own host configuration), in
alternation within one process, so machine load affects both alike. Then throughput of one-shot runs
through the warm pool with 1, 2 and 4 worker threads.

    python bench/sandbox.py --calls 20 --throughput-calls 24
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from toolgym.tools.sandbox import SANDBOX_USER, DockerSandbox

SNIPPET = "import json\nprint(json.dumps(sum(i * i for i in range(1000))))"


def cold_run(sandbox: DockerSandbox) -> float:
    """One ``containers.run`` of the snippet (create, start, wait, logs, remove), hardened alike.

    Two settings differ, as this path needs: the snippet is the container's own command (run as the
    sandbox user), and its output comes back through the engine's log, so that log is on.
    """
    config = sandbox._host_config()
    for key in ("detach", "auto_remove", "command"):
        config.pop(key)
    config["user"] = SANDBOX_USER
    config["log_config"] = {"type": "json-file", "config": {"max-size": "64k", "max-file": "1"}}
    start = time.perf_counter()
    out = sandbox.client.containers.run(sandbox.image, ["python3", "-c", SNIPPET], remove=True, **config)
    elapsed = time.perf_counter() - start
    assert out.decode().strip() == "332833500", out
    return elapsed


def warm_run(sandbox: DockerSandbox) -> float:
    start = time.perf_counter()
    result = sandbox.run(SNIPPET, timeout=30)
    elapsed = time.perf_counter() - start
    assert result.ok and result.stdout.strip() == "332833500", result
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="latency samples per path")
    parser.add_argument("--throughput-calls", type=int, default=24, help="runs per worker count")
    parser.add_argument("--pool-size", type=int, default=4)
    args = parser.parse_args()

    with DockerSandbox(pool_size=args.pool_size) as sandbox:
        time.sleep(3)  # let the pool fill
        cold_run(sandbox), warm_run(sandbox)  # warm-up: image cache, first exec
        cold, warm = [], []
        for _ in range(args.calls):
            cold.append(cold_run(sandbox))
            time.sleep(0.3)  # give the pool time to replace the container just used
            warm.append(warm_run(sandbox))
            time.sleep(0.3)
        cold_med, warm_med = statistics.median(cold), statistics.median(warm)
        print(f"latency, median of {args.calls} calls each (same snippet, same hardening):")
        print(
            f"  containers.run per call : {cold_med * 1000:7.1f} ms  (p10 {_q(cold, 0.1):.0f}, p90 {_q(cold, 0.9):.0f})"
        )
        print(
            f"  warm pool + exec        : {warm_med * 1000:7.1f} ms  (p10 {_q(warm, 0.1):.0f}, p90 {_q(warm, 0.9):.0f})"
        )
        print(f"  speed-up (cold / warm)  : {cold_med / warm_med:7.2f}x")
        print(f"throughput of one-shot runs through the warm pool ({args.throughput_calls} runs each):")
        base = None
        for workers in (1, 2, 4):
            time.sleep(3)
            start = time.perf_counter()
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(lambda _: warm_run(sandbox), range(args.throughput_calls)))
            rate = args.throughput_calls / (time.perf_counter() - start)
            base = base or rate
            print(f"  {workers} worker(s): {rate:6.2f} runs/s  ({rate / base:.2f}x of 1 worker)")


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


if __name__ == "__main__":
    main()
