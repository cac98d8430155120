"""Context compaction: segments with their own receipts, exact masks, loops stopped, bad rules refused;
the first truncated turn ends sampling. A real CodeExec episode that needs compaction gets through it."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from toolgym import FunctionTool, Score, Task, ToolEnv
from toolgym.agents.chat.chatml import IM_END, ByteTokenizer, ChatMLTemplate
from toolgym.agents.compaction import SUMMARY_REQUEST, CompactingHarness, CompactionConfig
from toolgym.agents.harness import get_harness
from toolgym.agents.policies.base import RulePolicy, ScriptedPolicy
from toolgym.agents.rollout import run_episode
from toolgym.core import SamplingParams, Trajectory
from toolgym.errors import ConfigError
from toolgym.parsing import format_tool_call
from toolgym.training.learn.grpo import check_token_receipt, plan_step

PAGE = "kiwi " * 100  # 500 characters: 500 byte tokens


class Exact:
    def score(self, task, answer, trajectory):
        return Score(float(answer == task.reference), {})


class PagesEnv(ToolEnv):
    """``page(n)`` returns a long page; the answer is the word on every page."""

    def __init__(self, **kwargs):
        super().__init__(max_turns=kwargs.pop("max_turns", 12), **kwargs)
        self.tasks = [Task("t", "Read pages 1 to 6, then answer with the word on them.", "kiwi")]
        self.verifier = Exact()
        self.calls = 0

    async def episode_tools(self, task):
        def page(n: int) -> str:
            self.calls += 1
            return f"page {n}: {PAGE}"

        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        answer = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
        return [
            FunctionTool("page", "Returns a page", schema, fn=page),
            FunctionTool("answer", "Answer", answer, terminal=True),
        ]


TURNS = [format_tool_call("page", {"n": n}) for n in range(1, 7)] + [
    format_tool_call("answer", {"answer": "kiwi"})
]
SAMPLING = SamplingParams(max_tokens=200)


def run(harness, policy, *, budget=2400, env=None):
    env = env or PagesEnv()
    return asyncio.run(run_episode(env, policy, harness, seed=0, sampling=SAMPLING, max_total_tokens=budget))


def sampled_runs(ids, mask):
    """The mask-1 stretches of a sequence, as lists of ids."""
    runs, current = [], []
    for token, m in zip(ids, mask, strict=True):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_without_compaction_the_budget_ends_the_episode():
    trajectory = run(get_harness("bare"), ScriptedPolicy(TURNS))
    assert trajectory.status == "truncated" and trajectory.reward == 0.0
    assert trajectory.stop_reason == "token_budget" and trajectory.segments == ()
    assert trajectory.segment_views() == [trajectory]


def test_drop_compaction_goes_on_in_segments_with_exact_receipts_and_masks():
    tok = ByteTokenizer()
    trajectory = run(get_harness("bare+compact"), ScriptedPolicy(TURNS))
    assert trajectory.status == "ok" and trajectory.reward == 1.0 and trajectory.stop_reason == "answer"
    assert trajectory.harness == "bare+compact" and len(trajectory.segments) >= 2
    views = trajectory.segment_views()
    expected = [list(tok.encode(turn + IM_END)) for turn in TURNS]
    got = []
    for view in views:
        check_token_receipt(view)  # each segment has its own receipt
        assert len(view.token_ids) <= 2400 and set(view.loss_mask) <= {0, 1}
        assert all(lp == 0.0 for lp in view.logprobs)  # scripted turns: logprob 0 exactly
        got += sampled_runs(view.token_ids, view.loss_mask)
    assert got == expected  # every sampled turn trains exactly once, in order, as sampled
    template = ChatMLTemplate()
    for segment in trajectory.segments:
        # the segment opens with exactly its recorded context; kept turns are their sampled ids (mask 0)
        opening = tok.encode(template.start(list(segment.context)))
        assert list(segment.token_ids[: len(opening)]) == opening
        assert set(segment.loss_mask[: len(opening)]) == {0}
        assert segment.context[-1]["role"] != "assistant" and segment.start_turn > 1
        assert "Context compacted" in segment.context[len(trajectory.messages[:2])]["content"]
        assert segment.dropped_results + segment.dropped_turns >= 1
    assert trajectory.metrics["episode/segments"] == 1 + len(trajectory.segments)
    assert trajectory.metrics["tokens/sampled"] == sum(len(e) for e in expected)
    # the env-level conversation is unchanged by compaction: it replays like any other
    assert [m["content"] for m in trajectory.messages if m["role"] == "assistant"] == TURNS
    again = Trajectory.from_json(trajectory.to_json())
    assert again == trajectory and json.loads(trajectory.to_json())["segments"][0]["start_turn"] > 1


def test_summary_compaction_trains_the_summary_and_carries_it_as_exact_ids():
    tok = ByteTokenizer()
    state = {"calls": 0}
    summary = "I read pages; every page says kiwi. Answer kiwi."

    def rule(transcript: str) -> str:
        if transcript.rstrip().endswith(f"{SUMMARY_REQUEST}{IM_END}\n<|im_start|>assistant"):
            return summary
        state["calls"] += 1
        return TURNS[min(state["calls"], len(TURNS)) - 1] if state["calls"] <= 6 else TURNS[-1]

    trajectory = run(get_harness("bare+summary"), RulePolicy(rule), budget=3000)
    assert trajectory.status == "ok" and trajectory.reward == 1.0 and trajectory.harness == "bare+summary"
    assert trajectory.segments and all(s.summary == summary for s in trajectory.segments)
    summary_ids = list(tok.encode(summary + IM_END))
    views = trajectory.segment_views()
    for before, segment in zip(views, trajectory.segments, strict=False):
        check_token_receipt(before)
        # the summary was sampled (mask 1) at the end of the segment before ...
        assert sampled_runs(before.token_ids, before.loss_mask)[-1] == summary_ids
        # ... and opens the next one as the assistant's previous turn, copied exactly (mask 0)
        opening = tok.encode(ChatMLTemplate().start(list(segment.context)))
        assert list(segment.token_ids[: len(opening)]) == opening
        assert segment.context[-2] == {"role": "assistant", "content": summary}
    assert all(m["content"] != summary for m in trajectory.messages)  # not an action of the episode


def test_compaction_without_progress_stops_as_a_loop():
    # the opening messages alone nearly fill the budget: a compacted context leaves no room for a turn
    class Wordy(PagesEnv):
        def __init__(self):
            super().__init__()
            self.tasks = [Task("t", "x" * 300, "kiwi")]

    trajectory = run(get_harness("bare+compact"), ScriptedPolicy(TURNS), budget=2000, env=Wordy())
    assert trajectory.status == "truncated" and trajectory.stop_reason == "compaction_loop"
    assert trajectory.metrics["env/compaction_loop"] == 1.0 and trajectory.reward == 0.0
    for view in trajectory.segment_views():
        check_token_receipt(view)


def test_compaction_limit_ends_the_episode():
    harness = CompactingHarness(get_harness("bare"), CompactionConfig(max_compactions=1))
    trajectory = run(harness, ScriptedPolicy(TURNS))
    assert trajectory.stop_reason == "compaction_limit" and len(trajectory.segments) == 1
    assert trajectory.metrics["env/compaction_limit"] == 1.0


LONG_TURN = '<tool_call>{"name": "page", "arguments": {"n": 1' + " " * 300  # cut at 200 tokens: mid-call


def test_first_truncated_turn_is_played_then_ends_sampling_and_is_said():
    env = PagesEnv()
    trajectory = run(get_harness("bare"), ScriptedPolicy([LONG_TURN]), env=env)  # no second turn to give
    assert trajectory.status == "truncated" and trajectory.stop_reason == "turn_truncated"
    assert (
        trajectory.metrics["env/turn_truncated"] == 1.0 and sum(trajectory.loss_mask) == SAMPLING.max_tokens
    )
    assert env.calls == 0 and trajectory.messages[-1]["role"] == "tool"  # played: the env answered it
    # a cut turn that still holds a whole answer call is scored: the episode ended by its answer
    answer = format_tool_call("answer", {"answer": "kiwi"}) + " and more" * 40
    done = run(get_harness("bare"), ScriptedPolicy([answer]))
    assert done.status == "ok" and done.reward == 1.0 and done.stop_reason == "answer"
    assert done.metrics["env/turn_truncated"] == 1.0


def test_compaction_rules_that_would_rewrite_sampled_tokens_are_refused():
    with pytest.raises(ConfigError, match="may not rewrite 'assistant'.*exact token ids"):
        CompactionConfig(roles=("tool", "assistant"))
    with pytest.raises(ConfigError, match="may not rewrite 'system'"):
        CompactionConfig(roles=("system",))
    with pytest.raises(ConfigError, match="mode must be"):
        CompactionConfig(mode="rewrite")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="0 < target < 1"):
        CompactionConfig(target=1.5)
    with pytest.raises(ConfigError, match="keep_last >= 1"):
        CompactionConfig(keep_last=0)
    with pytest.raises(ConfigError, match="Did you mean '?compact"):
        get_harness("scaffold+compakt")
    with pytest.raises(ConfigError, match="unknown harness 'scafold\\+compact'.*Did you mean '?scaffold"):
        get_harness("scafold+compact")
    assert get_harness("scaffold+compact").name == "scaffold+compact"
    assert get_harness("scaffold+summary").compaction.mode == "summary"  # type: ignore[attr-defined]


def test_every_segment_trains_with_the_episode_advantage():
    compacted = run(get_harness("bare+compact"), ScriptedPolicy(TURNS))
    failed = run(get_harness("bare"), ScriptedPolicy(TURNS))
    plan = plan_step([[compacted, failed]], skip_zero_variance=True)
    samples = plan.samples
    assert len(samples) == len(compacted.segments) + 2
    episode_adv = plan.advantages[0][0]
    assert episode_adv > 0 and plan.advantages[0][1] == -episode_adv
    mine = [s for s in samples if s.episode is compacted]
    assert [s.trajectory.token_ids for s in mine] == [v.token_ids for v in compacted.segment_views()]
    assert all(s.advantage == episode_adv for s in mine)
    assert plan.tokens == compacted.metrics["tokens/sampled"] + failed.metrics["tokens/sampled"]


@pytest.mark.docker
def test_a_long_code_exec_episode_needs_compaction_and_gets_through_it():
    if os.environ.get("TOOLGYM_SKIP_DOCKER") == "1":
        pytest.skip("TOOLGYM_SKIP_DOCKER=1")
    from toolgym.envs.code_exec import CodeExecEnv, reference_code
    from toolgym.tools.sandbox import DockerSandbox

    turns = [format_tool_call("python", {"code": f"print('{n}' * 700)"}) for n in range(1, 6)]
    turns.append(format_tool_call("submit", {"code": reference_code("MBPP/2")}))
    sampling = SamplingParams(max_tokens=400)
    results = {}
    with DockerSandbox(pool_size=1) as sandbox:
        for track in ("scaffold", "scaffold+compact"):
            env = CodeExecEnv("mbpp", sandbox=sandbox, tool_timeout=10)
            try:
                results[track] = asyncio.run(
                    run_episode(
                        env,
                        ScriptedPolicy(turns),
                        get_harness(track),
                        seed=0,
                        options={"task_id": "MBPP/2"},
                        sampling=sampling,
                        max_total_tokens=4500,
                    )
                )
            finally:
                env.close()
    plain, compacted = results["scaffold"], results["scaffold+compact"]
    assert plain.status == "truncated" and plain.stop_reason == "token_budget" and plain.reward == 0.0
    assert compacted.status == "ok" and compacted.reward == 1.0 and compacted.segments
    assert compacted.metrics["tool/python/calls"] == 5.0
    tok = ByteTokenizer()
    runs = []
    for view in compacted.segment_views():
        check_token_receipt(view)
        assert len(view.token_ids) <= 4500
        runs += sampled_runs(view.token_ids, view.loss_mask)
    assert runs == [list(tok.encode(t + IM_END)) for t in turns]


def test_compacted_and_cut_episodes_replay_unchanged():
    from toolgym.agents.eval.reverify import replay

    compacted = run(get_harness("bare+compact"), ScriptedPolicy(TURNS))
    again = replay(PagesEnv(), compacted)
    assert again.observation_diff == "" and again.reward == compacted.reward == 1.0 and again.status == "ok"
    env = PagesEnv()
    cut = run(get_harness("bare"), ScriptedPolicy([LONG_TURN]), env=env)
    again = replay(PagesEnv(), cut)  # the cut turn was played as sampled, and is played again
    assert again.observation_diff == "" and again.status == "truncated" == cut.status


def test_a_tool_unlocked_mid_episode_stays_announced_after_compaction():
    from toolgym.unlocks import is_announcement

    class WithWord(PagesEnv):
        async def episode_tools(self, task):
            word = FunctionTool(
                "word", "Returns the word", {"type": "object", "properties": {}}, fn=lambda: "kiwi"
            )
            return [*await super().episode_tools(task), word]

    for track in ("bare+compact", "bare+summary"):

        def rule(transcript: str, state: dict = {"calls": 0}) -> str:  # noqa: B006 (one per track)
            if transcript.rstrip().endswith(f"{SUMMARY_REQUEST}{IM_END}\n<|im_start|>assistant"):
                return "Pages say kiwi."
            state["calls"] += 1
            return TURNS[min(state["calls"], len(TURNS)) - 1]

        trajectory = asyncio.run(
            run_episode(
                WithWord(),
                RulePolicy(rule),
                get_harness(track),
                seed=0,
                options={"unlocks": [{"tool": "word", "after": {"turn": 1}}]},
                sampling=SAMPLING,
                max_total_tokens=3000 if track == "bare+summary" else 2400,
            )
        )
        assert trajectory.reward == 1.0 and trajectory.segments, track
        assert any(is_announcement(m) for m in trajectory.messages)  # announced after turn 1
        for segment in trajectory.segments:  # ... and still there after every compaction
            assert sum(is_announcement(m) for m in segment.context) == 1, track
