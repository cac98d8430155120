"""Counterfactual credit per tool call (toolgym.agents.eval.credit): a toy environment where one call
decides the reward and another is useless, played by a policy that reads its context; the credit must
land on the deciding call, and an environment that answers differently on replay is refused."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import gymnasium
import pytest

from toolgym.agents.chat.chatml import ByteTokenizer
from toolgym.agents.eval.credit import (
    CREDIT_FILE,
    CreditReport,
    NotReplayable,
    credit_episode,
    credit_run,
    episode_calls,
    forced_turns,
)
from toolgym.agents.eval.runs import EvalRun, EvalSettings
from toolgym.agents.harness import get_harness
from toolgym.agents.policies.base import ChatPolicy
from toolgym.agents.rollout import run_episode
from toolgym.core import Completion, FunctionTool, SamplingParams, Score, Task
from toolgym.env import ToolEnv

SECRET = "4242"


def lookup(topic: str) -> str:
    """Look a topic up.

    Args:
        topic: what to look up
    """
    return f"the secret is {SECRET}" if topic == "secret" else f"{topic}: sunny"


def answer(answer: str) -> str:
    """Answer. Ends the episode.

    Args:
        answer: the answer
    """
    return answer


class SecretVerifier:
    def score(self, task: Task, answer: object, trajectory: object) -> Score:
        return Score(float(str(answer).strip() == SECRET), {})


class SecretEnv(ToolEnv):
    """One task: the secret, which only ``lookup("secret")`` shows; ``lookup("weather")`` is useless.
    ``drift`` makes every reset's prompt differ (an environment that does not answer the same twice)."""

    def __init__(self, *, drift: bool = False) -> None:
        super().__init__(max_turns=4)
        self.tasks = [Task("s", "What is the secret?", SECRET)]
        self.verifier = SecretVerifier()
        self.drift, self.resets = drift, 0

    async def episode_tools(self, task: Task) -> list[FunctionTool]:
        return [FunctionTool.from_function(lookup), FunctionTool.from_function(answer, terminal=True)]

    def tool_use_metrics(self, task: Task, calls, answer) -> dict[str, float]:
        return {"use/answer_shown": float(any(SECRET in c.output for c in calls))}

    async def areset(self, *, seed=None, options=None):
        obs, info = await super().areset(seed=seed, options=options)
        self.resets += 1
        if self.drift:
            obs = [dict(m) for m in obs]
            obs[-1]["content"] += f" (reset {self.resets})"
        return obs, info


def call(name: str, **arguments: str) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class Reader(ChatPolicy):
    """Looks the secret up, then the weather, then answers what its context shows (``unknown`` if
    nothing): the reward depends on the first lookup's result alone."""

    name = "reader"

    def __init__(self) -> None:
        super().__init__(ByteTokenizer())

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        seen = bytes(t for t in token_ids if t < 256).decode("utf-8", "replace")
        if '"topic": "secret"' not in seen:
            text = call("lookup", topic="secret")
        elif '"topic": "weather"' not in seen:
            text = call("lookup", topic="weather")
        else:
            text = call("answer", answer=SECRET if f"secret is {SECRET}" in seen else "unknown")
        return self.complete(text, sampling)


async def episode(env: gymnasium.Env, harness: str = "bare"):
    return await run_episode(
        env,
        Reader(),
        get_harness(harness),
        seed=3,
        options={"task_id": "s"},
        sampling=SamplingParams(512, 0.0),
    )


@pytest.mark.parametrize("harness", ["bare", "scaffold"])
async def test_the_credit_lands_on_the_call_that_decides_the_reward(harness: str) -> None:
    env = SecretEnv()
    stored = await episode(env, harness)
    assert stored.reward == 1.0 and [(t, tool) for t, tool, _ in episode_calls(stored)] == [
        (1, "lookup"),
        (2, "lookup"),
    ]
    turns = forced_turns(stored)  # the sampled tokens, turn by turn, as they were sampled
    assert len(turns) == 3 and [t for c in turns for t in c.token_ids] == [
        t for t, m in zip(stored.token_ids, stored.loss_mask, strict=True) if m
    ]
    credits, infra = await credit_episode(
        env, Reader(), stored, sampling=SamplingParams(512), max_total_tokens=4096
    )
    assert infra == 0
    assert [(c.turn, c.reward_with, c.reward_without, c.credit) for c in credits] == [
        (1, 1.0, 0.0, 1.0),  # without the secret's result the reader answers "unknown"
        (2, 1.0, 1.0, 0.0),  # the weather changes nothing
    ]
    assert [c.answer_shown for c in credits] == [1.0, 0.0]
    assert (
        await credit_episode(
            env, Reader(), stored, sampling=SamplingParams(512), max_total_tokens=4096, max_calls=1
        )
    )[0] == credits[:1]


