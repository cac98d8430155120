"""``toolgym/CodeExec-v0``: write a Python function, try it in a sandbox, submit it to hidden tests.

Tasks come from HumanEval (164) and MBPP (974), shipped in ``toolgym/envs/data/code``. Tools:
``python(code)`` runs in the episode's sandbox container (interpreter state persists across calls);
``submit(code)`` ends the episode. Reward 1 only if every hidden test passes; the pass fraction is a
metric.

Splits (``split="train" | "test" | "all"``, default ``"all"``): by problem, with the hash rule of
:mod:`toolgym.splits` (namespace ``CodeExec``, key ``problem:<task id>``, test fraction 0.25):
HumanEval 130 train / 34 test, MBPP 746 / 228. A problem's split does not depend on ``dataset``.
MBPP problems that restate a HumanEval problem are not grouped with it (that would need a text
similarity key); train on one benchmark and test on the other to rule that out.

The hidden tests are run by :class:`~toolgym.envs.code_verifier.HiddenTestVerifier` (its module
states the threat model): the tests stay on the host, only calls into the candidate run, in a fresh
container, under a uid that cannot touch the trusted runner. The verifier's names are re-exported here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gzip
import json
import logging
from collections.abc import Sequence
from importlib import resources
from typing import Any

from toolgym.core import FunctionTool, Score, Task, Tool
from toolgym.env import ToolEnv

# The verifier lived in this module first: its names stay importable from here.
from toolgym.envs.code_audit import audit_exploits
from toolgym.envs.code_verifier import MAX_ROUNDS, HiddenTestVerifier, default_sandbox
from toolgym.envs.code_verifier import _mbpp_tests as _mbpp_tests  # noqa: F401
from toolgym.envs.code_verifier import extract_code as _extract_code  # noqa: F401
from toolgym.errors import ConfigError, SandboxError, ToolTimeout, VerifierError, did_you_mean
from toolgym.splits import SplitItem, assign_splits, check_split, label_tasks, select_split
from toolgym.tools.sandbox import DockerSandbox, ExecResult, SandboxSession

__all__ = [
    "MAX_ROUNDS",
    "audit_exploits",
    "CodeExecEnv",
    "HiddenTestVerifier",
    "default_sandbox",
    "load_tasks",
    "reference_code",
    "score_submission",
]

log = logging.getLogger(__name__)

DATASETS = ("humaneval", "mbpp")
#: Tasks whose own reference solution fails its tests under this verifier: none (measured over all
#: 1,138 with ``python -m toolgym.envs.code_exec``). MBPP/123 is reported as failing elsewhere; its
#: reference is correct but slow (amicable numbers below 10,000 by trial division, seconds per call),
#: so it passes with the default ``call_timeout`` and fails under timeouts of a second or two.
KNOWN_BAD_REFERENCES: frozenset[str] = frozenset()
#: A correct reference that needs seconds per call (see above).
SLOW_REFERENCES = frozenset({"MBPP/123"})
#: Share of problems the split hash rule puts in the test split.
TEST_FRACTION = 0.25

# --------------------------------------------------------------------------- data


@functools.cache
def _records(dataset: str) -> tuple[dict[str, Any], ...]:
    root = resources.files("toolgym.envs") / "data" / "code"
    name = {"humaneval": "HumanEval.jsonl.gz", "mbpp": "mbpp.jsonl.gz"}[dataset]
    with (root / name).open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as fh:
        return tuple(json.loads(line) for line in fh if line.strip())


_INSTRUCTIONS = (
    "Use the python tool to run code (state persists between calls). When you are done, call submit "
    "with the complete code: the function with its signature, plus any imports and helpers it needs."
)


def _humaneval_task(rec: dict[str, Any]) -> Task:
    prompt = f"Complete this Python function.\n\n```python\n{rec['prompt']}```\n\n{_INSTRUCTIONS}"
    reference = {
        "kind": "humaneval",
        "prompt": rec["prompt"],
        "test": rec["test"],
        "entry_point": rec["entry_point"],
    }
    meta = {"dataset": "humaneval", "entry_point": rec["entry_point"]}
    return Task(id=rec["task_id"], prompt=prompt, reference=reference, metadata=meta)


def _mbpp_task(rec: dict[str, Any]) -> Task:
    tests = list(rec["test_list"])
    # NOTE: as in the standard MBPP prompt, one test is shown (it names the function and its
    # signature); all tests, that one included, are run hidden.
    prompt = f"{rec['text'].strip()}\n\nFor example, this must hold:\n{tests[0].strip()}\n\n{_INSTRUCTIONS}"
    reference = {
        "kind": "mbpp",
        "tests": tests,
        "setup": rec.get("test_setup_code", "") or "",
        "code": rec["code"],
    }
    return Task(id=f"MBPP/{rec['task_id']}", prompt=prompt, reference=reference, metadata={"dataset": "mbpp"})


def label_code_tasks(tasks: Sequence[Task]) -> list[Task]:
    """``tasks`` with ``metadata["split"]`` set by the hash rule on the problem id."""
    items = [SplitItem(f"problem:{t.id}") for t in tasks]
    return label_tasks(tasks, assign_splits(items, namespace="CodeExec", test_fraction=TEST_FRACTION))


def load_tasks(dataset: str = "humaneval") -> list[Task]:
    """The tasks of ``dataset`` (``"humaneval"``, ``"mbpp"`` or ``"all"``), in file order."""
    if dataset == "all":
        return load_tasks("humaneval") + load_tasks("mbpp")
    if dataset not in DATASETS:
        raise ConfigError(
            f"unknown dataset {dataset!r}.{did_you_mean(dataset, DATASETS)} Choose humaneval, mbpp or all"
        )
    make = _humaneval_task if dataset == "humaneval" else _mbpp_task
    return [make(rec) for rec in _records(dataset)]


@functools.cache
def _task_index() -> dict[str, Task]:
    return {t.id: t for t in load_tasks("all")}


def _task(task_id: str) -> Task:
    index = _task_index()
    if task_id not in index:
        raise ConfigError(
            f"no code task {task_id!r}.{did_you_mean(task_id, index)} Ids look like HumanEval/0, MBPP/11"
        )
    return index[task_id]


def reference_code(task_id: str) -> str:
    """The data set's reference solution for ``task_id``, as a complete submission."""
    task = _task(task_id)
    if task.reference["kind"] == "mbpp":
        return str(task.reference["code"])
    rec = next(r for r in _records("humaneval") if r["task_id"] == task_id)
    return str(rec["prompt"] + rec["canonical_solution"])


