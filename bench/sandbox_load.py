"""Sandbox under load: concurrent hidden-test verifications, and what an output flood costs the host.

Part 1, flood (side by side, same code, same length): code that writes as fast as it can into
``/proc/1/fd/2`` (PID 1's stderr, i.e. the container's own output) for ``--flood-s`` seconds, under
three container settings: the earlier one (PID 1 run by the sandbox user, ``json-file`` engine log),
the earlier one with the engine log off, and the current policy (PID 1 root, no engine log). Reported:
CPU seconds the engine's processes (dockerd, containerd, containerd-shim*) used during the flood, read
from ``/proc``, and how many bytes the code managed to write.

Part 2, load: ``--workers`` threads score submissions against HumanEval hidden tests for
``--duration-s`` seconds through one :class:`~toolgym.tools.sandbox.DockerSandbox`. Submissions cycle
through honest (the reference), wrong, and hostile ones (signals to the runner, to every process, to
PID 1, SIGSTOP, fork bomb, endless loop, memory and file bombs, the PID-1 flood). Reported: episodes/s,
p50/p99 latency overall and per kind, outcomes that differ from the expected reward, VerifierErrors and
infra errors (goal: zero), containers left behind (goal: zero), engine CPU seconds.

    python bench/sandbox_load.py --workers 2 --duration-s 30 --flood-s 8 --flood-rounds 1
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import threading
import time
from collections import Counter, defaultdict

from toolgym.envs.code_exec import HiddenTestVerifier, load_tasks, reference_code
from toolgym.errors import InfraError, VerifierError
from toolgym.tools.sandbox import UID_LABEL, DockerSandbox, leaked_containers, sandbox_user

ENGINE = ("dockerd", "containerd", "containerd-shim", "containerd-shim-runc-v2")
TICK = os.sysconf("SC_CLK_TCK")

FLOOD = """
import os, time
end = time.monotonic() + {seconds}
sent = 0
while time.monotonic() < end:
    try:
        fd = os.open('/proc/1/fd/2', os.O_WRONLY)
    except OSError:
        time.sleep(0.01)
        continue
    chunk = b'x' * (1 << 16)
    while time.monotonic() < end:
        sent += os.write(fd, chunk)
print(sent)
"""

#: Small HumanEval tasks (a handful of asserts each), so a verification takes about a second.
TASKS = ("HumanEval/0", "HumanEval/2", "HumanEval/4", "HumanEval/7", "HumanEval/13", "HumanEval/23")
ATTACKS = {
    "sigterm_runner": "os.kill(os.getppid(), signal.SIGTERM)",
    "sigint_runner": "os.kill(os.getppid(), signal.SIGINT)",
    "sigkill_runner": "os.kill(os.getppid(), signal.SIGKILL)",
    "sigstop_runner": "os.kill(os.getppid(), signal.SIGSTOP)",
    "kill_all": "os.kill(-1, signal.SIGKILL)",
    "killpg_runner": "os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)",
    "sigstop_pid1": "os.kill(1, signal.SIGSTOP)",
    "fork_bomb": "while True:\n        try: os.fork()\n        except OSError: pass",
    "endless_loop": "while True: pass",
    "memory_bomb": "x = b'x' * (1 << 30)",
    "file_bomb": "f = open('big', 'wb')\n    while True: f.write(b'x' * (1 << 20))",
    "pid1_flood": "fd = os.open('/proc/1/fd/2', os.O_WRONLY)\n    while True: os.write(fd, b'x' * 65536)",
}


def engine_cpu() -> dict[int, float]:
    """CPU seconds (user + system) used so far by each of the Docker engine's processes on this host."""
    cpu = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        if name in ENGINE or name.startswith("containerd-shim"):
            fields = stat[stat.rindex(")") + 2 :].split()
            cpu[int(pid)] = (int(fields[11]) + int(fields[12])) / TICK
    return cpu


def engine_cpu_since(before: dict[int, float]) -> float:
    """Engine CPU seconds used since ``before``: per process, so shims that come and go don't count
    their earlier life (a shim that exits in between takes its share with it: an undercount)."""
    return sum(t - before.get(pid, 0.0) for pid, t in engine_cpu().items())


# --------------------------------------------------------------------------- part 1: flood


def flood_once(sandbox: DockerSandbox, variant: str, seconds: float) -> tuple[float, int]:
    config = sandbox._host_config()
    user = sandbox_user(int(config["labels"][UID_LABEL]))
    if variant != "current":
        config["user"] = user
        config["cap_add"] = []
    if variant == "earlier (json-file log)":
        config["log_config"] = {"type": "json-file", "config": {"max-size": "64k", "max-file": "1"}}
    container = sandbox.client.containers.run(sandbox.image, **config)
    try:
        time.sleep(0.5)
        before = engine_cpu()
        _, out = container.exec_run(["python3", "-c", FLOOD.format(seconds=seconds)], user=user)
        used = engine_cpu_since(before)
    finally:
        container.remove(force=True)
    return used, int(out.decode().split()[-1]) if out.strip() else -1


