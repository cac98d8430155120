"""Result files: an evaluation in a small file that compares, on any machine, as its directory does.

Real SearchQA episodes from model-free rule policies (one answers every other question right), so the
rewards differ by task and a paired comparison has something to find.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import gymnasium
import pytest

import toolgym  # noqa: F401  (registers the environments)
from toolgym.agents.eval.evaluate import evaluate
from toolgym.agents.eval.results import (
    load_evaluation,
    read_result,
    write_evaluation_result,
    write_result,
)
from toolgym.agents.eval.runs import compare_runs, load_eval_run
from toolgym.agents.policies.base import RulePolicy
from toolgym.cli.main import main
from toolgym.errors import ConfigError
from toolgym.training.experiments.study import build_document, study_table, write_study

ENV = "toolgym/SearchQA-v0"


def _answers() -> dict[str, str]:
    env = gymnasium.make(ENV)
    try:
        return {t.prompt: t.reference[0] for t in env.unwrapped.tasks}
    finally:
        env.close()


ANSWERS = _answers()


def half_right(offset: int):
    """Answers the question right when its position in the answer table has ``offset``'s parity."""
    order = {q: i for i, q in enumerate(ANSWERS)}

    def rule(transcript: str) -> str:
        question = next(q for q in ANSWERS if q in transcript.rsplit("<|im_start|>user", 1)[-1])
        right = (order[question] + offset) % 2 == 0
        return f"<answer>{ANSWERS[question] if right else 'zzzz'}</answer>"

    return lambda: RulePolicy(rule, name=f"half-{offset}")


def evaluated(out: Path, offset: int, *, seed: int = 0, n: int = 8) -> Path:
    asyncio.run(
        evaluate(
            ENV,
            half_right(offset),
            ("bare", "scaffold"),
            n=n,
            seed=seed,
            concurrency=1,
            out_dir=out,
            policy_label=f"half-{offset}",
        )
    )
    write_evaluation_result(out)
    return out / "result.json"


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("results")
    return evaluated(root / "a", 0), evaluated(root / "b", 1)


def _edit(src: Path, dst: Path, change) -> Path:
    data = json.loads(src.read_text())
    change(data)
    dst.write_text(json.dumps(data))
    return dst


def test_a_result_file_compares_exactly_as_its_evaluation_directory(pair) -> None:
    a, b = pair
    from_dirs = compare_runs(load_eval_run(a.parent), load_eval_run(b.parent))
    from_files = compare_runs(load_evaluation(a), load_evaluation(b))
    assert [(t.harness, t.n, t.diff, t.low, t.high) for t in from_files.tracks] == [
        (t.harness, t.n, t.diff, t.low, t.high) for t in from_dirs.tracks
    ]
    assert from_files.pooled is not None and from_dirs.pooled is not None
    assert (from_files.pooled.diff, from_files.pooled.low) == (from_dirs.pooled.diff, from_dirs.pooled.low)
    assert any(t.diff != 0 for t in from_files.tracks), "the two rules differ by task"
    assert a.stat().st_size < 32_000, "kilobytes: no tokens, no messages"
    data = read_result(a)
    assert data["what"] == "evaluation" and list(data["evaluations"]) == ["eval"]
    rows = data["evaluations"]["eval"]["episodes"]["bare"]
    assert len(rows) == 8 and {"task", "seed", "reward", "status", "metrics"} <= set(rows[0])


def test_compare_on_the_command_line_takes_files_and_directories(pair, capsys) -> None:
    a, b = pair
    assert main(["compare", str(a), str(b.parent), "--json"]) == 0
    by_file = json.loads(capsys.readouterr().out)
    assert main(["compare", str(a.parent), str(b.parent), "--json"]) == 0
    by_dir = json.loads(capsys.readouterr().out)
    assert [t["diff"] for t in by_file["tracks"]] == [t["diff"] for t in by_dir["tracks"]]


