"""CodeExec's data: HumanEval (164) and MBPP (974) problems as tasks, with their splits and references.

Splits are by problem, with the hash rule of :mod:`toolgym.splits` (namespace ``CodeExec``, key
``problem:<task id>``, test fraction :data:`TEST_FRACTION`): HumanEval 130 train / 34 test, MBPP
746 / 228. A problem's split does not depend on ``dataset``. MBPP problems that restate a HumanEval
problem are not grouped with it (that would need a text similarity key); train on one benchmark and
test on the other to rule that out.
"""

from __future__ import annotations

import functools
import gzip
import json
from collections.abc import Sequence
from importlib import resources
from typing import Any

from toolgym.core import Task
from toolgym.errors import ConfigError, did_you_mean
from toolgym.splits import SplitItem, assign_splits, label_tasks

__all__ = [
    "DATASETS",
    "KNOWN_BAD_REFERENCES",
    "SLOW_REFERENCES",
    "TEST_FRACTION",
    "find_task",
    "label_code_tasks",
    "load_tasks",
    "reference_code",
]

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


def find_task(task_id: str) -> Task:
    """The task ``task_id`` (``HumanEval/0``, ``MBPP/11``); a :class:`ConfigError` with "did you mean" otherwise."""
    index = _task_index()
    if task_id not in index:
        raise ConfigError(
            f"no code task {task_id!r}.{did_you_mean(task_id, index)} Ids look like HumanEval/0, MBPP/11"
        )
    return index[task_id]


def reference_code(task_id: str) -> str:
    """The data set's reference solution for ``task_id``, as a complete submission."""
    task = find_task(task_id)
    if task.reference["kind"] == "mbpp":
        return str(task.reference["code"])
    rec = next(r for r in _records("humaneval") if r["task_id"] == task_id)
    return str(rec["prompt"] + rec["canonical_solution"])
