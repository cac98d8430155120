"""The rollout loop's token bookkeeping, harness tracks, trajectories, paired evaluation, and the
failure boundary: one test per kind of failure, each handled the one way toolgym's error rule says."""

from __future__ import annotations

import asyncio

import pytest

from toolgym import FunctionTool, Score, Task, ToolEnv
from toolgym.agents.chat.chatml import ByteTokenizer
from toolgym.agents.eval.evaluate import summarize
from toolgym.agents.eval.stats import paired_bootstrap
from toolgym.agents.harness import get_harness
from toolgym.agents.policies.base import ScriptedPolicy
from toolgym.agents.rollout import read_trajectories, run_episode, write_trajectories
from toolgym.core import SamplingParams, Trajectory, sampled_ids_hash
from toolgym.env import RetryPolicy
from toolgym.errors import (
    BackendError,
    ConfigError,
    InfraError,
    PolicyError,
    SandboxError,
    ToolCallError,
    ToolTimeout,
    VerificationUnavailable,
    VerifierError,
)
from toolgym.parsing import format_tool_call


class Echo:
    def score(self, task, answer, trajectory):
        return Score(float(answer == task.reference), {"reward/exact": float(answer == task.reference)})


class EchoEnv(ToolEnv):
    """``word()`` returns "kiwi"; ``fail`` lists what its calls raise first, in order (then it works)."""

    def __init__(self, broken: bool = False, fail: list[BaseException] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.tasks = [Task("t", "Say the word in the tool.", "kiwi")]
        self.verifier = Echo()
        self.broken = broken
        self.fail = list(fail or [])
        self.calls = 0
        self.retry = RetryPolicy(retries=2, backoff_s=0.0)  # the schedule itself is tested apart

    async def episode_tools(self, task):
        def word() -> str:
            self.calls += 1
            if self.broken:
                raise BackendError("store unavailable")
            if self.fail:
                raise self.fail.pop(0)
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


def test_a_length_cut_turn_is_played_and_ends_sampling():
    env = EchoEnv(max_turns=3)
    trajectory = run(env, ScriptedPolicy([TURNS[0]] * 3), sampling=SamplingParams(max_tokens=12))
    ids, mask = trajectory.token_ids, trajectory.loss_mask
    assert sum(mask) == 12 and trajectory.status == "truncated" and trajectory.stop_reason == "turn_truncated"
    assert mask[-12:] == (1,) * 12 and 257 not in ids[-12:]  # the cut turn is the sequence's end
    # played as sampled (a cut call runs nothing), and nothing sampled after it
    assert env.calls == 0 and trajectory.metrics["env/turn_truncated"] == 1.0


def test_an_episode_the_rollout_ends_keeps_the_envs_tool_counters():
    # turn 1 calls the tool (57 sampled ids with <|im_end|>), turn 2 is cut at 60: the rollout ends the
    # episode, and the env's counters (which the learner's format credit reads) must still be there
    env = EchoEnv(max_turns=3)
    cut = '<tool_call>{"name": "word", "arguments": {"note": "' + "x" * 80
    trajectory = run(env, ScriptedPolicy([TURNS[0], cut]), sampling=SamplingParams(max_tokens=60))
    assert trajectory.stop_reason == "turn_truncated" and env.calls == 1
    assert trajectory.metrics["tool/word/calls"] == 1.0 and trajectory.metrics["env/parse_errors"] == 1.0


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


# ------------------------------------------------------------------ the failure boundary
class FlakyVerifier(Echo):
    """Raises each of ``errors`` on successive calls, then scores like :class:`Echo`."""

    def __init__(self, errors):
        self.errors = list(errors)
        self.calls = 0

    def score(self, task, answer, trajectory):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return super().score(task, answer, trajectory)


class FailingPolicy(ScriptedPolicy):
    """Replays ``turns`` but raises ``error`` on turn number ``at`` (1-based)."""

    def __init__(self, turns, error, at):
        super().__init__(turns)
        self.error, self.at = error, at

    async def generate(self, token_ids, sampling):
        if self._next + 1 == self.at:
            raise self.error
        return await super().generate(token_ids, sampling)


@pytest.mark.parametrize(
    ("turn", "error", "observation"),
    [
        ('<tool_call>{"name": "word", "arguments": </tool_call>', None, "Error: "),
        (format_tool_call("wrod", {}), None, "Error: "),
        (TURNS[0], ToolCallError("no such word"), "Error: word: no such word"),
        (TURNS[0], ToolTimeout("timed out after 1 s"), "Error: word: timed out after 1 s"),
    ],
    ids=["ToolParseError-json", "ToolParseError-unknown-tool", "ToolCallError", "ToolTimeout"],
)
def test_model_mistakes_become_observations_and_the_episode_goes_on(turn, error, observation):
    env = EchoEnv(fail=[error] if error else [])
    trajectory = run(env, ScriptedPolicy([turn, TURNS[1]]))
    assert trajectory.status == "ok" and trajectory.reward == 1.0
    tool_texts = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert len(tool_texts) == 1 and tool_texts[0].startswith(observation)
    assert "env/infra_retries" not in trajectory.metrics  # a model mistake is never retried
    if isinstance(error, (ToolCallError, ToolTimeout)):
        assert env.calls == 1 and trajectory.metrics["tool/word/errors"] == 1.0
    else:
        assert trajectory.metrics["env/parse_errors"] == 1.0


def _sandbox_errors():
    from toolgym.tools.sandbox import SandboxUnavailable

    return [SandboxError("container died"), SandboxUnavailable("no engine"), BackendError("index gone")]


@pytest.mark.parametrize("error", _sandbox_errors(), ids=lambda e: type(e).__name__)
def test_an_infra_failure_of_a_tool_is_retried_and_the_episode_goes_on(error):
    env = EchoEnv(fail=[error, error])  # two failures, then the third try works
    trajectory = run(env, ScriptedPolicy(TURNS))
    assert trajectory.status == "ok" and trajectory.reward == 1.0
    assert env.calls == 3 and trajectory.metrics["env/infra_retries"] == 2.0
    assert "<tool_response>\nkiwi\n</tool_response>" in ByteTokenizer().decode(trajectory.token_ids)


@pytest.mark.parametrize("error", _sandbox_errors(), ids=lambda e: type(e).__name__)
def test_an_infra_failure_of_a_tool_that_outlasts_the_retries_is_an_infra_error(error):
    env = EchoEnv(fail=[error] * 3)
    trajectory = run(env, ScriptedPolicy(TURNS))
    assert trajectory.status == "infra_error" and trajectory.reward == 0.0
    assert trajectory.error == f"{type(error).__name__}: {error}"
    assert env.calls == 3  # the first try and two retries, no more
    assert trajectory.metrics["env/infra_retries"] == 2.0 and trajectory.metrics["env/infra_error"] == 1.0


def test_no_retries_when_the_policy_says_none():
    env = EchoEnv(fail=[SandboxError("container died")])
    env.retry = RetryPolicy(retries=0)
    trajectory = run(env, ScriptedPolicy(TURNS))
    assert trajectory.status == "infra_error" and env.calls == 1
    assert trajectory.metrics.get("env/infra_retries", 0.0) == 0.0


def test_a_verifier_infra_failure_is_retried_then_scored():
    env = EchoEnv()
    env.verifier = FlakyVerifier([SandboxError("the test container died")])
    trajectory = run(env, ScriptedPolicy(TURNS))
    assert trajectory.status == "ok" and trajectory.reward == 1.0
    assert env.verifier.calls == 2 and trajectory.metrics["env/infra_retries"] == 1.0


def test_a_verification_that_cannot_run_is_verification_unavailable_never_a_score():
    env = EchoEnv()
    env.verifier = FlakyVerifier([SandboxError("engine down")] * 3)
    trajectory = run(env, ScriptedPolicy(TURNS))
    assert trajectory.status == "infra_error" and trajectory.reward == 0.0
    assert trajectory.error.startswith(
        "VerificationUnavailable: the verifier of t could not run after 3 tries"
    )
    assert "SandboxError: engine down" in trajectory.error
    assert env.verifier.calls == 3 and trajectory.metrics["env/infra_retries"] == 2.0


def test_verification_unavailable_from_the_verifier_keeps_its_message():
    env = EchoEnv()
    env.verifier = FlakyVerifier([VerificationUnavailable("the grader is offline")] * 3)
    trajectory = run(env, ScriptedPolicy(TURNS))
    assert trajectory.error == "VerificationUnavailable: the grader is offline"


def test_a_verifier_bug_raises_at_once_and_is_never_retried_or_scored():
    env = EchoEnv()
    env.verifier = FlakyVerifier([VerifierError("test data cannot run")])
    with pytest.raises(VerifierError, match="test data cannot run"):
        run(env, ScriptedPolicy(TURNS))
    assert env.verifier.calls == 1


def test_a_bug_in_a_tool_raises_at_once_and_is_never_retried():
    env = EchoEnv(fail=[KeyError("oops")])
    with pytest.raises(KeyError, match="oops"):
        run(env, ScriptedPolicy(TURNS))
    assert env.calls == 1


def test_a_policy_failure_mid_episode_is_an_infra_error_with_the_sampled_turns_kept():
    policy = FailingPolicy(TURNS, PolicyError("engine died"), at=2)
    trajectory = run(EchoEnv(), policy)
    assert trajectory.status == "infra_error" and trajectory.reward == 0.0
    assert trajectory.error == "PolicyError: engine died"
    tok = ByteTokenizer()
    assert [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask, strict=True) if m] == tok.encode(
        TURNS[0] + "<|im_end|>"
    )
    assert trajectory.metrics["env/infra_error"] == 1.0


