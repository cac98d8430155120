"""The exploit audit finds reward that can be had without the task, and the shipped environments give none.

A leaky toy environment (its verifier pays for long answers and for answers that quote the question)
shows the audit can fail, one line per failing exploit, and that an exception the environment module
documents (``audit_accepted``: here the oversized answer, on every task) is named as accepted; a
crashing one shows an error is reported per exploit and the audit finishes.
"""

from __future__ import annotations

import json

import gymnasium
import pytest

import toolgym.envs  # noqa: F401  (registers the shipped environments)
from toolgym import FunctionTool, Score, Task, ToolEnv
from toolgym.cli import main
from toolgym.envs.audit import Accepted, audit_env, generic_exploits
from toolgym.errors import ConfigError

GENERIC = {e.name for e in generic_exploits()}


class LeakyVerifier:
    """Pays for an answer that quotes the question or is very long; raises on an empty one if asked."""

    def __init__(self, crash_on_empty: bool) -> None:
        self.crash_on_empty = crash_on_empty

    def score(self, task: Task, answer: object, trajectory: object) -> Score:
        text = str(answer)
        if self.crash_on_empty and not text.strip():
            raise RuntimeError("verifier bug: empty answer")
        return Score(float(task.prompt in text or len(text) > 10_000), {})


class LeakyEnv(ToolEnv):
    def __init__(self, crash_on_empty: bool = False, **kwargs: object) -> None:
        super().__init__(max_turns=3, **kwargs)
        self.tasks = [Task(f"t{i}", f"Which number comes after {i}?", str(i + 1)) for i in range(4)]
        self.verifier = LeakyVerifier(crash_on_empty)

    async def episode_tools(self, task: Task) -> list[FunctionTool]:
        return [
            FunctionTool(
                "lookup",
                "Look a word up.",
                {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
                fn=lambda word: f"[w1] {word[:20]}",
            ),
            FunctionTool(
                "answer",
                "Give the final answer. Ends the episode.",
                {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
                terminal=True,
            ),
        ]


def audit_accepted() -> list[Accepted]:
    """What this module's Leaky environment documents as accepted (found by ``audit_env`` through the
    registry, as an environment package's own ``audit_accepted``)."""
    return [Accepted("oversized-answer", "long answers are the task here", max_share=1.0)]


if "test/Leaky-v0" not in gymnasium.registry:
    gymnasium.register(id="test/Leaky-v0", entry_point=LeakyEnv)


def _by_name(results):
    return {r.exploit: r for r in results}


def test_a_leaky_verifier_is_found_exploit_by_exploit() -> None:
    results = _by_name(audit_env("test/Leaky-v0", n=4))
    assert set(results) == GENERIC
    assert results["prompt-copy"].share == 1.0 and results["oversized-answer"].share == 1.0
    assert results["empty-answer"].share == 0.0 and results["after-terminal"].share == 0.0
    assert results["malformed-call"].share == 0.0  # a broken call is a parse error, never an answer
    assert all(not r.errors for r in results.values())
    verdicts = {name: r.verdict for name, r in results.items()}
    assert verdicts.pop("prompt-copy") == "fail" and verdicts.pop("oversized-answer") == "accepted"
    assert set(verdicts.values()) == {"pass"}


def test_the_command_prints_one_line_per_exploit_that_does_not_pass(capsys) -> None:
    assert main(["audit-env", "test/Leaky-v0", "--n", "2", "--seed", "0"]) == 1
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("FAIL", "ACCEPTED", "audit "))]
    assert lines[0].startswith(
        "FAIL prompt-copy: 2 of 2 tasks (100%) earned more than the threshold 0.2; worst: task t"
    ) and lines[0].endswith("earned 1.000")
    assert lines[1].startswith(
        "ACCEPTED oversized-answer: 2 of 2 tasks (100%) earned more than the threshold"
    )
    assert lines[1].endswith(
        "the environment accepts it on up to 100% of tasks: long answers are the task here"
    )
    assert (
        lines[2]
        == "audit failed: 1 of 9 exploits fail (prompt-copy); 1 accepted by the environment (oversized-answer)"
    )
    assert len(lines) == 3


