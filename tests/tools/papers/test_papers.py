"""The paper store: corpus reading, de-duplication rules, ids, reference parsing, near-duplicates."""

from __future__ import annotations

import gzip
import json

import pytest

from toolgym.errors import ConfigError
from toolgym.tools.papers import (
    build_collection,
    load_papers,
    near_duplicates,
    normalise_arxiv_id,
    normalise_doi,
    parse_reference,
    render_markers,
)


def record(pid, *, title="", bib=None, body=None, date="2022-01-10", doi=None):
    """A minimal unarXive-style record; ``bib`` maps ref_id -> (raw, ids)."""
    return {
        "paper_id": pid,
        "metadata": {"title": title, "authors": "Ada Lovelace, Alan Turing", "update_date": date, "doi": doi},
        "abstract": {"text": f"Abstract of {title}."},
        "body_text": body
        or [{"section": "Related Work", "text": "We build on prior work.", "cite_spans": []}],
        "bib_entries": {ref: {"bib_entry_raw": raw, "ids": ids} for ref, (raw, ids) in (bib or {}).items()},
    }


def write(tmp_path, records, name="corpus.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def collection_of(tmp_path, records):
    return build_collection(load_papers(write(tmp_path, records)))


def test_default_corpus_counts():
    collection = build_collection(load_papers())
    counts = collection.counts()
    assert counts["papers"] == 49
    assert counts["bib_entries"] == 1786
    assert counts["full_text_records"] == 49
    assert counts["records"] == 1824
    assert counts["records"] == counts["papers"] + counts["bib_entries"] - counts["merged_away"]
    # every bibliography entry and every paper is linked to exactly one record
    assert len(collection.ref_ids) == 1786 and len(collection.paper_ids) == 49


def test_arxiv_id_normalisation():
    assert normalise_arxiv_id("arXiv:2104.06921v3") == "2104.06921"
    assert normalise_arxiv_id("https://arxiv.org/abs/2104.06921") == "2104.06921"
    assert normalise_arxiv_id("hep-ph/0511200v1") == "hep-ph/0511200"
    assert normalise_arxiv_id("not an id") is None
    assert normalise_doi("https://doi.org/10.1103/PhysRevD.50.5639.") == "10.1103/physrevd.50.5639"


def test_dedup_by_arxiv_id_across_versions_and_papers(tmp_path):
    c = collection_of(
        tmp_path,
        [
            record(
                "2201.00001",
                title="Query one",
                bib={"r1": ("A. B. Smith, Title one words here, 2020.", {"arxiv_id": "2001.01234v2"})},
            ),
            record("2201.00002", title="Query two", bib={"r9": ("Smith. Other text. arXiv:2001.01234", {})}),
        ],
    )
    assert c.ref_ids[("2201.00001", "r1")] == c.ref_ids[("2201.00002", "r9")]


def test_full_paper_and_its_citation_merge_by_arxiv_id(tmp_path):
    c = collection_of(
        tmp_path,
        [
            record("2201.00001", title="Cited paper about graphs"),
            record(
                "2201.00002",
                title="Citing",
                bib={"r1": ("X. Y. Zed, Something else entirely, 2022.", {"arxiv_id": "2201.00001v1"})},
            ),
        ],
    )
    assert c.ref_ids[("2201.00002", "r1")] == c.paper_ids["2201.00001"]
    assert c.records[c.paper_ids["2201.00001"]].full_paper == "2201.00001"


def test_dedup_by_doi(tmp_path):
    c = collection_of(
        tmp_path,
        [
            record(
                "p1",
                bib={"a": ("A. Smith, Phys. Rev. D 50, 5639 (1994).", {"doi": "10.1103/PhysRevD.50.5639"})},
            ),
            record("p2", bib={"b": ("Smith A., 1994, PRD, doi:10.1103/physrevd.50.5639", {})}),
        ],
    )
    assert c.ref_ids[("p1", "a")] == c.ref_ids[("p2", "b")]


def test_dedup_by_openalex_id(tmp_path):
    c = collection_of(
        tmp_path,
        [
            record(
                "p1",
                bib={"a": ("A. Smith, J. Foo 1, 2 (2001).", {"open_alex_id": "https://openalex.org/W123"})},
            ),
            record("p2", bib={"b": ("Smith, J. Foo (2001) 1", {"open_alex_id": "W123"})}),
            record("p3", bib={"c": ("Smith, J. Foo (2001) 1", {"open_alex_id": "W999"})}),
        ],
    )
    assert c.ref_ids[("p1", "a")] == c.ref_ids[("p2", "b")] != c.ref_ids[("p3", "c")]


def test_dedup_by_normalised_title(tmp_path):
    c = collection_of(
        tmp_path,
        [
            record(
                "p1",
                bib={
                    "a": ("Ashish Vaswani and Noam Shazeer. Attention is all you need. In NeurIPS, 2017.", {})
                },
            ),
            record("p2", bib={"b": ("A. Vaswani et al., “Attention Is All You Need,” NIPS 2017.", {})}),
        ],
    )
    assert c.ref_ids[("p1", "a")] == c.ref_ids[("p2", "b")]
    assert c.records[c.ref_ids[("p1", "a")]].title.lower() == "attention is all you need"


def test_title_never_merges_conflicting_arxiv_ids(tmp_path):
    c = collection_of(
        tmp_path,
        [
            record(
                "p1", bib={"a": ("A. Smith. A survey of graph methods. 2020.", {"arxiv_id": "2001.00001"})}
            ),
            record(
                "p2", bib={"b": ("B. Jones. A survey of graph methods. 2021.", {"arxiv_id": "2102.00002"})}
            ),
        ],
    )
    assert c.ref_ids[("p1", "a")] != c.ref_ids[("p2", "b")]


def test_collection_ids_do_not_depend_on_file_order(tmp_path):
    records = [
        record("p1", bib={"a": ("A. Smith. A survey of graph methods. 2020.", {"doi": "10.1/abc"})}),
        record("p2", bib={"b": ("B. Jones. Learning to rank documents. 2021.", {})}),
    ]
    one = collection_of(tmp_path, records)
    two = build_collection(load_papers(write(tmp_path, records[::-1], "rev.jsonl")))
    assert set(one.records) == set(two.records)
    assert one.ref_ids == two.ref_ids


def test_resolve_accepts_every_id_form(tmp_path):
    c = collection_of(tmp_path, [record("2201.00001", title="Some query paper", doi="10.5555/xyz")])
    cid = c.paper_ids["2201.00001"]
    for form in (cid, "2201.00001", "2201.00001v3", "arXiv:2201.00001", "https://doi.org/10.5555/XYZ"):
        assert c.resolve(form) == cid, form
    assert c.resolve("nonsense") is None


@pytest.mark.parametrize(
    ("line", "expect"),
    [
        ("{not json\n", ":1: not valid JSON"),
        ('{"paper_id": "x", "body_text": []}\n', ":1: record lacks 'bib_entries'"),
        ('{"paper_id": 3, "body_text": [], "bib_entries": {}}\n', ":1: 'paper_id' must be a str"),
        (
            '{"paper_id": "x", "body_text": [{"section": "A"}], "bib_entries": {}}\n',
            ":1: body_text[0] must be an object with a string 'text'",
        ),
    ],
)
def test_malformed_record_names_file_and_line(tmp_path, line, expect):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(record("ok")) + "\n\n" + line, encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_papers(path)
    assert str(path) in str(err.value)
    assert expect.replace(":1:", ":3:") in str(err.value)


def test_unreadable_corpus_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"missing\.jsonl: no such corpus file"):
        load_papers(tmp_path / "missing.jsonl")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"paper_id": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match=r"latin1\.jsonl: not UTF-8 text \(invalid continuation byte"):
        load_papers(latin1)
    not_gzip = tmp_path / "plain.jsonl.gz"
    not_gzip.write_text(json.dumps(record("p1")) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"plain\.jsonl\.gz: cannot read the corpus file \(Not a gzipped"):
        load_papers(not_gzip)
    blank = write(tmp_path, [], name="blank.jsonl")
    blank.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"blank\.jsonl: no records"):
        load_papers(blank)


