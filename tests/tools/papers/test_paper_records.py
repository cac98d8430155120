"""Collection records (``collection=``): reading, bad input, linking, given fields, scalable leak rules."""

from __future__ import annotations

import json
import random

import pytest

from toolgym.envs.arxiv_refs.leakage import _later, _LaterIndex
from toolgym.errors import ConfigError
from toolgym.tools.papers import (
    build_collection,
    load_papers,
    load_records,
    near_duplicates,
    parse_date,
    shingles,
)


def write(tmp_path, lines, name="records.jsonl"):
    path = tmp_path / name
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def rec(rid, title="A study of graph shortest path algorithms", **fields):
    return {"id": rid, "title": title, **fields}


def paper(pid, bib, *, body="We build on prior work {{cite:b1}}.", date="2022-01-10"):
    return {
        "paper_id": pid,
        "metadata": {
            "title": f"Query paper {pid} about graphs",
            "authors": "Ada Lovelace",
            "update_date": date,
        },
        "abstract": {"text": "An abstract."},
        "body_text": [{"section": "Related Work", "text": body, "cite_spans": []}],
        "bib_entries": {ref: {"bib_entry_raw": raw, "ids": ids} for ref, (raw, ids) in bib.items()},
    }


# ----------------------------------------------------------------------------- reading and bad input


def test_fields_are_read_as_given(tmp_path):
    path = write(
        tmp_path,
        [
            rec(
                "r1",
                title="  Deep  Residual Learning ",
                abstract="Residual nets.",
                authors=["He, Kaiming", "Zhang, Xiangyu"],
                year=2016,
                venue="CVPR",
                ids={"doi": "https://doi.org/10.1109/CVPR.2016.90", "pmid": "123"},
                arxiv_id="arXiv:1512.03385v1",
            ),
            rec("r2", date="2019"),
            rec("r3", date="2019-07"),
            rec("r4", date="2019-07-03", open_alex_id="https://openalex.org/W42"),
        ],
    )
    r1, r2, r3, r4 = load_records(path)
    assert (r1.record_id, r1.title, r1.authors, r1.venue) == (
        "r1",
        "Deep Residual Learning",
        ("He, Kaiming", "Zhang, Xiangyu"),  # a list: never split again
        "CVPR",
    )
    assert (r1.date, r1.arxiv_id, r1.doi, r1.other_ids) == (
        (2016, 0, 0),
        "1512.03385",
        "10.1109/cvpr.2016.90",
        (("pmid", "123"),),
    )
    assert [r2.date, r3.date, r4.date] == [(2019, 0, 0), (2019, 7, 0), (2019, 7, 3)]
    assert r4.openalex_id == "W42"


@pytest.mark.parametrize(
    ("line", "expect"),
    [
        ({"title": "No id here at all"}, r"records\.jsonl:2: collection record lacks 'id'"),
        ({"id": "", "title": "Empty id here"}, r"records\.jsonl:2: collection record lacks 'id'"),
        ({"id": "x"}, r"records\.jsonl:2: collection record 'x' lacks 'title'"),
        ({"id": "x", "title": "  "}, r"records\.jsonl:2: collection record 'x' lacks 'title'"),
        (rec("x", date="March 2020"), r"records\.jsonl:2: unknown date format 'March 2020' \(use YYYY"),
        (rec("x", date="2020/03/01"), r"records\.jsonl:2: unknown date format '2020/03/01'"),
        (rec("x", date="2020-13"), r"records\.jsonl:2: date '2020-13' is not a valid date"),
        (rec("x", year="20"), r"records\.jsonl:2: unknown year format '20'"),
        (rec("x", year=2020, date="2019-01"), r"records\.jsonl:2: 'year' 2020 disagrees with 'date'"),
        (rec("x", authors="Ada Lovelace, Alan Turing"), r"records\.jsonl:2: 'authors' must be a list"),
        (rec("x", doi="not-a-doi"), r"records\.jsonl:2: doi 'not-a-doi' is not a DOI"),
        (rec("x", ids=["10.1/x"]), r"records\.jsonl:2: 'ids' must be an object"),
        ("[1, 2]", r"records\.jsonl:2: expected a JSON object per line, got list"),
        ('{"id": "x", ', r"records\.jsonl:2: not valid JSON"),
    ],
)
def test_bad_record_names_file_and_line(tmp_path, line, expect):
    path = write(tmp_path, [rec("ok"), line])
    with pytest.raises(ConfigError, match=expect):
        load_records(path)