def test_an_accepted_exploit_above_its_share_fails_and_says_so() -> None:
    strict = [Accepted("oversized-answer", "long answers are the task here", max_share=0.5)]
    result = _by_name(audit_env("test/Leaky-v0", n=2, accepted=strict))["oversized-answer"]
    assert result.verdict == "fail"
    assert result.line().startswith("FAIL oversized-answer: 2 of 2 tasks (100%)")
    assert result.line().endswith("the environment accepts it on up to 50% of tasks, and this is more")
    only_passing = _by_name(audit_env("test/Leaky-v0", n=2, accepted=[]))  # none accepted: both fail
    assert only_passing["oversized-answer"].verdict == only_passing["prompt-copy"].verdict == "fail"


def test_an_accepted_exception_must_name_an_exploit_of_the_library() -> None:
    with pytest.raises(ConfigError, match="accepts exploits the audit does not have: every-candidat"):
        audit_env("test/Leaky-v0", n=1, accepted=[Accepted("every-candidat", "a typo")])


def test_the_worst_task_is_the_one_that_earned_the_most() -> None:
    result = _by_name(audit_env("test/Leaky-v0", n=4))["prompt-copy"]
    assert result.worst is not None and result.worst[1] == max(result.rewards) == 1.0
    assert result.worst[0] == result.task_ids[result.rewards.index(1.0)]
    assert result.to_dict()["worst_task"] == result.worst[0]


def test_an_environment_that_crashes_is_reported_per_exploit_and_the_audit_finishes(capsys) -> None:
    results = _by_name(audit_env("test/Leaky-v0", n=2, env_kwargs={"crash_on_empty": True}))
    assert len(results["empty-answer"].errors) == 2 and "verifier bug" in results["empty-answer"].errors[0]
    assert results["prompt-copy"].tasks == 2 and results["prompt-copy"].share == 1.0  # the others still ran
    assert main(["audit-env", "test/Leaky-v0", "--n", "2", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert {r["exploit"]: r["share"] for r in report["exploits"]}["prompt-copy"] == 1.0
    assert {r["exploit"]: r["verdict"] for r in report["exploits"]}["oversized-answer"] == "accepted"
    crashed = results["empty-answer"]
    assert crashed.verdict == "fail" and crashed.line().startswith(
        "FAIL empty-answer: the environment raised on 2 of 2 tasks; first: t"
    )


@pytest.mark.parametrize(
    ("env_id", "env_kwargs", "accepted"),
    [
        ("toolgym/SearchQA-v0", {"metric": "f1"}, set()),
        ("toolgym/SearchQA-v0", {}, set()),
        # searching the whole prompt and submitting the 10 results is retrieval (the task's floor), with
        # precision in the F1; the package documents it (audit_accepted) and environments.md its share
        ("toolgym/ArxivRefs-v0", {}, {"every-candidate"}),
    ],
)
def test_the_shipped_environments_pay_nothing_to_the_exploits(env_id, env_kwargs, accepted, capsys) -> None:
    results = audit_env(env_id, n=10, env_kwargs=env_kwargs)
    own = {"whole-collection", "most-cited"} if "Arxiv" in env_id else set()
    assert {r.exploit for r in results} == GENERIC | own
    assert {r.exploit for r in results if r.accepted is not None} == accepted
    for r in results:
        assert not r.errors, (r.exploit, r.errors)
        assert r.verdict != "fail", r.line()
        if r.exploit in accepted:
            assert r.share <= 0.2, r.to_dict()
        else:
            assert r.above == 0, r.to_dict()


@pytest.mark.docker
def test_code_submissions_that_try_to_fool_the_hidden_tests_earn_nothing() -> None:
    results = _by_name(audit_env("toolgym/CodeExec-v0", n=3))
    assert {"always-equal", "exit-at-import", "exit-zero-on-failure", "trusted-files"} <= set(results)
    for r in results.values():
        assert r.above == 0 and max(r.rewards) == 0.0 and not r.errors, r.to_dict()


def test_arxiv_collection_exploits_submit_what_they_claim() -> None:
    from toolgym.envs.arxiv_refs.audit import audit_exploits

    results = {r.exploit: r for r in audit_env("toolgym/ArxivRefs-v0", n=5, exploits=audit_exploits())}
    whole = results["whole-collection"]
    # every gold id is in the submission (recall 1), so each task earns a small but nonzero F1
    assert not whole.errors and whole.above == 0 and min(whole.rewards) > 0.0
    assert not results["most-cited"].errors and results["most-cited"].above == 0