async def test_a_pass_over_an_evaluation_reports_and_writes_its_distribution(tmp_path: Path) -> None:
    env = SecretEnv()
    bare, scaffold = await episode(env, "bare"), await episode(env, "scaffold")
    settings = EvalSettings(
        env_id="toolgym-test/Secret",
        env_kwargs={},
        harnesses=("bare", "scaffold"),
        task_ids=("s",),
        seeds=(3,),
        max_total_tokens=4096,
        policy="reader",
        policy_info={},
        sampling={"max_tokens": 512, "temperature": 0.0},
    )
    run = EvalRun(tmp_path, settings, "complete", {"bare": [bare], "scaffold": [scaffold]})
    seen: list[tuple[int, int]] = []
    report = await credit_run(
        run,
        SecretEnv,
        Reader(),
        source="toy",
        policy_name="reader",
        max_calls=3,
        progress=lambda d, n: seen.append((d, n)),
    )
    assert report.episodes == 2 and report.left_out == 1 and len(report.calls) == 3
    assert seen == [(1, 2), (2, 2)]
    summary = report.summary()
    assert summary["all"]["n"] == 3 and summary["all"]["mean"] == pytest.approx(2 / 3)
    assert summary["by_turn"]["1"]["mean"] == 1.0 and summary["by_turn"]["2"]["mean"] == 0.0
    assert summary["by_answer_shown"]["answer shown"]["positive"] == 1.0
    assert "| turn 1 | 2 | +1.000 |" in report.table()
    written = json.loads((report.write(tmp_path / "out")).read_text())
    assert written["summary"]["all"]["n"] == 3 and written["calls"][0]["credit"] == 1.0
    assert (tmp_path / "out" / CREDIT_FILE).is_file()


async def test_an_environment_that_answers_differently_on_replay_is_not_replayable() -> None:
    env = SecretEnv(drift=True)
    stored = await episode(env)
    with pytest.raises(NotReplayable, match=r"part from the stored ones at token \d+"):
        await credit_episode(env, Reader(), stored, sampling=SamplingParams(512), max_total_tokens=4096)
    settings = EvalSettings("toolgym-test/Secret", {}, ("bare",), ("s", "s"), (3, 3), 4096, "reader", {}, {})
    run = EvalRun(None, settings, "complete", {"bare": [stored, stored]})
    report = await credit_run(
        run, lambda: SecretEnv(drift=True), Reader(), source="toy", policy_name="reader", max_calls=1
    )
    assert report.episodes == 2 and len(report.not_replayable) == 2  # the budget is spent on scored calls
    assert report.left_out == 0, "calls of unreplayable episodes were tried, not left out by the budget"
    assert report.summary()["all"]["n"] == 0 and report.table().count("\n") == 1  # a header, no rows


@pytest.mark.slow
def test_toolgym_credit_on_an_evaluation_of_searchqa(tmp_path: Path, capsys) -> None:
    """The command on a real evaluation (SearchQA's index and verifier, the scripted baseline, which
    answers the top hit's title): every call is replayed with and without its result, and the credit is
    the F1 the result was worth (the baseline answers "unknown" without it)."""
    from toolgym.cli.main import main

    out = tmp_path / "eval"
    args = ["eval", "--env", "toolgym/SearchQA-v0", "--policy", "scripted", "--n", "6", "--harness", "bare"]
    assert main([*args, "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["credit", str(out), "--episodes", "6", "--calls", "4"]) == 0
    printed = capsys.readouterr().out
    written = json.loads((out / CREDIT_FILE).read_text())
    assert written["episodes"] <= 6 and len(written["calls"]) == 4 and written["left_out"] == 2
    assert "| all calls | 4 |" in printed and "4 tool calls" in printed
    stored = {
        t["task_id"]: t for t in map(json.loads, (out / "trajectories-bare.jsonl").read_text().splitlines())
    }
    for c in written["calls"]:
        assert c["tool"] == "search" and c["turn"] == 1 and c["reward_without"] == 0.0
        assert c["reward_with"] == pytest.approx(stored[c["task_id"]]["reward"])  # greedy: the stored episode
        assert c["credit"] == pytest.approx(c["reward_with"])
    assert main(["credit", str(out), "--calls", "0"]) == 2  # a budget below 1 is refused
    assert main(["credit", str(tmp_path)]) == 2  # neither an evaluation nor a run with one
    assert "is neither an evaluation" in capsys.readouterr().err


def test_the_shipped_credit_file_gives_the_table_results_md_shows() -> None:
    """training/results/demo/credit-bare.json (toolgym credit on the demo's held-out bare track): read
    back, its rows are RESULTS.md's, and every credit is its two rewards' difference."""
    root = Path(__file__).resolve().parents[3] / "training"
    data = json.loads((root / "results" / "demo" / "credit-bare.json").read_text())
    report = CreditReport.from_json(data)
    assert report.summary() == data["summary"] and len(report.calls) == 99
    assert all(c["credit"] == pytest.approx(c["reward_with"] - c["reward_without"]) for c in data["calls"])
    document = (root / "RESULTS.md").read_text()
    rows = report.table().splitlines()[2:]
    assert rows[0].replace("| all calls |", "| all calls (search, turn 1) |") in document
    for row in rows:
        if row.startswith("| answer"):
            assert row in document
