"""Re-verification replays stored actions against today's environment: same answers, or the changes shown.

Every run here is a real evaluation with the model-free scripted policy (real index, real sandbox);
the stored files are then edited the way an old run differs from today (a reward an older verifier
gave, a tool answer from an older index) or the verifier is broken on purpose.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from toolgym.agents.eval.evaluate import evaluate
from toolgym.agents.eval.reverify import RESULT, reverify_run
from toolgym.agents.policies.factory import policy_factory
from toolgym.cli import main
from toolgym.core import SamplingParams
from toolgym.errors import ConfigError

SEARCH = "toolgym/SearchQA-v0"


def _scripted_eval(out: Path, env_id: str = SEARCH, n: int = 3) -> None:
    factory = policy_factory("scripted", env_id=env_id, seed=0, max_model_len=2048)
    # as `toolgym eval --policy scripted` runs it: the baseline writes whole turns, so no token caps
    uncapped = SamplingParams(max_tokens=1 << 20, temperature=0.0)
    asyncio.run(
        evaluate(
            env_id,
            factory,
            ["bare", "scaffold"],
            n=n,
            seed=0,
            concurrency=2,
            out_dir=out,
            sampling=uncapped,
            max_total_tokens=1 << 30,
        )
    )


def _edit(path: Path, index: int, edit) -> dict:
    lines = path.read_text(encoding="utf-8").splitlines()
    record = json.loads(lines[index])
    edit(record)
    lines[index] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return record


def test_an_untouched_run_reverifies_unchanged_and_writes_its_report(tmp_path, capsys) -> None:
    _scripted_eval(tmp_path)
    assert main(["reverify", str(tmp_path)]) == 0
    (source,) = json.loads((tmp_path / RESULT).read_text())["sources"]
    assert source["episodes"] == source["rescored"] == 6
    assert source["changed"] == source["observation_changed"] == 0 and not source["errors"]
    stored = json.loads((tmp_path / "eval.json").read_text())["tracks"]
    for track in stored:
        n, old, new = source["tracks"][track["harness"]]
        assert n == 3 and old == pytest.approx(track["reward"]) and new == pytest.approx(old)
    assert "reward changed" in capsys.readouterr().out


def test_a_reward_an_older_verifier_gave_and_an_older_tool_answer_are_reported(tmp_path) -> None:
    _scripted_eval(tmp_path)
    bare = tmp_path / "trajectories-bare.jsonl"
    first = _edit(bare, 0, lambda r: r.update(reward=r["reward"] + 0.5))

    def older_tool_answer(record: dict) -> None:
        tool = next(m for m in record["messages"] if m["role"] == "tool")
        tool["content"] = "[old0001] An older index: nothing like today's results."

    _edit(tmp_path / "trajectories-scaffold.jsonl", 1, older_tool_answer)
    (source,) = reverify_run(tmp_path).sources
    assert source.changed == 1 and source.observation_changed == 1
    changed = next(e for e in source.examples if e["task_id"] == first["task_id"] and e["harness"] == "bare")
    assert changed["old"][0] == pytest.approx(first["reward"]) and changed["new"][0] == pytest.approx(
        first["reward"] - 0.5
    )
    diff = next(e for e in source.examples if e["harness"] == "scaffold")["observation_diff"]
    assert "after turn 1" in diff and "An older index" in diff


def test_a_verifier_that_raises_is_an_error_per_episode_and_the_rest_are_rescored(
    tmp_path, monkeypatch
) -> None:
    from toolgym.envs.search_qa import ExactMatchVerifier

    _scripted_eval(tmp_path)
    broken = json.loads((tmp_path / "trajectories-bare.jsonl").read_text().splitlines()[0])["task_id"]
    score = ExactMatchVerifier.score

    def buggy(self, task, answer, trajectory):
        if task.id == broken:
            raise KeyError("a verifier bug")
        return score(self, task, answer, trajectory)

    monkeypatch.setattr(ExactMatchVerifier, "score", buggy)
    assert main(["reverify", str(tmp_path)]) == 1
    (source,) = json.loads((tmp_path / RESULT).read_text())["sources"]
    assert len(source["errors"]) == 2 and all("a verifier bug" in e for e in source["errors"])  # both tracks
    assert source["rescored"] == 4 and source["changed"] == 0


def test_a_directory_without_trajectories_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no stored trajectories to re-score"):
        reverify_run(tmp_path)
    with pytest.raises(ConfigError, match="is not a directory"):
        reverify_run(tmp_path / "missing")


@pytest.mark.parametrize(
    "line",
    ["[" * 60_000 + "]" * 60_000, '{"trajectory": ' + "9" * 5000 + "}", '{"trajectory": [1]}', "[1, 2]"],
    ids=["nested 60,000 deep", "a 5,000-digit number", "not a trajectory", "not a record"],
)
def test_a_training_sample_file_with_a_hostile_line_is_a_located_config_error(tmp_path, line) -> None:
    """A stored record is data from anyone: however deep, long or wrong, it is a ConfigError naming
    file:line, never a raw RecursionError or ValueError."""
    (tmp_path / "config.json").write_text(json.dumps({"env": {"id": SEARCH}}))
    (tmp_path / "trajectories.jsonl").write_text("\n" + line + "\n")
    with pytest.raises(ConfigError, match=r"trajectories.jsonl:2"):
        reverify_run(tmp_path)


SOLUTION = (
    "def has_close_elements(numbers, threshold):\n"
    "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n"
)


@pytest.mark.docker
async def test_a_training_runs_code_submission_is_run_again_in_the_sandbox(tmp_path) -> None:
    """A training run's samples (config.json + trajectories.jsonl): the sandbox runs the code again."""
    from toolgym.agents.harness import get_harness
    from toolgym.agents.policies.base import ScriptedPolicy
    from toolgym.agents.rollout import run_episode
    from toolgym.registry import make

    env_id = "toolgym/CodeExec-v0"
    call = lambda name, code: json.dumps({"name": name, "arguments": {"code": code}})  # noqa: E731
    turns = [
        f"<tool_call>{call('python', 'print(2 + 2)')}</tool_call>",
        f"<tool_call>{call('submit', SOLUTION)}</tool_call>",
    ]
    env = make(env_id)
    try:
        episode = await run_episode(
            env,
            ScriptedPolicy(turns),
            get_harness("bare"),
            seed=3,
            options={"task_id": "HumanEval/0"},
            env_id=env_id,
        )
    finally:
        env.close()
    assert episode.status == "ok" and episode.reward == 1.0
    (tmp_path / "config.json").write_text(json.dumps({"env": {"id": env_id, "kwargs": {}}}))
    (tmp_path / "trajectories.jsonl").write_text(
        json.dumps({"step": 1, "trajectory": json.loads(episode.to_json())}) + "\n"
    )
    (source,) = reverify_run(tmp_path).sources
    assert source.rescored == 1 and source.changed == source.observation_changed == 0 and not source.errors
    assert source.tracks == {"bare": [1, 1.0, 1.0]}


