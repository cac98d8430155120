"""Deterministic train/test splits, shared by every environment.

Every environment takes ``split="train" | "test" | "all"``. Its tasks are labelled once, when the data
is loaded, and the label is kept in ``Task.metadata["split"]``; the environment then serves only the
tasks of its split. The contract:

* **Grouping key.** Each environment names the unit at which leakage happens (SearchQA: the document
  a question is about; ArxivRefs: the query paper; a code benchmark: the problem). Items that share a
  key always land in the same split, so two questions about one paragraph never straddle the line.
* **Hash rule.** A key goes to ``test`` when the first 8 bytes of ``SHA-256("<namespace>:<key>")``,
  read as a big-endian integer and divided by 2**64, are below the environment's test fraction. It
  depends on nothing else: not on file order, not on Python's salted ``hash``, not on a random state,
  so the split is identical on every machine and survives adding or removing other records.
* **Explicit labels.** A data record may carry its own ``"split": "train" | "test"``; it decides the
  split of its whole group (``null`` or no field means "use the hash rule"). Two records of one group
  with different labels are a :class:`~toolgym.errors.ConfigError` naming both places.
* **Task choice.** ``reset(options={"task_id": ...})`` with an id that exists only in the other split
  is a :class:`~toolgym.errors.ConfigError` that says which split holds it
  (:meth:`SplitSelection.check_options`); ``task_index`` counts within the environment's split.

Adopting it in an environment (a sketch; SearchQA and ArxivRefs are full examples)::

    labels = assign_splits([SplitItem(key=t.id) for t in tasks], namespace="MyEnv", test_fraction=0.2)
    self.selection = select_split(label_tasks(tasks, labels), split)
    self.tasks = list(self.selection.tasks)

    def _choose_task(self, options):
        self.selection.check_options(options)
        return super()._choose_task(options)
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from toolgym.core import Task
from toolgym.errors import ConfigError, did_you_mean

__all__ = [
    "RECORD_SPLITS",
    "SPLITS",
    "SplitItem",
    "SplitSelection",
    "assign_splits",
    "check_split",
    "hash_split",
    "label_tasks",
    "record_split",
    "select_split",
]

#: The names an environment's ``split`` argument accepts.
SPLITS = ("train", "test", "all")
#: The labels a task (or a data record's ``split`` field) can carry.
RECORD_SPLITS = ("train", "test")


def check_split(split: Any) -> str:
    """Return ``split`` if it names a split; otherwise raise :class:`ConfigError` with a suggestion."""
    if not isinstance(split, str) or split not in SPLITS:
        hint = did_you_mean(split, SPLITS) if isinstance(split, str) else ""
        raise ConfigError(f"unknown split {split!r}.{hint} Choose one of: {', '.join(SPLITS)}")
    return split


def record_split(value: Any, where: str) -> str | None:
    """Validate a data record's optional ``split`` field; ``None`` means "not given, use the hash rule".

    Args:
        value: the field's value (``None`` when the record has no such field or it is JSON ``null``).
        where: ``file:line`` of the record, for the message.

    Raises:
        ConfigError: the value is not ``"train"`` or ``"test"``.
    """
    if value is None:
        return None
    if not isinstance(value, str) or value not in RECORD_SPLITS:
        hint = did_you_mean(value, RECORD_SPLITS) if isinstance(value, str) else ""
        raise ConfigError(
            f'{where}: \'split\' must be "train" or "test", got {value!r}.{hint} '
            "Fix the record, or drop the field to use the hash rule"
        )
    return value


def hash_split(key: str, *, namespace: str, test_fraction: float) -> str:
    """``"test"`` or ``"train"`` for a grouping key, by the hash rule of the module docstring."""
    if not 0.0 <= test_fraction <= 1.0:
        raise ConfigError(f"test_fraction must be in [0, 1], got {test_fraction}")
    digest = hashlib.sha256(f"{namespace}:{key}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") / 2**64 < test_fraction else "train"


@dataclass(frozen=True)
class SplitItem:
    """One item to label: its grouping key, its record's own label if any, and where it was read."""

    #: Items with equal keys always get the same split.
    key: str
    #: The record's validated ``split`` field (see :func:`record_split`), or ``None``.
    explicit: str | None = None
    #: ``file:line`` (or another label) of the record, used in messages.
    where: str = ""