def test_a_hand_edited_score_is_refused_by_track_and_figure(pair, tmp_path) -> None:
    a, _ = pair

    def flip(data) -> None:
        row = data["evaluations"]["eval"]["episodes"]["scaffold"][0]
        row["reward"] = 1.0 - row["reward"]

    edited = _edit(a, tmp_path / "edited.json", flip)
    with pytest.raises(
        ConfigError, match=r"track 'scaffold': its episodes no longer give its own summary .*reward"
    ):
        load_evaluation(edited)

    def drop(data) -> None:
        data["evaluations"]["eval"]["episodes"]["bare"].pop()

    with pytest.raises(ConfigError, match=r"track 'bare'.*edited by hand or cut short"):
        load_evaluation(_edit(a, tmp_path / "cut.json", drop))


def test_results_of_other_tasks_seeds_or_environment_state_are_refused(pair, tmp_path) -> None:
    a, _ = pair
    other_seed = evaluated(tmp_path / "seed", 1, seed=3)
    with pytest.raises(ConfigError, match=r"cannot compare .*differ in task_ids .*seeds"):
        compare_runs(load_evaluation(a), load_evaluation(other_seed))

    def other_data(data) -> None:
        data["evaluations"]["eval"]["manifest"]["env"]["data_sha256"] = "0" * 64

    changed = _edit(a, tmp_path / "env.json", other_data)
    with pytest.raises(ConfigError, match=r"what decides the task or its scoring differs: env.data_sha256"):
        compare_runs(load_evaluation(a), load_evaluation(changed))


def test_which_evaluation_of_a_file_and_what_is_not_one(pair, tmp_path) -> None:
    a, _ = pair
    entry = read_result(a)["evaluations"]["eval"]
    two = write_result(
        tmp_path / "two.json", {"what": "run", "evaluations": {"base": entry, "trained": entry}}
    )
    assert load_evaluation(two).label == str(two)  # a run's default: trained
    assert load_evaluation(f"{two}#base").label == f"{two}#base"
    with pytest.raises(ConfigError, match=r"has no evaluation 'control'; it has \['base', 'trained'\]"):
        load_evaluation(f"{two}#control")
    three = write_result(tmp_path / "three.json", {"what": "run", "evaluations": {"x": entry, "y": entry}})
    with pytest.raises(ConfigError, match=r"name one as .*three.json#NAME"):
        load_evaluation(three)
    (tmp_path / "junk.json").write_text('{"kind": "something else"}')
    with pytest.raises(ConfigError, match="not a toolgym result file"):
        load_evaluation(tmp_path / "junk.json")
    newer = _edit(a, tmp_path / "newer.json", lambda d: d.update(format=99))
    with pytest.raises(ConfigError, match="written by a newer toolgym"):
        load_evaluation(newer)


def test_a_result_file_names_no_folder_of_the_machine_that_wrote_it(pair) -> None:
    a, _ = pair
    text = a.read_text()
    for folder in (a.parent, Path.home(), Path.cwd()):
        assert str(folder.resolve()) + "/" not in text, folder


def test_a_study_folder_builds_its_table_and_the_document_that_shows_it(pair, tmp_path) -> None:
    a, b = pair
    study = tmp_path / "results" / "rules"
    study.mkdir(parents=True)
    shutil.copy(a, study / "a.json")
    shutil.copy(b, study / "b.json")
    rows = [{"name": "a", "result": "a.json", "evaluation": "eval"}, {"name": "b", "result": "b.json"}]
    write_study(study, rows, "a", "two rules")
    table = study_table(study)
    diff = compare_runs(load_evaluation(a), load_evaluation(b)).tracks[0].diff
    assert table.startswith("| arm | bare | Δ bare [CI] | p (Holm) |") and f"{diff:+.3f} [" in table
    assert "| a (baseline) |" in table and "two rules" in table
    doc = tmp_path / "RESULTS.md"
    doc.write_text("# Results\n\n<!-- study: rules -->\nstale numbers\n<!-- /study -->\n\nprose\n")
    assert build_document(doc, check=True) == ["rules"] and "stale numbers" in doc.read_text()
    assert main(["results", "build", str(doc), "--check"]) == 1
    assert main(["results", "build", str(doc)]) == 0
    assert doc.read_text() == f"# Results\n\n<!-- study: rules -->\n{table}<!-- /study -->\n\nprose\n"
    assert build_document(doc, check=True) == []
    (study / "b.json").unlink()
    with pytest.raises(ConfigError, match=r"the result of 1 of 2 rows is missing: b \(b.json\)"):
        build_document(doc)
