"""SearchQA's hard questions: built so that searching the question itself fails and other queries work."""

from __future__ import annotations

import asyncio
import collections
import json

import gymnasium
import pytest

import toolgym  # noqa: F401
from toolgym.agents.harness import get_harness
from toolgym.agents.policies.base import RulePolicy
from toolgym.agents.rollout import run_episode
from toolgym.core import SamplingParams, Task
from toolgym.envs.search_qa import (
    build_hard_questions,
    default_questions,
    hard_questions,
    reference_rule,
    reformulating_rule,
)
from toolgym.envs.search_qa.data import data_dir
from toolgym.envs.search_qa.hard import HARD_FILE, MIN_QUESTIONS, _check_size, copy_outcome, shown_answer
from toolgym.errors import ConfigError
from toolgym.parsing import format_tool_call, format_tool_response

ENV_ID = "toolgym/SearchQA-v0"
SAMPLING = SamplingParams(max_tokens=2048)


@pytest.fixture(scope="module")
def hard_env():
    env = gymnasium.make(ENV_ID, questions="hard")
    yield env
    env.close()


def play(env, tasks, make_rule):
    async def go():
        return [
            await run_episode(
                env,
                RulePolicy(make_rule(task)),
                get_harness("bare"),
                seed=0,
                options={"task_id": task.id},
                sampling=SAMPLING,
                max_total_tokens=1 << 17,
            )
            for task in tasks
        ]

    return asyncio.run(go())


def tool_text(trajectory):
    return "\n".join(m["content"] for m in trajectory.messages if m["role"] == "tool")


def test_the_hard_set_loads_with_its_split_sizes():
    counts = {}
    for split in ("train", "test", "all"):
        env = gymnasium.make(ENV_ID, questions="hard", split=split).unwrapped
        counts[split] = len(env.tasks)
        assert all(t.metadata["split"] == split for t in env.tasks) or split == "all"
        env.close()
    assert counts == {"train": 331, "test": 122, "all": 453}
    assert counts["test"] >= MIN_QUESTIONS
    templates = collections.Counter(t.metadata["template"] for t in hard_questions())
    assert templates == {"bridge": 66, "chain": 312, "year": 75}


def test_no_test_gold_document_is_a_training_one_here_or_in_the_default_questions():
    hard = hard_questions()
    test_docs = {t.metadata["gold_doc"] for t in hard if t.metadata["split"] == "test"}
    train_docs = {t.metadata["gold_doc"] for t in hard if t.metadata["split"] == "train"}
    default_train = {t.metadata["gold_doc"] for t in default_questions() if t.metadata["split"] == "train"}
    assert test_docs and train_docs and not test_docs & train_docs
    assert not test_docs & default_train  # the bridge questions keep their paragraphs' split
    assert len({t.id for t in hard}) == len(hard)
    answers = collections.Counter(t.reference[0] for t in hard if t.metadata["template"] == "chain")
    assert max(answers.values()) == 1  # no chain answer repeats, so none crosses the split


def test_searching_the_question_itself_shows_neither_gold_document_nor_answer(hard_env):
    index = hard_env.unwrapped.index
    for task in hard_questions():
        outcome = copy_outcome(index, task.metadata["question"], task.reference, task.metadata["gold_doc"])
        assert outcome.fails, (task.id, outcome)


def test_the_copy_rule_fails_on_the_hard_set_through_the_environment(hard_env):
    tasks = list(hard_env.unwrapped.tasks)
    trajectories = play(hard_env, tasks, reference_rule)
    for task, trajectory in zip(tasks, trajectories, strict=True):
        assert trajectory.status == "ok" and trajectory.metrics["tool/search/calls"] == 1.0
        assert f"[{task.metadata['gold_doc']}]" not in tool_text(trajectory)
        assert shown_answer(tool_text(trajectory), task.reference) is None
    # The copy rule matches gold strings inside longer words ("Brazil" in "Brazilian"): 4 such lucky hits.
    assert sum(t.reward for t in trajectories) == 4.0
    # the environment's tool-use measures say the same on every episode (toolgym.tool_use)
    for trajectory in trajectories:
        m = trajectory.metrics
        assert (m["use/searches"], m["use/query_overlap"], m["use/reformulated"]) == (1.0, 1.0, 0.0)
        assert m["use/answer_shown"] == 0.0 and m["use/first_search_turn"] == 1.0 and m["use/opened"] == 0.0