def score_submission(task_id: str, code: str) -> Score:
    """Score ``code`` against the hidden tests of ``task_id`` (``HumanEval/0``, ``MBPP/11``)."""
    return HiddenTestVerifier().score(_task(task_id), code)


# --------------------------------------------------------------------------- environment


def _format(result: ExecResult) -> str:
    text = result.stdout
    if result.stderr:
        text += ("" if not text or text.endswith("\n") else "\n") + result.stderr
    notes = []
    if result.output_truncated:
        notes.append("output cut: too much output; the interpreter was restarted and its variables are lost")
    if result.oom_killed:
        notes.append("killed: out of memory; the interpreter was restarted and its variables are lost")
    elif result.cpu_time_exceeded:
        notes.append(f"killed: CPU time limit of {result.cpu_limit_s} s exceeded")
    elif result.file_size_exceeded:
        notes.append(f"file size limit of {result.file_limit_mb} MB exceeded")
    elif result.exit_code not in (0, None):
        notes.append(f"exit status {result.exit_code}")
    text = text + "".join(f"\n[{n}]" for n in notes)
    return text if text.strip() else "(no output)"


class CodeExecEnv(ToolEnv):
    """Write a function for a HumanEval or MBPP task, test it with ``python``, ``submit`` it.

    Args:
        dataset: ``"humaneval"`` (default), ``"mbpp"`` or ``"all"``.
        sandbox: the :class:`DockerSandbox` to use; the shared default when ``None`` (created on
            first use, so constructing and resetting the environment needs no Docker engine).
        tool_timeout: seconds one ``python`` call may run.
        call_timeout: seconds one hidden-test call may run.
        max_turns: assistant turns before truncation.
        split: ``"train"``, ``"test"`` or ``"all"`` (default, every problem of ``dataset``).
        render_mode: ``"ansi"`` or ``None``.
    """

    description = "Write Python functions (HumanEval / MBPP); python(code) in a Docker sandbox, submit(code) to hidden tests."

    def __init__(
        self,
        dataset: str = "humaneval",
        *,
        sandbox: DockerSandbox | None = None,
        tool_timeout: float = 10.0,
        call_timeout: float = 10.0,
        max_turns: int = 8,
        split: str = "all",
        render_mode: str | None = None,
    ) -> None:
        check_split(split)
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        self.dataset = dataset
        self.selection = select_split(label_code_tasks(load_tasks(dataset)), split)
        self.split = split
        self.tasks = list(self.selection.tasks)
        self._sandbox = sandbox
        self.tool_timeout = tool_timeout
        self.verifier = HiddenTestVerifier(sandbox, call_timeout=call_timeout)
        self._session: SandboxSession | None = None

    def provenance(self) -> dict[str, Any]:
        """The data set and the sandbox image the hidden tests run in, by content id (for run manifests)."""
        sandbox = self._sandbox if self._sandbox is not None else default_sandbox()
        return {"dataset": self.dataset, "sandbox_image": sandbox.image_id()}

    def _choose_task(self, options: dict[str, Any]) -> Task:
        self.selection.check_options(options)  # a task id of the other split: say so
        return super()._choose_task(options)

    async def episode_tools(self, task: Task) -> Sequence[Tool]:
        return [
            FunctionTool(
                name="python",
                description="Run Python code in a sandbox (no network). Variables persist between calls; "
                "the value of a final expression is printed.",
                parameters={
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "Python source to run"}},
                    "required": ["code"],
                },
                fn=self._python,
                timeout=self.tool_timeout + 30.0,
            ),
            FunctionTool(
                name="submit",
                description="Submit the complete solution code; this ends the episode.",
                parameters={
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "the complete solution"}},
                    "required": ["code"],
                },
                terminal=True,
            ),
        ]

    async def _python(self, code: str) -> str:
        if self._session is None:
            sandbox = self._sandbox if self._sandbox is not None else default_sandbox()
            self._session = sandbox.session()
        session = self._session
        result = await asyncio.to_thread(session.run, code, timeout=self.tool_timeout)
        if result.timed_out:
            partial = (
                _format(dataclasses.replace(result, timed_out=False))
                if result.stdout or result.stderr
                else ""
            )
            raise ToolTimeout(
                f"timed out after {self.tool_timeout:g} s; the interpreter was restarted and its variables are lost"
                + (f"\n{partial}" if partial else ""),
                tool="python",
            )
        return _format(result)

    async def close_episode(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            try:
                await asyncio.to_thread(session.close)
            except SandboxError as exc:  # pragma: no cover - removal is best effort, the reaper retries
                log.warning("closing the sandbox session failed: %s", exc)


def check_references(
    dataset: str = "all", *, workers: int = 2, limit: int | None = None
) -> tuple[dict[str, Score], dict[str, str]]:
    """Score every reference solution of ``dataset`` (a self-test of the verifier); show progress.

    Returns the scores by task id, and the verifier errors by task id (a sound verifier has none and
    gives reward 1 to every reference except :data:`KNOWN_BAD_REFERENCES`).
    """
    from concurrent.futures import ThreadPoolExecutor

    from rich.progress import Progress

    tasks = load_tasks(dataset)[:limit]
    scores: dict[str, Score] = {}
    errors: dict[str, str] = {}
    with (
        DockerSandbox(pool_size=2 * workers) as sandbox,
        Progress() as progress,
        ThreadPoolExecutor(workers) as pool,
    ):
        verifier = HiddenTestVerifier(sandbox)
        bar = progress.add_task(f"reference solutions ({dataset})", total=len(tasks))
        futures = {pool.submit(verifier.score, t, reference_code(t.id)): t.id for t in tasks}
        for future in futures:
            try:
                scores[futures[future]] = future.result()
            except VerifierError as exc:
                errors[futures[future]] = str(exc)
            progress.advance(bar)
    return scores, errors


if __name__ == "__main__":
    import argparse
    import time

    parser = argparse.ArgumentParser(description="Score the reference solutions (verifier self-test).")
    parser.add_argument("--dataset", default="all", choices=[*DATASETS, "all"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None)
    cli = parser.parse_args()
    started = time.monotonic()
    results, problems = check_references(cli.dataset, workers=cli.workers, limit=cli.limit)
    failing = sorted(tid for tid, s in results.items() if s.reward != 1.0)
    print(
        f"{len(results) - len(failing)}/{len(results)} reference solutions score 1 in {time.monotonic() - started:.0f} s"
    )
    for tid in failing:
        print(f"  {tid}: {dict(results[tid].metrics)}")
    for tid, problem in sorted(problems.items()):
        print(f"  {tid}: verifier error: {problem}")
