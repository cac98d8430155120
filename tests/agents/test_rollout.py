"""The rollout loop's token bookkeeping, harness tracks, trajectories and paired evaluation."""

from __future__ import annotations

import asyncio

import pytest

from toolgym import FunctionTool, Score, Task, ToolEnv
from toolgym.agents.chat import ByteTokenizer
from toolgym.agents.evaluate import paired_bootstrap, summarize
from toolgym.agents.harness import get_harness
from toolgym.agents.policy import ScriptedPolicy
from toolgym.agents.rollout import read_trajectories, run_episode, write_trajectories
from toolgym.core import SamplingParams, Trajectory, sampled_ids_hash
from toolgym.errors import BackendError, ConfigError
from toolgym.parsing import format_tool_call


class Echo:
    def score(self, task, answer, trajectory):
        return Score(float(answer == task.reference), {"reward/exact": float(answer == task.reference)})


class EchoEnv(ToolEnv):
    def __init__(self, broken: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.tasks = [Task("t", "Say the word in the tool.", "kiwi")]
        self.verifier = Echo()
        self.broken = broken

    async def episode_tools(self, task):
        def word() -> str:
            if self.broken:
                raise BackendError("store unavailable")
            return "kiwi"

        return [
            FunctionTool("word", "Returns the word", {"type": "object", "properties": {}}, fn=word),
            FunctionTool(
                "answer",
                "Answer",
                {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
                terminal=True,
            ),
        ]


TURNS = [format_tool_call("word", {}), format_tool_call("answer", {"answer": "kiwi"})]


def run(env, policy, track="bare", **kwargs):
    return asyncio.run(run_episode(env, policy, get_harness(track), seed=0, **kwargs))


def test_mask_marks_exactly_the_sampled_tokens():
    tok = ByteTokenizer()
    trajectory = run(EchoEnv(), ScriptedPolicy(TURNS))
    assert trajectory.status == "ok" and trajectory.reward == 1.0
    n = len(trajectory.token_ids)
    assert len(trajectory.loss_mask) == len(trajectory.logprobs) == n
    sampled = [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask, strict=True) if m]
    expected = tok.encode(TURNS[0] + "<|im_end|>") + tok.encode(TURNS[1] + "<|im_end|>")
    assert sampled == expected
    assert trajectory.token_hash == sampled_ids_hash(trajectory.token_ids, trajectory.loss_mask)
    # the tool output sits between the two turns with mask 0
    text = tok.decode(trajectory.token_ids)
    assert "<tool_response>\nkiwi\n</tool_response>" in text
    first_end = trajectory.loss_mask.index(1) + len(tok.encode(TURNS[0] + "<|im_end|>"))
    assert trajectory.loss_mask[first_end] == 0


def test_length_cut_turn_is_closed_before_the_next_chunk():
    trajectory = run(
        EchoEnv(max_turns=3), ScriptedPolicy([TURNS[0]] * 3), sampling=SamplingParams(max_tokens=12)
    )
    ids, mask = trajectory.token_ids, trajectory.loss_mask
    assert sum(mask) == 36 and trajectory.status == "truncated"
    assert 257 not in [t for t, m in zip(ids, mask, strict=True) if m]  # the cut turns sampled no end token
    # ... so the two turns followed by more context are closed by an <|im_end|> with mask 0
    closes = [i for i in range(1, len(ids)) if ids[i] == 257 and mask[i] == 0 and mask[i - 1] == 1]
    assert len(closes) == 2


def test_infra_error_marks_the_trajectory_and_scores_nothing():
    trajectory = run(EchoEnv(broken=True), ScriptedPolicy(TURNS))
    assert trajectory.status == "infra_error" and trajectory.reward == 0.0
    assert trajectory.error == "BackendError: store unavailable"


def test_turn_limit_truncates():
    trajectory = run(EchoEnv(max_turns=2), ScriptedPolicy([TURNS[0]] * 3))
    assert trajectory.status == "truncated" and trajectory.reward == 0.0


def test_token_budget_truncates():
    trajectory = run(EchoEnv(), ScriptedPolicy(TURNS), max_total_tokens=50)
    assert trajectory.status == "truncated"
    assert len(trajectory.token_ids) >= 50


def test_scaffold_adds_plan_hints_and_budget_with_mask_zero():
    turns = ["<tool_call>{bad</tool_call>", TURNS[1]]
    bare, scaffold = run(EchoEnv(), ScriptedPolicy(turns)), run(EchoEnv(), ScriptedPolicy(turns), "scaffold")
    assert bare.reward == scaffold.reward == 1.0
    texts = [m["content"] for m in scaffold.messages]
    assert "Work in steps." in texts[0]
    assert any(t.startswith("Hint: that call failed.") for t in texts)
    assert any("turns left." in t for t in texts)
    assert sum(bare.loss_mask) == sum(scaffold.loss_mask)
    assert len(scaffold.token_ids) > len(bare.token_ids)


def test_unknown_harness():
    with pytest.raises(ConfigError, match="Did you mean 'scaffold'"):
        get_harness("scafold")


def test_trajectory_jsonl_round_trip(tmp_path):
    trajectory = run(EchoEnv(), ScriptedPolicy(TURNS))
    path = tmp_path / "t.jsonl"
    write_trajectories(path, [trajectory, trajectory])
    assert read_trajectories(path) == [trajectory, trajectory]
    path.write_text(path.read_text() + "{broken\n")
    with pytest.raises(ValueError, match=r"t.jsonl:3"):
        read_trajectories(path)


def test_paired_bootstrap_values():
    diff, low, high = paired_bootstrap([0, 0, 0, 0], [1, 1, 1, 1])
    assert (diff, low, high) == (1.0, 1.0, 1.0)
    diff, low, high = paired_bootstrap([0, 1, 0, 1, 0, 1], [1, 1, 0, 1, 1, 1])
    assert diff == pytest.approx(2 / 6) and low <= diff <= high and low >= 0.0
    with pytest.raises(ValueError):
        paired_bootstrap([1], [1, 2])


def test_summarize_counts_infra_errors_apart():
    ok = run(EchoEnv(), ScriptedPolicy(TURNS))
    broken = run(EchoEnv(broken=True), ScriptedPolicy(TURNS))
    summary = summarize("bare", [ok, broken])
    assert summary.n == 2 and summary.infra_errors == 1 and summary.success == 1.0


def test_verifier_exception_propagates():
    class Broken(Echo):
        def score(self, task, answer, trajectory):
            raise RuntimeError("verifier bug")

    env = EchoEnv()
    env.verifier = Broken()
    with pytest.raises(RuntimeError, match="verifier bug"):
        run(env, ScriptedPolicy(TURNS))


def test_trajectory_json_round_trip_is_exact():
    trajectory = run(EchoEnv(), ScriptedPolicy(TURNS))
    assert Trajectory.from_json(trajectory.to_json()) == trajectory
