"""The shipped studies: training/RESULTS.md's built tables are exactly their result files' tables."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from toolgym.agents.eval.results import load_evaluation
from toolgym.errors import ConfigError
from toolgym.training.experiments.study import build_document, load_study, study_table

ROOT = Path(__file__).resolve().parents[3]
DOCUMENT = ROOT / "training" / "RESULTS.md"
RESULTS = ROOT / "training" / "results"


def test_the_results_document_is_built_from_its_result_files(tmp_path: Path) -> None:
    names = re.findall(r"^<!-- study: ([A-Za-z0-9_.-]+) -->$", DOCUMENT.read_text(encoding="utf-8"), re.M)
    assert names, "RESULTS.md shows no table built from result files"
    assert sorted(names) == sorted(p.name for p in RESULTS.iterdir() if p.is_dir())
    assert build_document(DOCUMENT, check=True) == [], "run: toolgym results build training/RESULTS.md"
    # rebuilt from a copy whose tables were emptied: the same document, byte for byte
    copy = tmp_path / "RESULTS.md"
    shutil.copytree(RESULTS, tmp_path / "results")
    emptied = re.sub(
        r"(?m)(^<!-- study: [A-Za-z0-9_.-]+ -->\n).*?(^<!-- /study -->)",
        r"\1\2",
        DOCUMENT.read_text(),
        flags=re.S,
    )
    copy.write_text(emptied)
    assert build_document(copy) == names
    assert copy.read_text() == DOCUMENT.read_text()


def test_the_shipped_result_files_are_small_and_name_no_machine_folder() -> None:
    for path in RESULTS.rglob("*.json"):
        text = path.read_text(encoding="utf-8")
        # kilobytes: the hard run's three evaluations of 244 episodes each (14 measures an episode) are
        # 570 KB; the smallest weight file toolgym writes is hundreds of megabytes
        assert path.stat().st_size < 1_000_000, f"{path}: a result file holds kilobytes, never weights"
        assert not re.search(r'"/(root|home|tmp|work|Users)/', text), f"{path} names a folder of its machine"


def test_the_demo_study_reproduces_its_own_held_out_table() -> None:
    """The demo's held-out summary (as the run printed it) and the study's pairs agree on every track."""
    study, runs = load_study(RESULTS / "demo")
    assert set(runs) == {"base", "trained"} and study["baseline"] == "base"
    run = json.loads((RESULTS / "demo" / "demo.json").read_text())
    rows = {r["harness"]: r for r in run["heldout"]["tracks"]}
    for track in runs["base"].settings.harnesses:
        for label, key in (("base", "base"), ("trained", "trained")):
            rewards = [t.reward for t in runs[label].trajectories[track] if t.status != "infra_error"]
            assert sum(rewards) / len(rewards) == pytest.approx(rows[track][key])
    table = study_table(RESULTS / "demo")
    assert f"{rows['pooled']['diff']:+.3f}" in table


def test_a_study_with_an_edited_file_is_refused(tmp_path: Path) -> None:
    shutil.copytree(RESULTS / "demo", tmp_path / "demo")
    path = tmp_path / "demo" / "demo.json"
    data = json.loads(path.read_text())
    data["evaluations"]["trained"]["episodes"]["bare"][0]["reward"] += 0.5
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="edited by hand"):
        study_table(tmp_path / "demo")
    with pytest.raises(ConfigError, match="edited by hand"):
        load_evaluation(f"{path}#trained")


def test_a_row_of_several_results_is_their_mean_episode_by_episode(tmp_path: Path) -> None:
    """``results`` in place of ``result``: the row is the arm averaged over its seeds, each episode's
    reward and measures the mean over the files, paired with the baseline task by task; files of other
    episodes are refused, naming how they differ."""
    folder = tmp_path / "seeds"
    folder.mkdir()
    hard = RESULTS / "hard-search"
    one, two = hard / "f1-lr3e-5-3-steps.json", hard / "f1-lr3e-5.json"
    rows = [
        {"name": "control", "result": str(RESULTS / "hard" / "hard.json"), "evaluation": "control"},
        {"name": "mean", "results": [str(one), str(two)], "evaluation": "trained"},
    ]
    (folder / "study.json").write_text(json.dumps({"format": 1, "baseline": "control", "rows": rows}))
    _, runs = load_study(folder)
    a, b = load_evaluation(f"{one}#trained"), load_evaluation(f"{two}#trained")
    for track in a.settings.harnesses:
        others = {(t.task_id, t.seed): t for t in b.trajectories[track]}
        for mean, x in zip(runs["mean"].trajectories[track], a.trajectories[track], strict=True):
            y = others[(x.task_id, x.seed)]
            assert (mean.task_id, mean.seed) == (x.task_id, x.seed)
            assert mean.reward == pytest.approx((x.reward + y.reward) / 2)
            assert mean.metrics["use/searched"] == pytest.approx(
                (x.metrics["use/searched"] + y.metrics["use/searched"]) / 2
            )
    assert any(
        x.reward != y.reward for x, y in zip(a.trajectories["bare"], b.trajectories["bare"], strict=True)
    )
    pooled = re.search(r"^\| mean \|.*$", study_table(folder), re.M)
    assert pooled is not None
    means = [sum(t.reward for t in r.trajectories[k]) / 122 for r in (a, b) for k in ("bare", "scaffold")]
    assert f"| {sum(means) / 4:.3f} |" in pooled.group(0), "the pooled mean of the two arms' four tracks"

    rows[1]["results"] = [str(one), str(RESULTS / "demo" / "demo.json")]
    (folder / "study.json").write_text(json.dumps({"format": 1, "baseline": "control", "rows": rows}))
    with pytest.raises(ConfigError, match=r"cannot be averaged .*task_ids"):
        load_study(folder)
    rows[1]["results"] = str(one)  # one file as a string, not a list: refused, never read letter by letter
    (folder / "study.json").write_text(json.dumps({"format": 1, "baseline": "control", "rows": rows}))
    with pytest.raises(ConfigError, match=r"not a study folder .*'mean': results must be a non-empty list"):
        load_study(folder)