def test_a_policy_failure_before_any_turn_keeps_the_policy_version():
    policy = FailingPolicy(TURNS, PolicyError("connection refused"), at=1)
    policy.policy_version = 7
    trajectory = run(EchoEnv(), policy)
    assert trajectory.status == "infra_error" and trajectory.policy_version == 7
    assert sum(trajectory.loss_mask) == 0


@pytest.mark.parametrize(
    "error", [ConfigError("HTTP 400: unknown model"), RuntimeError("bug")], ids=lambda e: type(e).__name__
)
def test_a_policy_config_error_or_bug_raises(error):
    with pytest.raises(type(error)):
        run(EchoEnv(), FailingPolicy(TURNS, error, at=2))


def test_an_infra_error_raised_outside_an_environment_has_no_episode_metrics():
    assert InfraError("x").episode_metrics == {}


def test_a_left_out_share_past_the_threshold_is_a_warning():
    from toolgym.agents.eval.evaluate import LEFT_OUT_WARNING, left_out_warning

    assert LEFT_OUT_WARNING == 0.05
    assert left_out_warning("track 'bare'", 1, 20) is None  # 5%: not past it
    assert left_out_warning("track 'bare'", 0, 0) is None
    warning = left_out_warning("track 'bare'", 13, 20)
    assert warning is not None and warning.startswith(
        "track 'bare': 13 of 20 episodes (65%) ended in infra_error"
    )
    assert "over the other 7 only" in warning
