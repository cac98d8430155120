"""SearchQA-v0: data, tools, verifier, bring-your-own data, and bad input."""

from __future__ import annotations

import asyncio
import json

import gymnasium
import pytest

import toolgym  # noqa: F401
from toolgym.agents.harness import get_harness
from toolgym.agents.policies.base import RulePolicy, ScriptedPolicy
from toolgym.agents.rollout import run_episode
from toolgym.core import Task
from toolgym.envs.search_qa import (
    ExactMatchVerifier,
    baseline_rule,
    default_corpus,
    default_questions,
    f1_score,
    normalize_answer,
)
from toolgym.errors import ConfigError, VerifierError
from toolgym.parsing import format_tool_call

ENV_ID = "toolgym/SearchQA-v0"


def call(name, **arguments):
    return format_tool_call(name, arguments)


@pytest.fixture(scope="module")
def env():
    env = gymnasium.make(ENV_ID)
    yield env
    env.close()


def test_default_data_counts():
    corpus, questions = default_corpus(), default_questions()
    assert len(questions) == 1190
    assert sum(d["id"].startswith("xq") for d in corpus) == 240
    assert sum(d["id"].startswith("wk") for d in corpus) == 10033
    assert len({d["id"] for d in corpus}) == len(corpus)
    assert all(q.metadata["gold_doc"].startswith("xq") for q in questions)


def test_squad_normalisation_and_f1():
    assert normalize_answer("The  Denver Broncos!") == "denver broncos"
    assert f1_score("Denver Broncos", "the Denver Broncos") == 1.0
    assert f1_score("Denver", "Denver Broncos") == pytest.approx(2 / 3)
    assert f1_score("Carolina", "Denver Broncos") == 0.0


def test_verifier_em_and_f1():
    task = Task("q", "Who won?", ["Denver Broncos", "Broncos"])
    em = ExactMatchVerifier("em")
    assert em.score(task, "the Broncos", []).reward == 1.0
    partial = em.score(task, "Denver", [])
    assert partial.reward == 0.0 and partial.metrics["reward/f1"] == pytest.approx(2 / 3)
    assert ExactMatchVerifier("f1").score(task, "Denver", []).reward == pytest.approx(2 / 3)
    assert em.score(task, ["not", "a", "string"], []).metrics["answer/invalid"] == 1.0


def test_verifier_bug_is_an_error_not_reward_zero():
    with pytest.raises(VerifierError, match="no gold answers"):
        ExactMatchVerifier().score(Task("q", "?", []), "x", [])


def test_unknown_metric_says_did_you_mean():
    with pytest.raises(ConfigError, match="Did you mean 'f1'"):
        ExactMatchVerifier("f2")


def test_oracle_episode_scores_one(env):
    task = default_questions()[0]
    obs, info = env.reset(seed=0, options={"task_id": task.id})
    assert obs[-1]["content"] == task.prompt
    assert info["allowed_tools"] == ["search", "open", "answer"]
    obs, reward, terminated, truncated, _ = env.step(call("search", query=task.metadata["question"], k=5))
    assert task.metadata["gold_doc"] in obs[0]["content"]
    obs, *_ = env.step(call("open", doc_id=task.metadata["gold_doc"]))
    assert task.reference[0] in obs[0]["content"]
    obs, reward, terminated, truncated, info = env.step(call("answer", answer=task.reference[0]))
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["metrics"]["reward/em"] == 1.0 and info["metrics"]["tool/search/calls"] == 1.0


def test_search_without_k_shows_what_the_hard_set_was_built_against(env):
    from toolgym.envs.search_qa import DEFAULT_K
    from toolgym.envs.search_qa.search_results import format_results

    task = default_questions()[3]
    env.reset(seed=0, options={"task_id": task.id})
    obs, *_ = env.step(call("search", query=task.metadata["question"]))
    index = env.unwrapped.index
    expected = format_results(index, index.search(task.metadata["question"], k=DEFAULT_K))
    assert obs[0]["content"] == expected and len(expected.splitlines()) == DEFAULT_K == 3


def test_demonstration_follows_the_allowed_tools():
    env = gymnasium.make(ENV_ID)
    obs, _ = env.reset(seed=0)
    assert [m["role"] for m in obs] == ["system", "user", "assistant", "user"]
    assert '"name": "search"' in obs[2]["content"] and "Hamlet" in obs[1]["content"]
    obs, _ = env.reset(seed=0, options={"tools": []})
    assert obs[2]["content"] == call("answer", answer="William Shakespeare")
    env.close()
    plain = gymnasium.make(ENV_ID, demonstration=False)
    obs, _ = plain.reset(seed=0)
    assert [m["role"] for m in obs] == ["system", "user"]
    plain.close()