def test_the_reformulating_rule_solves_every_hard_question(hard_env):
    tasks = list(hard_env.unwrapped.tasks)
    trajectories = play(hard_env, tasks, reformulating_rule)
    assert [t.reward for t in trajectories] == [1.0] * len(tasks)
    for task, trajectory in zip(tasks, trajectories, strict=True):
        searched = [m["content"] for m in trajectory.messages[4:] if '"name": "search"' in m["content"]]
        assert searched and any(task.metadata["question"] not in call for call in searched)
        # measured by the environment: it searched with other words and was shown the answer
        m = trajectory.metrics
        assert (
            m["use/reformulated"] == 1.0
            and m["use/answer_shown"] == 1.0
            and m["use/answer_in_results"] == 1.0
        )
        assert m["use/query_overlap"] < 1.0 and m["use/searches"] == len(searched)


def test_the_reformulating_rule_searches_a_name_only_after_a_result_showed_it():
    task = Task(
        "q",
        "Question: Who founded the city named in the article on Foo?",
        ["Romulus"],
        {"question": "Who founded the city named in the article on Foo?", "hops": ["Foo", "Rome founder"]},
    )
    task = Task(task.id, task.prompt, task.reference, {**task.metadata, "bridge": "Rome", "gold_doc": "d1"})
    rule = reformulating_rule(task)
    first = rule(task.prompt)
    assert first == format_tool_call("search", {"query": "Foo", "k": 3})
    no_name = task.prompt + format_tool_response("[d9] Foo: a town in Italy.")
    assert rule(no_name) == format_tool_call("answer", {"answer": "unknown"})
    named = task.prompt + format_tool_response("[d9] Foo: a town near Rome.")
    assert rule(named) == format_tool_call("search", {"query": "Rome founder", "k": 3})
    shown = named + format_tool_response("[d1] Rome: founded, as told, by Romulus.")
    assert rule(shown) == format_tool_call("answer", {"answer": "Romulus"})
    behind = named + format_tool_response("[d1] Rome: the capital of Italy...")
    assert rule(behind) == format_tool_call("open", {"doc_id": "d1"})


def test_shown_answer_reads_whole_words_across_dashes():
    assert shown_answer("the 1890–1911 style", ["1890"]) == "1890"
    assert shown_answer("The Brazilian states", ["Brazil"]) is None
    assert shown_answer("in the Rhine delta", ["Rhine", "the Rhine delta"]) == "Rhine"
    assert shown_answer("nothing here", ["Rhine"]) is None


@pytest.mark.slow
def test_the_shipped_file_equals_a_fresh_build():
    shipped = [json.loads(line) for line in (data_dir() / HARD_FILE).read_text(encoding="utf-8").splitlines()]
    assert build_hard_questions() == shipped


def test_a_build_below_the_minimum_is_refused_naming_its_counts():
    records = [json.loads(line) for line in (data_dir() / HARD_FILE).read_text(encoding="utf-8").splitlines()]
    _check_size(records, 122)  # the test split has exactly 122
    with pytest.raises(
        ConfigError,
        match=r"train 331, test 122 questions \(bridge 66, chain 312, year 75\): "
        r"test below the minimum of 123",
    ):
        _check_size(records, 123)


def test_selecting_copy_failures_of_the_xquad_questions_is_refused_as_too_few():
    with pytest.raises(ConfigError) as caught:
        gymnasium.make(ENV_ID, select="copy-fails")
    message = str(caught.value)
    assert (
        "select='copy-fails' keeps 22 questions in split 'all' (train 18, test 4, of 1190 questions)"
        in message
    )
    assert "fewer than the 100 needed" in message
    assert "1132 because the question itself shows the gold document" in message
    assert "use questions='hard'" in message


def test_selecting_copy_failures_of_the_hard_set_keeps_every_question():
    env = gymnasium.make(ENV_ID, questions="hard", select="copy-fails", split="test").unwrapped
    assert len(env.tasks) == 122
    env.close()


def test_select_needs_gold_documents(tmp_path):
    path = tmp_path / "qs.jsonl"
    path.write_text(
        json.dumps({"id": "q1", "question": "Where is the kiwi from?", "answers": ["New Zealand"]}) + "\n"
    )
    with pytest.raises(
        ConfigError, match=r"needs each question's gold document: 1 questions have no 'gold_doc'"
    ):
        gymnasium.make(ENV_ID, questions=str(path), select="copy-fails")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"questions": "hrad"},
            r"questions='hrad' is neither a built-in question set nor a file\. Did you mean 'hard'",
        ),
        ({"select": "copy-fail"}, r"unknown select 'copy-fail'\. Did you mean 'copy-fails'"),
    ],
)
def test_misspelt_set_or_selection_says_did_you_mean(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        gymnasium.make(ENV_ID, **kwargs)


def test_a_built_in_set_with_another_corpus_is_refused(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"id": "a", "text": "The kiwi is a bird."}\n')
    with pytest.raises(
        ConfigError, match=r"with questions='hard': the built-in question set is about the built-in"
    ):
        gymnasium.make(ENV_ID, corpus=str(corpus), questions="hard")