def assign_splits(items: Sequence[SplitItem], *, namespace: str, test_fraction: float) -> list[str]:
    """The split of each item: its group's explicit label if one was given, else the hash rule.

    Raises:
        ConfigError: two items of one group carry different explicit labels.
    """
    decided: dict[str, tuple[str, str]] = {}  # group key -> (label, where the label was first given)
    for item in items:
        if item.explicit is None:
            continue
        label, where = decided.setdefault(item.key, (item.explicit, item.where))
        if label != item.explicit:
            raise ConfigError(
                f"{item.where}: split {item.explicit!r} conflicts with split {label!r} at {where}; both "
                f"belong to the group {item.key!r}, and a group must not straddle splits. Give every "
                "record of the group the same split, or none"
            )
    return [
        decided[item.key][0]
        if item.key in decided
        else hash_split(item.key, namespace=namespace, test_fraction=test_fraction)
        for item in items
    ]


def label_tasks(tasks: Sequence[Task], labels: Sequence[str]) -> list[Task]:
    """Copies of ``tasks`` with ``metadata["split"]`` set from ``labels`` (one per task)."""
    if len(tasks) != len(labels):
        raise ValueError(f"{len(tasks)} tasks but {len(labels)} split labels")
    return [
        dataclasses.replace(task, metadata={**task.metadata, "split": label})
        for task, label in zip(tasks, labels, strict=True)
    ]


@dataclass(frozen=True)
class SplitSelection:
    """The tasks of one split, and which split each left-out task belongs to."""

    split: str
    tasks: tuple[Task, ...]
    #: Task id -> split, for the tasks of the other split (to explain a rejected ``task_id``).
    held_out: Mapping[str, str]
    #: Number of tasks per label over the whole data set: ``{"train": n, "test": m, "all": n + m}``.
    counts: Mapping[str, int]

    def check_options(self, options: Mapping[str, Any]) -> None:
        """Reject ``options["task_id"]`` when it names a task of the other split."""
        if "task_id" not in options:
            return
        wanted = str(options["task_id"])
        if wanted in self.held_out:
            other = self.held_out[wanted]
            raise ConfigError(
                f"task {wanted!r} is in the {other!r} split, but this environment was made with "
                f"split={self.split!r}. Make it with split={other!r} (or 'all'), or choose a task id "
                f"from env.unwrapped.task_ids()"
            )


def select_split(tasks: Sequence[Task], split: str) -> SplitSelection:
    """Keep the tasks of ``split`` (``"all"``: every task). Every task must carry ``metadata["split"]``.

    Raises:
        ConfigError: ``split`` is not a split name, or it holds no task.
        ValueError: a task has no valid split label (a bug in the environment's loader).
    """
    split = check_split(split)
    counts = {"train": 0, "test": 0}
    for task in tasks:
        label = task.metadata.get("split")
        if label not in RECORD_SPLITS:
            raise ValueError(f"task {task.id!r} has split label {label!r}; the loader must label every task")
        counts[label] += 1
    kept = tuple(t for t in tasks if split == "all" or t.metadata["split"] == split)
    if not kept:
        raise ConfigError(
            f"the {split!r} split has no tasks (train {counts['train']}, test {counts['test']}). "
            "Label some records with a 'split' field, or use split='all'"
        )
    held_out = {t.id: t.metadata["split"] for t in tasks if split != "all" and t.metadata["split"] != split}
    return SplitSelection(split, kept, held_out, {**counts, "all": counts["train"] + counts["test"]})