PLANTED = """
import os, pathlib
pathlib.Path(os.environ["PLANTED_MARKER"]).write_text("imported: its code ran")
import gymnasium
from toolgym.core import FunctionTool, Score, Task
from toolgym.env import ToolEnv

class Verifier:
    def score(self, task, answer, trajectory):
        return Score(reward=1.0 if answer == task.reference else 0.0)

class PlantedEnv(ToolEnv):
    def __init__(self):
        super().__init__(max_turns=1)
        self.tasks = [Task(id="t0", prompt="Say a.", reference="a")]
        self.verifier = Verifier()

    async def episode_tools(self, task):
        schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
        return [FunctionTool("answer", "Answer.", schema, terminal=True)]

if "toolgym-test/Planted-v0" not in gymnasium.registry:
    gymnasium.register(id="toolgym-test/Planted-v0", entry_point=f"{__name__}:PlantedEnv")
"""


async def test_a_module_a_stored_run_names_is_never_imported_without_the_flag(
    tmp_path, monkeypatch, capsys
) -> None:
    """A stored ``module:id`` environment id would import (run) that module: refused unless allowed;
    ``toolgym report`` never imports anything a run names."""
    import sys

    import gymnasium

    from toolgym.agents.harness import get_harness
    from toolgym.agents.policies.base import ScriptedPolicy
    from toolgym.agents.rollout import run_episode
    from toolgym.registry import make

    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "planted_env_module.py").write_text(PLANTED)
    monkeypatch.syspath_prepend(str(modules))
    env_id = "planted_env_module:toolgym-test/Planted-v0"
    monkeypatch.setenv("PLANTED_MARKER", str(tmp_path / "while-recording"))
    env = make(env_id)  # the run that recorded the episode imported it, as it was asked to
    try:
        turn = '<tool_call>{"name": "answer", "arguments": {"answer": "a"}}</tool_call>'
        episode = await run_episode(
            env, ScriptedPolicy([turn]), get_harness("bare"), seed=0, options={"task_id": "t0"}, env_id=env_id
        )
    finally:
        env.close()
    assert episode.reward == 1.0
    del sys.modules["planted_env_module"], gymnasium.registry["toolgym-test/Planted-v0"]
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"env": {"id": env_id, "kwargs": {}}}))
    (run / "trajectories.jsonl").write_text(
        json.dumps(
            {"step": 1, "advantage": 0.0, "trained": False, "trajectory": json.loads(episode.to_json())}
        )
        + "\n"
    )
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1.0, "reward/mean": 1.0}) + "\n")
    marker = tmp_path / "marker"
    monkeypatch.setenv("PLANTED_MARKER", str(marker))

    assert main(["reverify", str(run)]) == 2
    err = capsys.readouterr().err
    assert "--allow-import" in err and "'planted_env_module'" in err and "Nothing was imported" in err
    with pytest.raises(ConfigError, match="--allow-import"):
        reverify_run(run)
    assert main(["report", str(run)]) == 0  # the report reads the files, and imports nothing
    assert not marker.exists() and "planted_env_module" not in sys.modules

    assert main(["reverify", str(run), "--allow-import"]) == 0  # trusted: it runs
    assert marker.exists()
    (source,) = json.loads((run / RESULT).read_text())["sources"]
    assert source["rescored"] == 1 and source["changed"] == 0 and not source["errors"]
