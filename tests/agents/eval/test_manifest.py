"""Run manifests: written by every evaluation, required and checked by every comparison and resume."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from toolgym.agents.eval.evaluate import evaluate
from toolgym.agents.eval.runs import check_resumable, compare_runs, load_eval_run
from toolgym.agents.policies.factory import policy_factory
from toolgym.cli import main
from toolgym.errors import ConfigError
from toolgym.records.manifest import RUN_MANIFEST, flatten, manifest_differences, read_run_manifest

SEARCH = "toolgym/SearchQA-v0"


def _eval(out: Path, n: int = 2, **env_kwargs) -> None:
    factory = policy_factory("scripted", env_id=SEARCH, seed=0, max_model_len=2048)
    asyncio.run(
        evaluate(
            SEARCH,
            factory,
            ["bare"],
            n=n,
            seed=0,
            concurrency=2,
            out_dir=out,
            env_kwargs=env_kwargs,
            policy_label="scripted",
        )
    )


def _edit_manifest(run: Path, key: str, value) -> None:
    manifest = json.loads((run / RUN_MANIFEST).read_text())
    node = manifest
    *parents, last = key.split(".")
    for part in parents:
        node = node[part]
    node[last] = value
    (run / RUN_MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("manifest")
    _eval(root / "a")
    _eval(root / "b")
    return root / "a", root / "b"


def _copy(run: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run, to)
    return to


def test_an_evaluation_records_what_its_numbers_depend_on(two_runs) -> None:
    manifest = read_run_manifest(two_runs[0])
    assert manifest is not None and manifest["kind"] == "eval" and manifest["toolgym"]["version"]
    env = manifest["env"]
    assert env["id"] == SEARCH and env["max_turns"] == 6 and env["n_tasks"] > 100
    assert len(env["data_sha256"]) == 64 and len(env["first_observation_sha256"]) == 64
    index = env["provenance"]["index"]
    assert index["backend"] == "default" and len(index["corpus_sha256"]) == 64 and index["n_docs"] > 1000
    run = manifest["run"]
    assert run["harnesses"] == ["bare"] and len(run["task_ids"]) == 2 and run["seeds"] == [0, 1]
    assert manifest["policy"] == {"spec": "scripted"}
    assert manifest["machine"]["cpu_count"] >= 1 and "gymnasium" in manifest["machine"]["libraries"]
    # the same settings give the same task fields: nothing to refuse
    assert manifest_differences(manifest, read_run_manifest(two_runs[1])) == []


def test_another_split_changes_the_data_hash(tmp_path) -> None:
    _eval(tmp_path / "test", n=1, split="test")
    _eval(tmp_path / "train", n=1, split="train")
    a, b = (flatten(read_run_manifest(tmp_path / name)) for name in ("test", "train"))
    assert a["env.data_sha256"] != b["env.data_sha256"] and a["env.split"] == "test"


def test_compare_refuses_a_changed_index_naming_the_field_and_the_override(
    two_runs, tmp_path, capsys
) -> None:
    a, b = two_runs
    changed = _copy(b, tmp_path / "b")
    _edit_manifest(changed, "env.provenance.index.corpus_sha256", "0" * 64)
    with pytest.raises(
        ConfigError, match=r"env\.provenance\.index\.corpus_sha256: .* vs .*--allow env\.provenance"
    ):
        compare_runs(load_eval_run(a), load_eval_run(changed))
    assert compare_runs(load_eval_run(a), load_eval_run(changed), allow=["env.provenance"]).tracks
    assert main(["compare", str(a), str(changed), "--allow", "env.provenance.index.corpus_sha256"]) == 0
    assert main(["compare", str(a), str(b)]) == 0  # an untouched pair compares


def test_a_run_without_a_manifest_is_refused_with_the_way_forward(two_runs, tmp_path) -> None:
    old = _copy(two_runs[1], tmp_path / "old")
    (old / RUN_MANIFEST).unlink()
    with pytest.raises(ConfigError, match=r"has no manifest.json .*--restart.*--allow manifest"):
        compare_runs(load_eval_run(two_runs[0]), load_eval_run(old))
    assert compare_runs(load_eval_run(two_runs[0]), load_eval_run(old), allow=["manifest"]).tracks


def test_a_manifest_from_a_newer_toolgym_is_refused(two_runs, tmp_path) -> None:
    newer = _copy(two_runs[1], tmp_path / "newer")
    _edit_manifest(newer, "format", 99)
    with pytest.raises(ConfigError, match="written by a newer toolgym .* upgrade"):
        load_eval_run(newer)


def test_resuming_over_a_changed_environment_is_refused(two_runs) -> None:
    manifest = read_run_manifest(two_runs[0])
    check_resumable(two_runs[0], manifest, resuming=True)  # unchanged: fine
    changed = json.loads(json.dumps(manifest))
    changed["env"]["data_sha256"] = "f" * 64
    with pytest.raises(ConfigError, match="another environment state: env.data_sha256.*--restart"):
        check_resumable(two_runs[0], changed, resuming=True)
    check_resumable(two_runs[0], changed, resuming=False)  # nothing to mix with


def test_an_environment_class_is_named_by_the_package_that_exports_it() -> None:
    from toolgym.envs.code_exec import CodeExecEnv
    from toolgym.envs.search_qa import SearchQAEnv
    from toolgym.records.manifest import public_name

    assert SearchQAEnv.__module__ == "toolgym.envs.search_qa.env"
    assert public_name(SearchQAEnv) == "toolgym.envs.search_qa.SearchQAEnv"
    assert public_name(CodeExecEnv) == "toolgym.envs.code_exec.CodeExecEnv"
    assert public_name(ConfigError) == "toolgym.ConfigError"
    # A class its parent package does not export keeps its module's name.
    from toolgym.records.trackers import Trackers

    assert public_name(Trackers) == "toolgym.records.trackers.Trackers"
    assert public_name(Path) == "pathlib.Path"
