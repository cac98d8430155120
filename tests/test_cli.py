"""The toolgym command line, run as a user would (subprocess), and the authoring docs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import gymnasium
import pytest

from toolgym.cli import main, render_template
from toolgym.envs import check_env

ROOT = Path(__file__).resolve().parents[1]


def toolgym(*args, stdin=None, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "toolgym.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
    )


def test_envs_lists_every_id():
    out = toolgym("envs")
    assert out.returncode == 0
    import toolgym as tg

    for env_id in tg.env_ids():
        assert env_id in out.stdout


def test_eval_scripted_prints_the_paired_table(tmp_path):
    out = toolgym(
        "eval",
        "--env",
        "toolgym/SearchQA-v0",
        "--policy",
        "scripted",
        "--n",
        "12",
        "--seed",
        "3",
        "--out",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    assert re.search(r"bare\s+│", out.stdout) and re.search(r"scaffold\s+│", out.stdout)
    assert "paired reward difference scaffold - bare: +0.000" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["task_ids"]) == 12 and [t["harness"] for t in summary["tracks"]] == [
        "bare",
        "scaffold",
    ]
    bare = [json.loads(line) for line in (tmp_path / "trajectories-bare.jsonl").read_text().splitlines()]
    scaffold = [
        json.loads(line) for line in (tmp_path / "trajectories-scaffold.jsonl").read_text().splitlines()
    ]
    assert [t["task_id"] for t in bare] == [t["task_id"] for t in scaffold] == summary["task_ids"]
    assert [t["seed"] for t in bare] == [t["seed"] for t in scaffold] == list(range(3, 15))


def test_eval_scripted_bm25_baseline_on_arxiv_refs(tmp_path):
    out = toolgym(
        "eval",
        "--env",
        "toolgym/ArxivRefs-v0",
        "--policy",
        "scripted",
        "--n",
        "10",
        "--harness",
        "bare",
        "--out",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    (track,) = summary["tracks"]
    assert track["infra_errors"] == 0 and track["tool_calls"] > 1
    assert 0.0 < track["metrics"]["reward/f1"] < 1.0
    # what the episodes did with their tools, measured by the environment (toolgym.tool_use)
    assert track["metrics"]["use/searches"] >= 1.0 and 0.0 <= track["metrics"]["use/answer_shown"] <= 1.0
    assert "use/query_overlap" not in track["metrics"]  # ArxivRefs has no question to compare with
    assert "tool use" in out.stdout and "answer_shown" in out.stdout
    # not on a terminal: progress lines on stderr instead of a bar (a log is never silent)
    assert (
        "eval toolgym/ArxivRefs-v0: started" in out.stderr
        and "eval toolgym/ArxivRefs-v0: 10/10 (" in out.stderr
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["eval", "--env", "toolgym/SerchQA-v0", "--policy", "scripted"],
            "Did you mean 'toolgym/SearchQA-v0'",
        ),
        (["eval", "--env", "toolgym/SearchQA-v0", "--policy", "smolm2"], "Did you mean 'smollm2'"),
        (
            ["eval", "--env", "toolgym/SearchQA-v0", "--policy", "scripted", "--harness", "bare,scafold"],
            "Did you mean 'scaffold'",
        ),
        (["eval", "--env", "toolgym/SearchQA-v0", "--policy", "scripted", "--n", "0"], "n must be >= 1"),
        (["index", "build", "--corpus", "missing.jsonl"], "missing.jsonl"),
        (["play", "toolgym/SearchQA-v9"], "Did you mean 'toolgym/SearchQA-v0'"),
    ],
)
def test_bad_input_is_a_clear_error(args, message):
    out = toolgym(*args)
    assert out.returncode == 2
    assert out.stderr.startswith("toolgym: error:") and message in out.stderr
    assert "Traceback" not in out.stderr


def test_play_by_hand():
    turns = 'search {"query": "Super Bowl 50 Panthers defense points", "k": 2}\n<tool_call>{broken</tool_call>\n:reset\n<answer>nothing</answer>\n:q\n'
    out = toolgym("play", "toolgym/SearchQA-v0", "--seed", "0", stdin=turns)
    assert out.returncode == 0, out.stderr
    assert "--- tool (search)" in out.stdout
    assert "Error: tool call is not valid JSON" in out.stdout
    assert "# episode terminated · reward 0.0" in out.stdout


def test_index_build_command(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        "\n".join(json.dumps({"id": f"d{i}", "title": f"T{i}", "text": f"word{i} common"}) for i in range(30))
    )
    out = toolgym("index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "idx"))
    assert out.returncode == 0, out.stderr
    assert "index ready" in out.stdout
    from toolgym.tools.search.index import load_index

    assert load_index(tmp_path / "idx").search("word7", k=1)[0].doc_id == "d7"


def test_environments_md_example_is_the_template_and_runs(tmp_path):
    doc = (ROOT / "environments.md").read_text()
    block = re.search(r"```python\n(.*?)```", doc, re.DOTALL).group(1)
    assert block == render_template("env_module.py.txt", "Calculator", "calculator_env")
    namespace: dict = {"__name__": "calculator_env_doc"}
    exec(compile(block, "environments.md", "exec"), namespace)
    check_env(gymnasium.make(namespace["ENV_ID"]))  # gymnasium's checker and toolgym's contract


def test_new_env_writes_a_skeleton_whose_test_passes(tmp_path, capsys):
    assert main(["new-env", "Weather", "--dir", str(tmp_path)]) == 0
    assert (tmp_path / "weather_env.py").exists() and (tmp_path / "test_weather_env.py").exists()
    assert "weather_env.py is a template: a working calculator environment" in capsys.readouterr().out
    module = (tmp_path / "weather_env.py").read_text()
    assert module.count("FunctionTool.from_function(") == 2 and module.count("# REPLACE:") == 3
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 passed" in out.stdout
    assert main(["new-env", "Weather", "--dir", str(tmp_path)]) == 2  # refuses to overwrite


@pytest.mark.parametrize(
    "args",
    [
        ["eval", "--env", "toolgym/SearchQA-v0", "--policy", "scripted", "--env-arg", "max_turn=3"],
        ["play", "toolgym/SearchQA-v0", "--env-arg", "max_turn=3"],
    ],
)
def test_misspelt_env_arg_is_one_line_with_did_you_mean(args):
    out = toolgym(*args, stdin="")
    assert out.returncode == 2
    assert out.stderr.startswith("toolgym: error: toolgym/SearchQA-v0 takes no argument 'max_turn'.")
    assert "Did you mean 'max_turns'?" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("pair", "message"),
    [
        ("metric=bleu", "unknown metric 'bleu'"),  # the env's own ConfigError
        (
            "max_turns=three",
            "toolgym/SearchQA-v0 rejected its arguments {'max_turns': 'three'}",
        ),  # a TypeError
    ],
)
def test_a_bad_env_arg_value_is_one_line(pair, message):
    out = toolgym("eval", "--env", "toolgym/SearchQA-v0", "--policy", "scripted", "--env-arg", pair)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("toolgym: error:") and message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("http://127.0.0.1:8000/v1", "needs the served model's name: add --model NAME"),
        ("run:no/such/run", "run directory 'no/such/run' does not exist"),
        ("run:runs/x@latest", "@STEP must be a whole number"),
    ],
)
def test_unusable_policy_specs_are_one_line_errors(policy, message):
    out = toolgym("eval", "--env", "toolgym/SearchQA-v0", "--policy", policy)
    assert out.returncode == 2 and message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("policy", "fmt", "message"),
    [
        ("smollm2", "llama", "--chat-format must be one of auto, hermes, llama3"),
        ("scripted", "llama3", "--chat-format llama3 applies to model policies"),
        ("http://127.0.0.1:8000/v1", "mistral", "rendered by its server"),
    ],
)
def test_a_chat_format_for_eval_is_checked_before_anything_loads(policy, fmt, message):
    model = ["--model", "m"] if policy.startswith("http") else []
    out = toolgym("eval", "--env", "toolgym/SearchQA-v0", "--policy", policy, *model, "--chat-format", fmt)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
    if fmt == "llama":
        assert "Did you mean 'llama3'" in out.stderr


@pytest.mark.slow
def test_eval_renders_with_the_chat_format_given_and_records_it(tmp_path):
    out = toolgym(
        "eval", "--env", "toolgym/SearchQA-v0", "--policy", "smollm2", "--chat-format", "hermes",
        "--harness", "bare", "--n", "1", "--max-tokens", "4", "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    record = json.loads((tmp_path / "run" / "eval.json").read_text())
    settings = record["settings"]
    assert settings["policy"] == "smollm2 [hermes]" and settings["policy_info"]["chat_format"] == "hermes"


def test_eval_baseline_and_compare(tmp_path):
    base = ["eval", "--env", "toolgym/SearchQA-v0", "--policy", "scripted", "--n", "3", "--harness", "bare"]
    first = toolgym(*base, "--out", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr
    second = toolgym(*base, "--out", str(tmp_path / "b"), "--baseline", str(tmp_path / "a"))
    assert second.returncode == 0, second.stderr
    assert "paired reward difference B - A on bare: +0.000" in second.stdout
    out = toolgym("compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json")
    assert out.returncode == 0, out.stderr
    (track,) = json.loads(out.stdout)["tracks"]
    assert track["harness"] == "bare" and track["n"] == 3 and track["diff"] == 0.0
    refused = toolgym(*base, "--seed", "1", "--baseline", str(tmp_path / "a"))
    assert refused.returncode == 2 and "first seed (0 vs 1)" in refused.stderr
    other = toolgym(*base, "--seed", "1", "--out", str(tmp_path / "c"))
    assert other.returncode == 0, other.stderr
    out = toolgym("compare", str(tmp_path / "a"), str(tmp_path / "c"))
    assert out.returncode == 2 and "cannot compare" in out.stderr and "seeds (3 vs 3 values" in out.stderr
    again = toolgym(*base, "--seed", "1", "--out", str(tmp_path / "a"))
    assert again.returncode == 2 and "--restart" in again.stderr
