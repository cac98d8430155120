"""The exploit audit finds reward that can be had without the task, and the shipped environments give none.

A leaky toy environment (its verifier pays for long answers and for answers that quote the question)
shows the audit can fail; a crashing one shows an error is reported per exploit and the audit finishes.
"""

from __future__ import annotations

import json

import gymnasium
import pytest

import toolgym.envs  # noqa: F401  (registers the shipped environments)
from toolgym import FunctionTool, Score, Task, ToolEnv
from toolgym.cli import main
from toolgym.envs.audit import audit_env, generic_exploits

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


def test_an_environment_that_crashes_is_reported_per_exploit_and_the_audit_finishes(capsys) -> None:
    results = _by_name(audit_env("test/Leaky-v0", n=2, env_kwargs={"crash_on_empty": True}))
    assert len(results["empty-answer"].errors) == 2 and "verifier bug" in results["empty-answer"].errors[0]
    assert results["prompt-copy"].tasks == 2 and results["prompt-copy"].share == 1.0  # the others still ran
    assert main(["audit-env", "test/Leaky-v0", "--n", "2", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert {r["exploit"]: r["share"] for r in report["exploits"]}["prompt-copy"] == 1.0


@pytest.mark.parametrize(
    ("env_id", "env_kwargs", "accepted"),
    [
        ("toolgym/SearchQA-v0", {"metric": "f1"}, set()),
        ("toolgym/SearchQA-v0", {}, set()),
        # searching the whole prompt and submitting the 10 results is retrieval (the task's floor), with
        # precision in the F1; environments.md documents its share
        ("toolgym/ArxivRefs-v0", {}, {"every-candidate"}),
    ],
)
def test_the_shipped_environments_pay_nothing_to_the_exploits(env_id, env_kwargs, accepted, capsys) -> None:
    results = audit_env(env_id, n=10, env_kwargs=env_kwargs)
    own = {"whole-collection", "most-cited"} if "Arxiv" in env_id else set()
    assert {r.exploit for r in results} == GENERIC | own
    for r in results:
        assert not r.errors, (r.exploit, r.errors)
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
