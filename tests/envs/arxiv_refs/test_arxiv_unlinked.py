"""Citations without a record in the collection: marked (default), omitted or plain; never gold; counted."""

from __future__ import annotations

import json

import pytest

from toolgym.envs.arxiv_refs import UNLINKED_NOTE, ArxivRefsEnv, bm25_baseline, placeholder_queries
from toolgym.errors import ConfigError

# [x] and [y] have no bibliography entry: nothing in the collection can answer them.
RELATED = (
    "Shortest paths were solved by {{cite:d}}, {{cite:x}}. "
    "Entropy was defined in {{cite:x}} and in {{cite:y}}. "
    "Compilers translate arithmetic ({{cite:h}}; {{cite:y}}) as in {{cite:d}}."
)
BIB = {
    "d": "E. Dijkstra. A note on two problems in connexion with graphs. Numer. Math., 1959.",
    "h": "G. Hopper. Compiling arithmetic expressions for early computers. J. ACM, 1952.",
}


def corpus(tmp_path, related=RELATED):
    record = {
        "paper_id": "2201.00001",
        "metadata": {
            "title": "Graphs and communication",
            "authors": "Ada Lovelace",
            "update_date": "2022-01-10",
        },
        "body_text": [{"section": "Related Work", "text": related, "cite_spans": []}],
        "bib_entries": {ref: {"bib_entry_raw": raw} for ref, raw in BIB.items()},
    }
    path = tmp_path / "papers.jsonl"
    path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def path(tmp_path):
    return corpus(tmp_path)


def context(task):
    return task.prompt.split("<<<CONTEXT\n")[1].split("\nCONTEXT>>>")[0]


def test_marked_by_default_with_a_note_and_counted(path):
    env = ArxivRefsEnv(path)
    (task,) = env.tasks
    assert context(task) == (
        "Shortest paths were solved by [CITATION 1], [CITATION 2: not in the collection]. "
        "Entropy was defined in [CITATION 2: not in the collection] and in [CITATION 3: not in the collection]. "
        "Compilers translate arithmetic ([CITATION 4]; [CITATION 3: not in the collection]) as in [CITATION 1]."
    )
    assert UNLINKED_NOTE in task.prompt and task.prompt.index(UNLINKED_NOTE) < task.prompt.index("<<<CONTEXT")
    assert task.metadata["placeholders"] == 4 and task.metadata["placeholders_unlinked"] == 2
    assert env.stats["placeholders"] == 4 and env.stats["placeholders_unlinked"] == 2
    assert env.stats["markers_unlinked"] == 4 and env.stats["markers_linked"] == 3
    gold = [env.collection.ref_ids[("2201.00001", ref)] for ref in ("d", "h")]
    assert sorted(task.reference) == sorted(gold)
    assert env.verifier.score(task, gold, []).reward == 1.0  # what the collection answers is all of the gold


def test_omitted_citations_leave_no_placeholder_and_no_empty_separators(path):
    (task,) = ArxivRefsEnv(path, unlinked="omit").tasks
    assert context(task) == (
        "Shortest paths were solved by [CITATION 1]. Entropy was defined in and in. "
        "Compilers translate arithmetic ([CITATION 2]) as in [CITATION 1]."
    )
    assert UNLINKED_NOTE not in task.prompt
    assert task.metadata["placeholders"] == 2 and task.metadata["placeholders_unlinked"] == 2


def test_plain_shows_them_as_ordinary_placeholders(path):
    env = ArxivRefsEnv(path, unlinked="plain")
    (task,) = env.tasks
    assert "[CITATION 2] and in [CITATION 3]" in context(task) and "not in the collection" not in task.prompt
    assert task.metadata["placeholders"] == 4 and task.metadata["placeholders_unlinked"] == 2
    assert sorted(task.reference) == sorted(ArxivRefsEnv(path).tasks[0].reference)


def test_a_context_without_unlinked_citations_is_the_same_in_every_mode(tmp_path):
    linked = "Shortest paths {{cite:d}}. Compilers {{cite:h}}, again {{cite:d}}."
    path = corpus(tmp_path, linked)
    prompts = {mode: ArxivRefsEnv(path, unlinked=mode).tasks[0].prompt for mode in ("mark", "omit", "plain")}
    assert len(set(prompts.values())) == 1 and "[CITATION 2]" in prompts["mark"]


def test_the_shipped_tasks_have_no_unlinked_citation():
    env = ArxivRefsEnv()
    assert env.stats["placeholders_unlinked"] == 0
    assert all(t.metadata["placeholders_unlinked"] == 0 and UNLINKED_NOTE not in t.prompt for t in env.tasks)


def test_an_unknown_mode_is_refused_with_the_choices(path):
    with pytest.raises(ConfigError, match="unlinked must be one of mark, omit, plain, got 'hide'"):
        ArxivRefsEnv(path, unlinked="hide")


def test_the_baseline_searches_only_sentences_the_collection_can_answer(path):
    marked = ArxivRefsEnv(path).tasks[0]
    plain = ArxivRefsEnv(path, unlinked="plain").tasks[0]
    assert placeholder_queries(plain.prompt) == [
        "Shortest paths were solved by",
        "Entropy was defined in and in",
        "Compilers translate arithmetic as in",
    ]
    assert placeholder_queries(marked.prompt) == [
        "Shortest paths were solved by",
        "Compilers translate arithmetic as in",
    ]
    assert bm25_baseline(ArxivRefsEnv(path)).metrics["answer/submitted"] <= 4.0  # two queries, k = 2
