"""Train/test splits: the shared rule (toolgym.splits) and its use by every environment that adopts it."""

from __future__ import annotations

import hashlib

import gymnasium
import pytest

import toolgym  # noqa: F401  (registers the ids)
from toolgym.core import Task
from toolgym.errors import ConfigError
from toolgym.splits import (
    SplitItem,
    assign_splits,
    check_split,
    hash_split,
    label_tasks,
    record_split,
    select_split,
)

# ----------------------------------------------------------------------------- the rule itself


def test_hash_rule_is_the_documented_sha256_threshold():
    for key in ("doc:xq0000", "doc:xq0001", "paper:0123456789", "question:q1"):
        value = int.from_bytes(hashlib.sha256(f"NS:{key}".encode()).digest()[:8], "big") / 2**64
        assert hash_split(key, namespace="NS", test_fraction=0.25) == ("test" if value < 0.25 else "train")
    # frozen examples: a change of the rule (hash, byte order, namespace format) fails here
    assert hash_split("doc:xq0000", namespace="SearchQA", test_fraction=0.25) == "train"
    assert hash_split("doc:xq0003", namespace="SearchQA", test_fraction=0.25) == "test"
    assert hash_split("anything", namespace="NS", test_fraction=0.0) == "train"
    assert hash_split("anything", namespace="NS", test_fraction=1.0) == "test"


def test_hash_rule_depends_on_the_key_not_on_the_order_of_items():
    keys = [f"doc:{i}" for i in range(200)]
    forward = assign_splits([SplitItem(k) for k in keys], namespace="NS", test_fraction=0.3)
    backward = assign_splits([SplitItem(k) for k in reversed(keys)], namespace="NS", test_fraction=0.3)
    assert forward == backward[::-1]
    assert 30 <= forward.count("test") <= 90  # a fraction near 0.3 of 200, not all or nothing


def test_explicit_label_decides_its_whole_group():
    items = [
        SplitItem("g1"),
        SplitItem("g1", "test", "f:2"),
        SplitItem("g1"),
        SplitItem("g2", "train", "f:4"),
    ]
    assert assign_splits(items, namespace="NS", test_fraction=0.0) == ["test", "test", "test", "train"]


def test_conflicting_labels_in_one_group_name_both_places():
    items = [SplitItem("g1", "train", "qs.jsonl:1"), SplitItem("g1", "test", "qs.jsonl:5")]
    with pytest.raises(
        ConfigError, match=r"qs\.jsonl:5: split 'test' conflicts with split 'train' at qs\.jsonl:1"
    ):
        assign_splits(items, namespace="NS", test_fraction=0.5)


@pytest.mark.parametrize(
    ("name", "hint"), [("tset", "Did you mean 'test'"), ("trian", "Did you mean 'train'")]
)
def test_unknown_split_name_says_did_you_mean(name, hint):
    with pytest.raises(ConfigError, match=f"unknown split '{name}'. {hint}"):
        check_split(name)
    with pytest.raises(ConfigError, match="Choose one of: train, test, all"):
        check_split(None)


@pytest.mark.parametrize("value", ["all", "TEST", "", 1, ["test"]])
def test_bad_record_label_names_file_and_line(value):
    with pytest.raises(ConfigError, match=r"data\.jsonl:7: 'split' must be \"train\" or \"test\""):
        record_split(value, "data.jsonl:7")
    assert record_split(None, "data.jsonl:7") is None and record_split("test", "x") == "test"


def test_selection_is_a_partition_and_explains_held_out_ids():
    tasks = label_tasks([Task(f"t{i}", "p", ["a"]) for i in range(4)], ["train", "test", "train", "test"])
    train, test, every = (select_split(tasks, s) for s in ("train", "test", "all"))
    assert [t.id for t in train.tasks] == ["t0", "t2"] and [t.id for t in test.tasks] == ["t1", "t3"]
    assert list(every.tasks) == tasks and every.counts == {"train": 2, "test": 2, "all": 4}
    train.check_options({"task_id": "t0"})
    with pytest.raises(
        ConfigError,
        match=r"task 't1' is in the 'test' split, but this environment was made with split='train'",
    ):
        train.check_options({"task_id": "t1"})
    every.check_options({"task_id": "t1"})


def test_empty_split_and_unlabelled_task_are_errors():
    tasks = label_tasks([Task("t0", "p", ["a"])], ["train"])
    with pytest.raises(ConfigError, match=r"the 'test' split has no tasks \(train 1, test 0\)"):
        select_split(tasks, "test")
    with pytest.raises(ValueError, match="loader must label every task"):
        select_split([Task("t0", "p", ["a"])], "all")


# ----------------------------------------------------------------------------- the environments

# Frozen sizes of the default data (train, test). A change of data, grouping or rule fails here; update
# environments.md with the new numbers when that is intended.
SIZES = {
    "toolgym/SearchQA-v0": (924, 266),
    "toolgym/ArxivRefs-v0": (27, 13),
    "toolgym/CodeExec-v0": (130, 34),
}
#: The metadata field holding each env's grouping key (None: the task id, i.e. the problem, is the group)
GROUP = {"toolgym/SearchQA-v0": "gold_doc", "toolgym/ArxivRefs-v0": "paper_id", "toolgym/CodeExec-v0": None}


def _group(task, key):
    return task.id if key is None else task.metadata[key]


@pytest.fixture(scope="module", params=sorted(SIZES))
def envs(request):
    made = {s: gymnasium.make(request.param, split=s) for s in ("train", "test", "all")}
    yield request.param, {s: e.unwrapped for s, e in made.items()}
    for env in made.values():
        env.close()


def test_splits_are_disjoint_by_group_and_cover_everything(envs):
    env_id, by_split = envs
    key = GROUP[env_id]
    train, test, every = (by_split[s].tasks for s in ("train", "test", "all"))
    assert {_group(t, key) for t in train}.isdisjoint({_group(t, key) for t in test})
    assert sorted(t.id for t in every) == sorted(t.id for t in [*train, *test])
    assert len(every) == len(train) + len(test)
    assert all(t.metadata["split"] == "train" for t in train) and all(
        t.metadata["split"] == "test" for t in test
    )
    assert {t.id: t.metadata["split"] for t in every} == {
        **{t.id: "train" for t in train},
        **{t.id: "test" for t in test},
    }


def test_split_sizes_are_frozen_and_stable_across_constructions(envs):
    env_id, by_split = envs
    n_train, n_test = SIZES[env_id]
    assert (len(by_split["train"].tasks), len(by_split["test"].tasks)) == (n_train, n_test)
    again = gymnasium.make(env_id, split="test")
    assert [t.id for t in again.unwrapped.tasks] == [t.id for t in by_split["test"].tasks]
    again.close()


def test_a_test_task_id_in_a_train_env_is_a_clear_error(envs):
    _, by_split = envs
    test_id = by_split["test"].tasks[0].id
    with pytest.raises(ConfigError, match=f"task '{test_id}' is in the 'test' split.*split='train'"):
        by_split["train"].reset(seed=0, options={"task_id": test_id})
    _, info = by_split["all"].reset(seed=0, options={"task_id": test_id})
    assert info["task_id"] == test_id
    _, info = by_split["test"].reset(seed=0, options={"task_index": 0})
    assert info["task_id"] == test_id


@pytest.mark.parametrize("env_id", sorted(SIZES))
def test_unknown_split_name_fails_at_construction(env_id):
    with pytest.raises(ConfigError, match="unknown split 'tets'. Did you mean 'test'"):
        gymnasium.make(env_id, split="tets")
