"""A corrupted search-index cache during a SearchQA evaluation, and the next run that rebuilds it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolgym.agents.harness import get_harness
from toolgym.agents.policies.base import RulePolicy
from toolgym.agents.rollout import run_episode
from toolgym.env import RetryPolicy
from toolgym.envs.search_qa import SearchQAEnv, baseline_rule

pytestmark = pytest.mark.faults

DOCS = [
    ("d1", "Kiwi", "The kiwi is a flightless bird that lives in New Zealand."),
    ("d2", "Okapi", "The okapi is a mammal of the Congo rainforest, related to the giraffe."),
    ("d3", "Quokka", "The quokka is a small marsupial found on Rottnest Island."),
    ("d4", "Axolotl", "The axolotl is a salamander that lives in lakes near Mexico City."),
]
QUESTIONS = [
    ("q1", "Which flightless bird lives in New Zealand?", "Kiwi"),
    ("q2", "Which mammal of the Congo rainforest is related to the giraffe?", "Okapi"),
    ("q3", "Which small marsupial is found on Rottnest Island?", "Quokka"),
]

# The next run: a fresh process opens the same cached index and evaluates every question.
NEXT_RUN = """
import asyncio, json, sys
from toolgym.agents.harness import get_harness
from toolgym.agents.policies.base import RulePolicy
from toolgym.agents.rollout import run_episode
from toolgym.envs.search_qa import SearchQAEnv, baseline_rule
env = SearchQAEnv(sys.argv[1], sys.argv[2], demonstration=False)
async def main():
    for task_id in sys.argv[3:]:
        t = await run_episode(env, RulePolicy(baseline_rule()), get_harness("bare"), seed=0, options={"task_id": task_id})
        print(json.dumps([t.status, t.reward]))
asyncio.run(main())
"""


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    monkeypatch.setenv("TOOLGYM_CACHE", str(tmp_path / "cache"))
    corpus, questions = tmp_path / "corpus.jsonl", tmp_path / "questions.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "title": t, "text": x}) + "\n" for i, t, x in DOCS))
    questions.write_text(
        "".join(json.dumps({"id": i, "question": q, "answers": [a]}) + "\n" for i, q, a in QUESTIONS)
    )
    return corpus, questions


async def test_an_index_corrupted_mid_run_gives_infra_errors_and_the_next_run_rebuilds_it(data, tmp_path):
    corpus, questions = data
    env = SearchQAEnv(corpus, questions, demonstration=False)
    env.retry = RetryPolicy(retries=2, backoff_s=0.05)

    async def run(task_id: str):  # type: ignore[no-untyped-def]
        policy = RulePolicy(baseline_rule())
        return await run_episode(env, policy, get_harness("bare"), seed=0, options={"task_id": task_id})

    first = await run("q1")
    assert first.status == "ok" and first.reward == 1.0

    [store] = (tmp_path / "cache" / "index").glob("default-*/docs.bin")
    store.write_bytes(b"\xff" * store.stat().st_size)  # in place: the open index sees the damage

    damaged = await run("q2")
    assert damaged.status == "infra_error" and damaged.reward == 0.0
    assert damaged.error.startswith("BackendError: the index at") and "is corrupt" in damaged.error
    assert damaged.metrics["env/infra_retries"] == 2.0  # retried, then given up: never a wrong answer

    next_run = subprocess.run(
        [sys.executable, "-c", NEXT_RUN, str(corpus), str(questions), "q1", "q2", "q3"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert next_run.returncode == 0, next_run.stderr
    assert [json.loads(line) for line in next_run.stdout.splitlines()] == [["ok", 1.0]] * 3
    assert "rebuilding it from the corpus" in next_run.stderr  # the checksum caught the damage