def test_bad_cite_span_offsets_are_reported(tmp_path):
    bad = record(
        "p1",
        body=[{"section": "Intro", "text": "short", "cite_spans": [{"start": 2, "end": 99, "ref_id": "a"}]}],
    )
    path = write(tmp_path, [bad])
    with pytest.raises(ConfigError, match=r"corpus\.jsonl:1: body_text\[0\]: cite_span offsets"):
        load_papers(path)


def test_s2orc_cite_spans_become_markers_and_gz_is_read(tmp_path):
    text = "As shown by Smith [1], graphs help."
    rec = record(
        "p1",
        body=[
            {
                "section": "Related Work",
                "text": text,
                "cite_spans": [{"start": 18, "end": 21, "ref_id": "b1"}],
            }
        ],
    )
    path = tmp_path / "c.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.write(json.dumps(rec) + "\n")
    paper = load_papers(path)[0]
    assert paper.paragraphs[0].text == "As shown by Smith {{cite:b1}}, graphs help."


def test_render_markers_formulas_and_cite_keys():
    formulas = {"f1": ("formula", "x^2"), "f2": ("formula", "\\frac{a}{b} \\cite{smith2020} " * 10)}
    out = render_markers(
        "Let {{formula:f1}} and {{formula:f2}} in {{figure:g}} see {{cite:r}}.", formulas, cite="[C]"
    )
    assert out == "Let $x^2$ and [FORMULA] in [FIGURE] see [C]."
    assert "smith2020" not in render_markers("{{formula:f3}}", {"f3": ("formula", "a \\cite{smith2020}")})


