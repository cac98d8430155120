"""toolgym/ArxivRefs-v0 with ``collection=``: make paths, given fields, anti-leak, bad pairs, errors."""

from __future__ import annotations

import json

import gymnasium
import pytest

import toolgym
from toolgym.envs.arxiv_refs import ArxivRefsEnv
from toolgym.errors import ConfigError, ToolCallError

ENV_ID = "toolgym/ArxivRefs-v0"
RELATED = (
    "Shortest paths in graphs were solved by {{cite:d}}. Information is measured as in {{cite:s}}. "
    "Compilers translate arithmetic {{cite:h}}."
)


def write(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


def query(body=RELATED, bib=None):
    bib = bib or {
        "d": (
            "E. Dijkstra. A note on two problems in connexion with graphs. Numer. Math., 1959, repr. 2005.",
            {"doi": "10.1007/BF01386390"},
        ),
        "s": ("C. Shannon. A mathematical theory of communication. Bell Syst. Tech. J., 1948.", {}),
        "h": ("G. Hopper. Compiling arithmetic expressions for early computers. J. ACM, 1952.", {}),
    }
    return {
        "paper_id": "2201.00001",
        "metadata": {
            "title": "Graphs and communication",
            "authors": "Ada Lovelace",
            "update_date": "2022-01-10",
        },
        "abstract": {"text": "We revisit graphs, compilers and communication in one framework."},
        "body_text": [{"section": "Related Work", "text": body, "cite_spans": []}],
        "bib_entries": {ref: {"bib_entry_raw": raw, "ids": ids} for ref, (raw, ids) in bib.items()},
    }


RECORDS = [
    {
        "id": "W-dij",
        "title": "A Note on Two Problems in Connexion with Graphs",
        "authors": ["Edsger W. Dijkstra"],
        "year": 1959,
        "venue": "Numerische Mathematik",
        "doi": "10.1007/bf01386390",
        "ids": {"mag": "2011039300"},
    },
    {
        "id": "W-sha",
        "title": "A mathematical theory of communication",
        "date": "1948-07",
        "authors": ["Claude E. Shannon"],
    },
    {
        "id": "W-other",
        "title": "Dynamic programming for sequential decisions",
        "year": 1957,
        "abstract": "Bellman equations.",
    },
    {
        "id": "W-late",
        "title": "Graph algorithms of the future decade",
        "year": 2023,
        "abstract": "Later graphs.",
    },
    {
        "id": "W-same-year",
        "title": "Graph algorithms of the same year",
        "year": 2022,
        "abstract": "Same year graphs.",
    },
]


@pytest.fixture
def files(tmp_path):
    return write(tmp_path / "papers.jsonl", [query()]), write(tmp_path / "records.jsonl", RECORDS)


def test_gymnasium_make_and_toolgym_make_take_a_collection(files):
    corpus, records = files
    for env in (
        gymnasium.make(ENV_ID, corpus=str(corpus), collection=str(records)).unwrapped,
        toolgym.make(ENV_ID, corpus=str(corpus), collection=str(records)).unwrapped,
    ):
        assert env.stats["collection_records"] == 5 and env.stats["collection_records_linked"] == 2
        assert len(env.tasks) == 1
        env.close()


def test_linked_records_are_gold_and_shown_as_given(files):
    env = ArxivRefsEnv(files[0], collection=files[1])
    task = env.tasks[0]
    dij, sha = env.collection.resolve("W-dij"), env.collection.resolve("W-sha")
    assert dij in task.reference and sha in task.reference and len(task.reference) == 3
    page = env.read(task, "W-dij")
    assert (page.title, page.authors, page.year, page.venue) == (
        "A Note on Two Problems in Connexion with Graphs",
        ("Edsger W. Dijkstra",),
        1959,
        "Numerische Mathematik",
    )
    assert env.read(task, "W-sha").year == 1948  # given, not a year parsed from the citing string
    hits = env.search(task, "connexion graphs problems", 3)
    assert hits[0].id == dij
    unlinked = env.read(task, "W-other")
    assert unlinked.abstract == "Bellman equations." and unlinked.id == env.collection.resolve("W-other")
    env.close()


async def test_read_paper_renders_given_fields(files):
    env = ArxivRefsEnv(files[0], collection=files[1])
    task = env.tasks[0]
    tools = {t.name: t for t in await env.episode_tools(task)}
    text = await tools["read_paper"](paper_id="W-dij")
    assert "title: A Note on Two Problems in Connexion with Graphs" in text
    assert "authors: Edsger W. Dijkstra" in text and "year: 1959" in text
    assert "venue: Numerische Mathematik" in text and "mag: 2011039300" in text
    env.close()


def test_anti_leak_holds_for_collection_records(tmp_path):
    corpus = write(tmp_path / "papers.jsonl", [query()])
    copy = {
        "id": "W-copy",
        "title": "An unrelated title for a copy",
        "year": 2020,
        "abstract": RELATED.replace("{{cite:d}}", ""),
    }
    itself = {"id": "W-self", "title": "Graphs and communication revisited", "arxiv_id": "2201.00001v3"}
    env = ArxivRefsEnv(corpus, collection=write(tmp_path / "records.jsonl", [*RECORDS, copy, itself]))
    task = env.tasks[0]
    banned = env.banned_for(task)
    resolve = env.collection.resolve
    # the query paper itself (merged by arXiv id), a record copying its text, a record dated later
    assert {resolve("W-self"), resolve("W-copy"), resolve("W-late")} <= banned
    assert resolve("W-self") == env.collection.paper_ids["2201.00001"]
    # a year-only date in the query's year is not "later" at the precision both dates know
    assert resolve("W-same-year") not in banned
    for rid in ("W-self", "W-copy", "W-late"):
        with pytest.raises(ToolCallError, match="no paper"):
            env.read(task, rid)
    found = {r.id for r in env.search(task, "graph algorithms future decade shortest paths solved", 20)}
    assert not found & banned and resolve("W-same-year") in found
    env.close()


def test_a_collection_that_links_nothing_is_refused_with_counts(tmp_path):
    corpus = write(tmp_path / "papers.jsonl", [query()])
    records = write(
        tmp_path / "records.jsonl", [RECORDS[2], {"id": "x", "title": "Yet another unrelated paper"}]
    )
    with pytest.raises(ConfigError) as caught:
        ArxivRefsEnv(corpus, collection=records)
    message = str(caught.value)
    assert message.startswith(
        f"{records}: none of its 2 records is linked to any of the 3 bibliography entries"
    )
    assert "of the 1 papers of" in message


def test_missing_collection_file_is_named(files, tmp_path):
    with pytest.raises(ConfigError, match=r"absent\.jsonl: no such collection file"):
        ArxivRefsEnv(files[0], collection=tmp_path / "absent.jsonl")


def test_bad_collection_line_stops_construction(files, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(files[1].read_text() + '{"id": "W-dij", "title": "Duplicate id"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:6: duplicate id 'W-dij' \(first used at line 1\)"):
        ArxivRefsEnv(files[0], collection=bad)


def test_no_task_errors_name_the_real_cause(tmp_path):
    unlinked = write(tmp_path / "unlinked.jsonl", [query(body="Prior work {{cite:nope}} and {{cite:gone}}.")])
    with pytest.raises(ConfigError) as caught:
        ArxivRefsEnv(unlinked)
    assert "none of the 2 citation markers in the chosen contexts links to a bibliography entry" in str(
        caught.value
    )
    assert "section rule" not in str(caught.value)
    uncited = write(tmp_path / "uncited.jsonl", [query(body="No citations here at all.")])
    with pytest.raises(ConfigError, match="no paper has a cited context under the section rule"):
        ArxivRefsEnv(uncited)
    late = query(
        body="Only a later work {{cite:f}}.",
        bib={"f": ("J. Future. Results that appear only later. 2030.", {})},
    )
    with pytest.raises(
        ConfigError,
        match=r"every cited reference is hidden by the anti-leak rules \(1 linked markers, 1 cited",
    ):
        ArxivRefsEnv(write(tmp_path / "late.jsonl", [late]))


def test_training_config_env_kwargs_reach_the_collection(files, tmp_path):
    from toolgym.training.config import load_config
    from toolgym.training.sampling.workers import make_env

    corpus, records = files
    config = tmp_path / "train.toml"
    config.write_text(
        f'[env]\nid = "{ENV_ID}"\nkwargs = {{ corpus = "{corpus}", collection = "{records}", split = "all" }}\n'
    )
    cfg = load_config(config)
    env = make_env(cfg.env.id, cfg.env.kwargs).unwrapped
    assert env.stats["collection_records_linked"] == 2
    env.close()
