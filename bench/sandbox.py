"""Sandbox latency and throughput: resident runner vs one exec per call vs ``containers.run``, side by side.

Three ways to run the same snippet with the same hardening (the sandbox's own host configuration), in
alternation within one process so that machine load affects all alike: ``containers.run`` per call;
today's exec path (``DockerSandbox(one_shot="exec")``: a warm container, one ``docker exec``, the
container thrown away); the resident runner (``one_shot="resident"``, the default: a fresh worker
process per call over the runner's stream, containers reused after clean-up). Then throughput of
one-shot runs with 1, 2 and 4 worker threads on both sandbox paths, and the hidden-test verification
of one HumanEval task (CodeExec's verifier, reference solution) through each sandbox.

    python bench/sandbox.py --calls 40 --throughput-calls 48
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from toolgym.core import Task
from toolgym.envs.code_exec import load_tasks, reference_code
from toolgym.envs.code_exec.verifier import HiddenTestVerifier
from toolgym.tools.sandbox import UID_LABEL, DockerSandbox, sandbox_user

SNIPPET = "import json\nprint(json.dumps(sum(i * i for i in range(1000))))"
TASK = "HumanEval/0"


def cold_run(sandbox: DockerSandbox) -> float:
    """One ``containers.run`` of the snippet (create, start, wait, logs, remove), hardened alike.

    Two settings differ, as this path needs: the snippet is the container's own command (run as the
    sandbox user), and its output comes back through the engine's log, so that log is on.
    """
    config = sandbox._host_config()
    for key in ("detach", "auto_remove", "command"):
        config.pop(key)
    config["user"] = sandbox_user(int(config["labels"][UID_LABEL]))
    config["log_config"] = {"type": "json-file", "config": {"max-size": "64k", "max-file": "1"}}
    start = time.perf_counter()
    out = sandbox.client.containers.run(sandbox.image, ["python3", "-c", SNIPPET], remove=True, **config)
    elapsed = time.perf_counter() - start
    assert out.decode().strip() == "332833500", out
    return elapsed


def one_shot(sandbox: DockerSandbox, verdicts: list[dict[str, float]] | None = None) -> float:
    start = time.perf_counter()
    result = sandbox.run(SNIPPET, timeout=30)
    elapsed = time.perf_counter() - start
    assert result.ok and result.stdout.strip() == "332833500", result
    if verdicts is not None and sandbox._idle:  # the resident runner that served it: its clean-up verdict
        verdicts.append(sandbox._idle[-1].verdict)
    return elapsed


def verify(verifier: HiddenTestVerifier, task: Task, code: str) -> float:
    start = time.perf_counter()
    score = verifier.score(task, code)
    elapsed = time.perf_counter() - start
    assert score.reward == 1.0, score
    return elapsed


def throughput(run: Callable[[], float], workers: int, calls: int) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda _: run(), range(calls)))
    return calls / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40, help="latency samples per path")
    parser.add_argument("--throughput-calls", type=int, default=48, help="runs per worker count and path")
    parser.add_argument("--verify-calls", type=int, default=10, help="HumanEval verifications per path")
    parser.add_argument("--pool-size", type=int, default=4)
    args = parser.parse_args()

    with (
        DockerSandbox(pool_size=args.pool_size, one_shot="exec") as old,
        DockerSandbox(pool_size=args.pool_size, one_shot="resident") as new,
    ):
        time.sleep(3)  # let the pools fill
        cold_run(old), one_shot(old), one_shot(new)  # warm-up: image cache, first exec, first runner
        cold: list[float] = []
        exec_: list[float] = []
        resident: list[float] = []
        verdicts: list[dict[str, float]] = []
        for _ in range(args.calls):
            cold.append(cold_run(old))
            exec_.append(one_shot(old))
            time.sleep(0.3)  # give the pool time to replace the container just used
            resident.append(one_shot(new, verdicts))
        print(f"latency of one trivial snippet, {args.calls} calls per path in alternation (same hardening):")
        for name, values in (
            ("containers.run per call", cold),
            ("exec path (one_shot='exec')", exec_),
            ("resident runner (default)", resident),
        ):
            print(
                f"  {name:29s}: p50 {_q(values, 0.5):7.1f} ms  (p10 {_q(values, 0.1):.1f}, p90 {_q(values, 0.9):.1f})"
            )
        print(
            f"  speed-up (cold / warm)       : {_q(cold, 0.5) / _q(exec_, 0.5):7.2f}x  (containers.run / exec path)"
        )
        print(
            f"  speed-up (exec / resident)   : {_q(exec_, 0.5) / _q(resident, 0.5):7.2f}x  (p50; goal: resident <= 15 ms)"
        )
        cleanup = [v["ms"] / 1000 for v in verdicts if "ms" in v]
        checks = [v["check_ms"] / 1000 for v in verdicts if "check_ms" in v]
        if cleanup:
            print(
                f"  resident clean-up + checks   : p50 {_q(cleanup, 0.5):7.2f} ms  (p90 {_q(cleanup, 0.9):.2f}; "
                f"the checks alone p50 {_q(checks, 0.5):.2f} ms, p90 {_q(checks, 0.9):.2f}; inside each call's "
                f"latency, measured in the container; retired: {dict(new.retirements) or 'none'})"
            )

        print(f"throughput of one-shot runs ({args.throughput_calls} runs per row):")
        rates: dict[tuple[str, int], float] = {}
        for workers in (1, 2, 4):
            for name, box in (("exec", old), ("resident", new)):
                time.sleep(3)  # the pool refills
                rates[name, workers] = throughput(lambda b=box: one_shot(b), workers, args.throughput_calls)
            ratio = rates["resident", workers] / rates["exec", workers]
            print(
                f"  {workers} worker(s): exec {rates['exec', workers]:6.2f} runs/s, resident "
                f"{rates['resident', workers]:6.2f} runs/s  ({ratio:.2f}x)"
            )
        print(
            f"  resident at 4 workers / exec at 4 workers: {rates['resident', 4] / rates['exec', 4]:.2f}x (goal >= 3x)"
        )

        task = next(t for t in load_tasks("humaneval") if t.id == TASK)
        code = reference_code(TASK)
        verifiers = {"exec": HiddenTestVerifier(old), "resident": HiddenTestVerifier(new)}
        timings: dict[str, list[float]] = {name: [] for name in verifiers}
        for verifier in verifiers.values():
            verify(verifier, task, code)  # warm-up
        for _ in range(args.verify_calls):  # in alternation, like the latency rows
            for name, verifier in verifiers.items():
                timings[name].append(verify(verifier, task, code))
        print(
            f"hidden-test verification of {TASK} (reference solution, {args.verify_calls} runs per sandbox,"
            " in alternation; the trusted harness gets a never-used container and one exec on both):"
        )
        for name, values in timings.items():
            print(f"  {name:8s} sandbox: p50 {_q(values, 0.5):7.1f} ms")
        print(f"  exec / resident: {_q(timings['exec'], 0.5) / _q(timings['resident'], 0.5):.2f}x")


def _q(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (seconds), in milliseconds."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


if __name__ == "__main__":
    main()