def test_answer_tag_ends_the_episode(env):
    task = default_questions()[5]
    env.reset(seed=0, options={"task_id": task.id})
    _, reward, terminated, _, _ = env.step(f"<answer>{task.reference[0]}</answer>")
    assert terminated and reward == 1.0


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        (call("search", query="   "), "Error: search: empty query: pass the words to search for"),
        (call("search", query="Denver", k=0), "Error: search: k must be between 1 and 10, got 0"),
        (call("search", query="Denver", k=11), "Error: search: k must be between 1 and 10, got 11"),
        (
            call("open", doc_id="xq9999"),
            "Error: open: no document with id 'xq9999'; use an id from the search results",
        ),
    ],
)
def test_bad_tool_input_is_an_observation(env, action, expected):
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(action)
    assert [m["content"] for m in obs] == [expected]
    assert (reward, terminated) == (0.0, False)


def test_bring_your_own_corpus_and_questions(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(
        "\n".join(
            json.dumps(d)
            for d in [
                {"id": "a", "title": "Kiwi", "text": "The kiwi is a flightless bird native to New Zealand."},
                {
                    "id": "b",
                    "title": "Emu",
                    "text": "The emu is the second-tallest living bird, found in Australia.",
                },
            ]
        )
    )
    questions = tmp_path / "qs.jsonl"
    questions.write_text(
        json.dumps({"id": "q1", "question": "Where is the kiwi native to?", "answers": ["New Zealand"]})
        + "\n"
    )
    env = gymnasium.make(ENV_ID, corpus=str(corpus), questions=str(questions))
    env.reset(seed=0)
    obs, *_ = env.step(call("search", query="kiwi bird", k=1))
    assert obs[0]["content"].startswith("[a] Kiwi:")
    _, reward, terminated, _, _ = env.step(call("answer", answer="new zealand"))
    assert terminated and reward == 1.0
    env.close()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"qs.jsonl:2: not valid JSON"),
        ('{"id": "q2", "question": "?"}', r"qs.jsonl:2: question lacks 'answers'"),
        ('["a list"]', r"qs.jsonl:2: expected a JSON object per line, got list"),
        ('{"id": "q2", "question": "?", "answers": []}', r"'answers' must be a non-empty list of strings"),
    ],
)
def test_malformed_questions_name_file_and_line(tmp_path, line, message):
    questions = tmp_path / "qs.jsonl"
    questions.write_text(json.dumps({"id": "q1", "question": "?", "answers": ["x"]}) + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=message):
        gymnasium.make(ENV_ID, questions=str(questions))


def write_questions(tmp_path, records):
    path = tmp_path / "qs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_malformed_corpus_names_file_and_line(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"id": "a", "text": "ok"}\n{"id": "b"}\n')
    questions = write_questions(tmp_path, [{"id": "q1", "question": "?", "answers": ["ok"]}])
    with pytest.raises(ConfigError, match=r"docs.jsonl:2: document lacks 'text'"):
        gymnasium.make(ENV_ID, corpus=str(corpus), questions=questions)