def test_duplicate_ids_name_both_lines(tmp_path):
    path = write(tmp_path, [rec("a"), rec("b"), "", rec("a", title="Another title of three words")])
    with pytest.raises(ConfigError, match=r"records\.jsonl:4: duplicate id 'a' \(first used at line 1\)"):
        load_records(path)


def test_missing_and_empty_collection_files(tmp_path):
    with pytest.raises(ConfigError, match="no such collection file"):
        load_records(tmp_path / "absent.jsonl")
    with pytest.raises(ConfigError, match=r"empty\.jsonl: no records in the collection file"):
        load_records(write(tmp_path, ["", "  "], name="empty.jsonl"))


@pytest.mark.parametrize(
    ("bad", "expect"), [('{"id": "b", "title"', "not valid JSON"), ('{"id": "b"}', "lacks 'title'")]
)
def test_one_bad_line_of_a_long_file_is_reported_by_line_number(tmp_path, bad, expect):
    lines = [json.dumps(rec(f"r{i}", title=f"Paper number {i} on graphs")) for i in range(100_000)]
    lines[73_210] = bad
    path = write(tmp_path, lines)
    with pytest.raises(ConfigError) as caught:
        load_records(path)
    assert "records.jsonl:73211: " in str(caught.value) and expect in str(caught.value)


def test_parse_date_forms():
    assert parse_date("1999", "f:1") == (1999, 0, 0)
    assert parse_date(2004, "f:1") == (2004, 0, 0)
    assert parse_date(" 2004-02-29 ", "f:1") == (2004, 2, 29)
    with pytest.raises(ConfigError, match=r"f:1: unknown date format '04-02-2004'"):
        parse_date("04-02-2004", "f:1")
    with pytest.raises(ConfigError, match=r"f:1: 'date' must be a string or an integer year"):
        parse_date(2004.5, "f:1")


def test_year_only_corpus_dates_are_accepted(tmp_path):
    path = write(tmp_path, [paper("2201.00001", {}, date="2022"), paper("2201.00002", {}, date="2022-03")])
    assert [p.date for p in load_papers(path)] == [(2022, 0, 0), (2022, 3, 0)]


# ----------------------------------------------------------------------------- linking and display


def test_records_link_by_id_then_title_and_show_given_fields(tmp_path):
    bib = {
        "b1": (
            "E. Dijkstra. A note on two problems in connexion with graphs. Numer. Math. 1, 269-271, 1959.",
            {"doi": "10.1007/BF01386390"},
        ),
        "b2": ("C. Shannon. A mathematical theory of communication. Bell 27, 1948, reprinted 2001.", {}),
        "b3": ("Someone. An entirely unrelated paper title. 2001.", {}),
    }
    corpus = write(tmp_path, [paper("2201.00001", bib)], name="papers.jsonl")
    records = write(
        tmp_path,
        [
            rec(
                "dij",
                title="A Note on Two Problems in Connexion with Graphs (journal version)",
                doi="10.1007/bf01386390",
                year=1959,
                authors=["E. W. Dijkstra"],
                venue="Numerische Mathematik",
            ),
            rec(
                "sha",
                title="A Mathematical Theory of Communication",
                date="1948-07",
                authors=["C. E. Shannon"],
            ),
            rec("solo", title="A record no paper cites", year=2020, abstract="Only in the collection."),
        ],
    )
    c = build_collection(load_papers(corpus), load_records(records))
    dij = c.records[c.ref_ids[("2201.00001", "b1")]]
    sha = c.records[c.ref_ids[("2201.00001", "b2")]]
    # by DOI although the titles differ; the given title, authors, year and venue are what is shown
    assert (dij.title, dij.authors, dij.year, dij.venue, dij.record_ids) == (
        "A Note on Two Problems in Connexion with Graphs (journal version)",
        ("E. W. Dijkstra",),
        1959,
        "Numerische Mathematik",
        ("dij",),
    )
    # by normalised title; the year is the given 1948, not the last year-like number of the string (2001)
    assert (sha.title, sha.year, sha.date, sha.record_ids) == (
        "A Mathematical Theory of Communication",
        1948,
        (1948, 7, 0),
        ("sha",),
    )
    assert c.records[c.ref_ids[("2201.00001", "b3")]].record_ids == ()
    solo = c.resolve("solo")
    assert solo is not None and c.records[solo].abstract == "Only in the collection."
    assert c.resolve(dij.id) == c.resolve("dij") == c.resolve("doi:10.1007/BF01386390") == dij.id
    counts = c.counts()
    assert (counts["collection_records"], counts["collection_records_linked"]) == (3, 2)
    assert counts["bib_entries_linked_to_collection"] == 2
    assert counts["records"] == counts["papers"] + counts["bib_entries"] + 3 - counts["merged_away"]