def flood(sandbox: DockerSandbox, seconds: float, rounds: int) -> None:
    variants = ("earlier (json-file log)", "earlier, engine log off", "current")
    used: dict[str, list[float]] = defaultdict(list)
    sent: dict[str, list[int]] = defaultdict(list)
    for _ in range(rounds):
        for variant in variants:
            cpu, n = flood_once(sandbox, variant, seconds)
            used[variant].append(cpu)
            sent[variant].append(n)
    print(
        f"flood into /proc/1/fd/2 for {seconds:g} s ({rounds} round(s), container limit {sandbox.cpus:g} CPU):"
    )
    base = statistics.mean(used[variants[0]])
    for variant in variants:
        cpu = statistics.mean(used[variant])
        print(
            f"  {variant:26s}: engine CPU {cpu:6.2f} s ({cpu / seconds:5.2f} cores), "
            f"written {statistics.mean(sent[variant]) / 1e6:8.1f} MB, {cpu / base if base else 0:5.2f}x of earlier"
        )


# --------------------------------------------------------------------------- part 2: load


def submissions() -> list[tuple[str, str, str, float]]:
    """(kind, task id, code, expected reward) for every task and kind, in a fixed shuffled order."""
    out = []
    tasks = {t.id: t for t in load_tasks("humaneval")}
    for task_id in TASKS:
        entry = tasks[task_id].reference["entry_point"]
        out.append(("honest", task_id, reference_code(task_id), 1.0))
        out.append(("wrong", task_id, f"def {entry}(*args, **kwargs):\n    return None\n", 0.0))
        for kind, attack in ATTACKS.items():
            code = f"import os, signal\ndef {entry}(*args, **kwargs):\n    {attack}\n    return None\n"
            out.append((kind, task_id, code, 0.0))
    random.Random(0).shuffle(out)
    return out


def load(sandbox: DockerSandbox, workers: int, duration_s: float, call_timeout: float) -> None:
    verifier = HiddenTestVerifier(sandbox, call_timeout=call_timeout)
    tasks = {t.id: t for t in load_tasks("humaneval")}
    work = itertools.cycle(submissions())
    lock = threading.Lock()
    latencies: dict[str, list[float]] = defaultdict(list)
    problems: Counter[str] = Counter()
    stop = time.monotonic() + duration_s

    def worker() -> None:
        while time.monotonic() < stop:
            with lock:
                kind, task_id, code, expected = next(work)
            start = time.monotonic()
            try:
                score = verifier.score(tasks[task_id], code)
            except VerifierError as exc:
                problems[f"VerifierError: {exc}"[:120]] += 1
                continue
            except InfraError as exc:
                problems[f"infra_error: {exc}"[:120]] += 1
                continue
            with lock:
                latencies[kind].append(time.monotonic() - start)
                if score.reward != expected:
                    problems[f"{kind} on {task_id}: reward {score.reward}, expected {expected}"] += 1

    cpu_before, started = engine_cpu(), time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed, cpu = time.monotonic() - started, engine_cpu_since(cpu_before)
    sandbox.close()
    leaked = leaked_containers(sandbox.client, instance=sandbox.instance)
    every = sorted(x for values in latencies.values() for x in values)
    print(f"load: {workers} concurrent verifications for {duration_s:g} s (call timeout {call_timeout:g} s):")
    print(f"  episodes      : {len(every)} in {elapsed:.1f} s = {len(every) / elapsed:.2f} episodes/s")
    print(f"  latency       : p50 {_q(every, 0.5):.2f} s, p99 {_q(every, 0.99):.2f} s")
    for kind in sorted(latencies):
        values = sorted(latencies[kind])
        print(f"    {kind:15s}: n={len(values):3d}  p50 {_q(values, 0.5):5.2f} s  max {values[-1]:5.2f} s")
    errors = sum(n for p, n in problems.items() if p.startswith(("VerifierError", "infra_error")))
    print(f"  VerifierError / infra_error: {errors}")
    print(f"  wrong outcomes: {sum(problems.values()) - errors}")
    for problem, n in problems.most_common(10):
        print(f"    {n} x {problem}")
    print(f"  leaked containers after close: {len(leaked)}")
    print(f"  engine CPU (dockerd + containerd + shims): {cpu:.1f} s ({cpu / elapsed:.2f} cores)")


def _q(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="concurrent verifications")
    parser.add_argument("--duration-s", type=float, default=30.0, help="length of the load run")
    parser.add_argument("--call-timeout", type=float, default=2.0, help="seconds per hidden-test call")
    parser.add_argument("--flood-s", type=float, default=8.0, help="length of each flood (0 skips part 1)")
    parser.add_argument("--flood-rounds", type=int, default=1)
    args = parser.parse_args()
    if args.flood_s > 0:
        with DockerSandbox(pool_size=0) as sandbox:
            flood(sandbox, args.flood_s, args.flood_rounds)
    load(DockerSandbox(pool_size=2 * args.workers), args.workers, args.duration_s, args.call_timeout)


if __name__ == "__main__":
    main()