def test_duplicate_document_id_names_file_and_both_lines(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(
        '{"id": "a", "text": "one"}\n\n{"id": "b", "text": "two"}\n{"id": "a", "text": "three"}\n'
    )
    questions = write_questions(tmp_path, [{"id": "q1", "question": "?", "answers": ["one"]}])
    with pytest.raises(
        ConfigError, match=r"docs\.jsonl:4: duplicate document id 'a' \(first used at line 1\)"
    ):
        gymnasium.make(ENV_ID, corpus=str(corpus), questions=questions)


def test_corpus_without_questions_is_a_config_error(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"id": "a", "text": "The kiwi is a bird."}\n')
    with pytest.raises(
        ConfigError, match=r"without questions=: the built-in XQuAD questions .* Pass questions="
    ):
        gymnasium.make(ENV_ID, corpus=str(corpus))


def test_json_error_message_says_at_column_once(tmp_path):
    questions = tmp_path / "qs.jsonl"
    questions.write_text('{"id": "q1", "question": "tab\there", "answers": ["x"]}\n')
    with pytest.raises(ConfigError) as caught:
        gymnasium.make(ENV_ID, questions=str(questions))
    assert str(caught.value) == f"{questions}:1: not valid JSON (Invalid control character at column 30)"


def test_own_questions_split_by_field_then_by_gold_document(tmp_path):
    from toolgym.splits import hash_split

    records = [
        {"id": "q1", "question": "?", "answers": ["x"], "gold_doc": "a", "split": "test"},
        {"id": "q2", "question": "?", "answers": ["x"], "gold_doc": "a"},  # its group's label: test
        {"id": "q3", "question": "?", "answers": ["x"], "gold_doc": "b", "split": None},
        {"id": "q4", "question": "?", "answers": ["x"]},  # no gold document: its own group
        {"id": "q5", "question": "?", "answers": ["x"], "gold_doc": "c", "split": "train"},
    ]
    questions = write_questions(tmp_path, records)
    every = gymnasium.make(ENV_ID, questions=questions, split="all").unwrapped
    labels = {t.id: t.metadata["split"] for t in every.tasks}
    rule = {
        key: hash_split(key, namespace="SearchQA", test_fraction=0.25) for key in ("doc:b", "question:q4")
    }
    assert labels == {
        "q1": "test",
        "q2": "test",
        "q3": rule["doc:b"],
        "q4": rule["question:q4"],
        "q5": "train",
    }
    for split in ("train", "test"):
        env = gymnasium.make(ENV_ID, questions=questions, split=split).unwrapped
        assert [t.id for t in env.tasks] == [i for i, label in labels.items() if label == split]
        env.close()
    every.close()


@pytest.mark.parametrize(
    ("records", "message"),
    [
        (
            [{"id": "q1", "question": "?", "answers": ["x"], "split": "dev"}],
            r"qs\.jsonl:1: 'split' must be \"train\" or \"test\", got 'dev'",
        ),
        (
            [
                {"id": "q1", "question": "?", "answers": ["x"], "gold_doc": "a", "split": "train"},
                {"id": "q2", "question": "?", "answers": ["x"], "gold_doc": "a", "split": "test"},
            ],
            r"qs\.jsonl:2: split 'test' conflicts with split 'train' at .*qs\.jsonl:1",
        ),
        (
            [{"id": "q1", "question": "?", "answers": ["x"], "gold_doc": ["a"]}],
            r"qs\.jsonl:1: 'gold_doc' must be a document id",
        ),
    ],
)
def test_bad_split_data_names_file_and_line(tmp_path, records, message):
    with pytest.raises(ConfigError, match=message):
        gymnasium.make(ENV_ID, questions=write_questions(tmp_path, records))


def test_default_test_split_has_over_a_hundred_questions_on_unseen_paragraphs():
    questions = default_questions()
    test = [q for q in questions if q.metadata["split"] == "test"]
    train_docs = {q.metadata["gold_doc"] for q in questions if q.metadata["split"] == "train"}
    assert len(test) >= 100 and not train_docs & {q.metadata["gold_doc"] for q in test}


def test_scripted_episode_through_the_rollout_on_both_tracks():
    task = default_questions()[0]
    turns = [
        call("search", query=task.metadata["question"]),
        "<tool_call>{oops</tool_call>",
        call("answer", answer=task.reference[0]),
    ]
    results = {}
    for track in ("bare", "scaffold"):
        env = gymnasium.make(ENV_ID)
        results[track] = asyncio.run(
            run_episode(env, ScriptedPolicy(turns), get_harness(track), seed=0, options={"task_id": task.id})
        )
        env.close()
    for trajectory in results.values():
        assert trajectory.status == "ok" and trajectory.reward == 1.0
        assert trajectory.metrics["env/parse_errors"] == 1.0
    assert any("turns left" in m["content"] for m in results["scaffold"].messages)
    assert not any("turns left" in m["content"] for m in results["bare"].messages)


def test_search_baseline_runs_and_is_weak_but_real():
    env = gymnasium.make(ENV_ID)
    rewards = []
    for i, task in enumerate(default_questions()[:20]):
        trajectory = asyncio.run(
            run_episode(
                env, RulePolicy(baseline_rule()), get_harness("bare"), seed=i, options={"task_id": task.id}
            )
        )
        assert trajectory.status == "ok" and trajectory.metrics["tool/search/calls"] == 1.0
        assert task.metadata["question"] in trajectory.messages[4]["content"]
        rewards.append(trajectory.reward)
    env.close()
    assert 0.0 <= sum(rewards) < 20


async def test_reference_demonstrations_copy_only_answers_the_agent_was_shown():
    from toolgym.agents.harness import get_harness
    from toolgym.agents.policies.base import RulePolicy
    from toolgym.agents.rollout import run_episode
    from toolgym.envs.search_qa import reference_rule

    env = gymnasium.make("toolgym/SearchQA-v0", split="train", max_turns=2, metric="f1")
    rewarded = 0
    for task in env.unwrapped.tasks[:24]:
        policy = RulePolicy(reference_rule(task))
        t = await run_episode(env, policy, get_harness("bare"), seed=0, options={"task_id": task.id})
        assert t.status == "ok"
        call, results, answer = (
            t.messages[-3]["content"],
            t.messages[-2]["content"],
            t.messages[-1]["content"],
        )
        assert '"name": "search"' in call and task.metadata["question"] in call
        shown = [g for g in task.reference if g in results]
        if shown:
            assert t.reward == 1.0 and min(shown, key=len) in answer
            rewarded += 1
        else:
            assert '"unknown"' in answer and t.reward < 0.5
    assert 0 < rewarded < 24  # both cases occur in this sample
    env.close()