def test_parse_reference_layouts():
    quoted = parse_reference(
        "N. Platt, L. Sirovich, and N. Fitzmaurice, “An investigation of chaotic Kolmogorov flows,” Physics of Fluids 3, 681 (1991)."
    )
    assert quoted.title == "An investigation of chaotic Kolmogorov flows"
    assert quoted.authors[0] == "N. Platt" and quoted.year == 1991
    cs = parse_reference(
        "Alesia Chernikova and Alina Oprea. Fence: Feasible evasion attacks on neural networks. ACM TOPS, 25(4):1–34, 2022."
    )
    assert cs.title == "Fence: Feasible evasion attacks on neural networks"
    assert cs.authors == ("Alesia Chernikova", "Alina Oprea")
    physics = parse_reference("J. P. Perdew, K. Burke, and M. Ernzerhof, Phys. Rev. Lett. 77, 3865 (1996).")
    assert physics.title is None and physics.year == 1996 and "J. P. Perdew" in physics.authors


def test_near_duplicates_catch_a_copied_section(tmp_path):
    words = " ".join(f"word{i}" for i in range(120))
    original = record(
        "p1",
        body=[
            {"section": "Related Work", "text": words, "cite_spans": []},
            {"section": "Method", "text": "other " * 50},
        ],
    )
    copy = record(
        "p2", title="Copy", body=[{"section": "Intro", "text": "Preface. " + words, "cite_spans": []}]
    )
    other = record(
        "p3", title="Other", body=[{"section": "Intro", "text": "unrelated text " * 40, "cite_spans": []}]
    )
    c = collection_of(tmp_path, [original, copy, other])
    dups = near_duplicates(c)
    assert dups["p1"] == {c.paper_ids["p2"]}
    assert c.paper_ids["p3"] not in dups["p1"]