def test_collection_ids_do_not_depend_on_record_order(tmp_path):
    corpus = load_papers(write(tmp_path, [paper("2201.00001", {})], name="papers.jsonl"))
    lines = [
        rec("a", title="Alpha beta gamma"),
        rec("b", title="Tiny"),
        rec("c", title="Delta epsilon zeta", doi="10.1234/c"),
    ]
    one = build_collection(corpus, load_records(write(tmp_path, lines, "one.jsonl")))
    two = build_collection(corpus, load_records(write(tmp_path, lines[::-1], "two.jsonl")))
    assert sorted(one.records) == sorted(two.records)
    assert one.aliases == two.aliases and len(one.records) == 4


# ----------------------------------------------------------------------------- sub-quadratic leak rules


def _all_pairs(collection, threshold=0.3):
    """The all-pairs near-duplicate rule the inverted/prefiltered one replaced (reference)."""
    docs = {
        r.id: shingles(r.abstract + "\n" + r.text)
        for r in collection.records.values()
        if r.text or r.abstract
    }
    out = {}
    for source in collection.papers:
        own = collection.paper_ids[source.paper_id]
        query = shingles(source.abstract + "\n" + "\n".join(p.text for p in source.paragraphs))
        out[source.paper_id] = {
            cid
            for cid, doc in docs.items()
            if cid != own and doc and query and len(doc & query) / min(len(doc), len(query)) >= threshold
        }
    return out


def test_near_duplicates_equal_the_all_pairs_rule(tmp_path):
    rng = random.Random(7)
    vocab = [f"w{i}" for i in range(60)]
    texts = [" ".join(rng.choice(vocab) for _ in range(80)) for _ in range(6)]
    papers = [paper(f"2201.0000{i}", {}, body=t + " {{cite:b1}}") for i, t in enumerate(texts)]
    lines = []
    for i in range(300):
        src = texts[i % 6].split()
        start, size = rng.randrange(60), rng.choice([4, 12, 30, 80])
        copied = src[start : start + size]
        noise = [rng.choice(vocab) for _ in range(rng.choice([0, 10, 100]))]
        lines.append(rec(f"r{i}", title=f"Record {i} of the test", abstract=" ".join(copied + noise)))
    c = build_collection(
        load_papers(write(tmp_path, papers, "p.jsonl")), load_records(write(tmp_path, lines))
    )
    for threshold in (0.05, 0.3, 1.0):
        fast = near_duplicates(c, threshold=threshold)
        assert fast == _all_pairs(c, threshold)
    assert sum(map(len, near_duplicates(c).values())) > 0  # the test exercises real copies


def test_later_index_equals_the_pairwise_date_rule():
    rng = random.Random(3)

    def date():
        y = rng.choice([0, 2019, 2020, 2021])
        m = rng.choice([0, 1, 6, 12])
        return None if rng.random() < 0.1 else (y, m, rng.choice([0, 1, 15]) if m else 0)

    dated = [(f"r{i}", date()) for i in range(400)]
    index = _LaterIndex(dated)
    for _ in range(200):
        limit = date()
        assert index.after(limit) == {cid for cid, d in dated if _later(d, limit)}, limit
