"""The default backend's pieces: the pruning kernel against an exhaustive scorer, the build (parallel,
spilled, byte-identical either way), the Porter stemmer, string tables, Anserini's displayed scores and
the checksum stamps that make opening an index O(1)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import pytest

from toolgym import file_table
from toolgym.errors import BackendError
from toolgym.tools.search import bm25_build, bm25_workers, index_files
from toolgym.tools.search.bm25 import anserini_display, lucene_norm_cache
from toolgym.tools.search.bm25_search import BM25Ranker, exhaustive_top_k
from toolgym.tools.search.index import Index, load_index
from toolgym.tools.search.index_build import build_index
from toolgym.tools.search.porter import porter_stem
from toolgym.tools.search.string_table import StringTable, write_string_table


@pytest.fixture(scope="module")
def docs() -> list[dict[str, str]]:
    from toolgym.envs.search_qa import default_corpus

    return default_corpus()


@pytest.fixture(scope="module")
def index(docs, tmp_path_factory) -> Index:
    return build_index(docs, path=tmp_path_factory.mktemp("bm25") / "ix")


@pytest.fixture(scope="module")
def big_index(docs, tmp_path_factory) -> Index:
    """41,092 documents (the corpus, then three shuffled, trimmed copies): more than one of the
    kernel's 16,384-document windows, so terms become non-essential and presence maps are read."""
    corpus = []
    for copy in range(4):
        rng = random.Random(copy)
        for doc in docs:
            words = doc["text"].split()
            if copy:
                rng.shuffle(words)
                words = words[: max(1, len(words) * 2 // 3)]
            corpus.append({"id": f"{doc['id']}~{copy}", "title": doc["title"], "text": " ".join(words)})
    return build_index(corpus, path=tmp_path_factory.mktemp("bm25big") / "ix")


def _ranker(index: Index) -> BM25Ranker:
    return index._ranker  # type: ignore[return-value]  # noqa: SLF001 -- the default backend's ranker


def _random_queries(ranker: BM25Ranker, n: int, seed: int) -> list[str]:
    """Queries of 1-12 terms drawn from the vocabulary (common and rare alike), some repeated."""
    rng = random.Random(seed)
    df = np.diff(ranker.arrays["indptr"])
    common = [int(t) for t in np.argsort(df)[-300:]]
    terms = ranker._terms  # noqa: SLF001
    queries = []
    for _ in range(n):
        picks = [
            rng.choice(common) if rng.random() < 0.5 else rng.randrange(len(df))
            for _ in range(rng.randint(1, 12))
        ]
        words = [terms.get(t) for t in picks]
        if rng.random() < 0.3:
            words += words[: rng.randint(1, len(words))]  # repeated terms: Anserini's boosts
        queries.append(" ".join(words))
    return queries


# ------------------------------------------------------------------------------------ kernel vs exhaustive


@pytest.mark.parametrize("k", [1, 3, 10, 57, 1000])
@pytest.mark.parametrize("which", ["index", "big_index"])
def test_pruned_search_equals_exhaustive_scoring(which: str, k: int, request: pytest.FixtureRequest) -> None:
    ranker = _ranker(request.getfixturevalue(which))
    queries = _random_queries(ranker, 150, seed=k)
    differ = [q for q in queries if ranker.top_k(q, k) != exhaustive_top_k(ranker, q, k)]
    assert differ == []


def test_ties_are_broken_by_external_id(tmp_path) -> None:
    # 40 identical documents under shuffled ids: equal scores, so the order is the ids' order.
    ids = [f"doc-{i:03d}" for i in range(40)]
    random.Random(0).shuffle(ids)
    corpus = [{"id": i, "title": "", "text": "alpha beta gamma"} for i in ids]
    corpus += [{"id": f"other-{i}", "title": "", "text": f"alpha filler{i} words here"} for i in range(50)]
    ix = build_index(corpus, path=tmp_path / "ix")
    hits = ix.search("alpha beta", k=10)
    assert [h.doc_id for h in hits] == sorted(ids)[:10]
    ranker = _ranker(ix)
    assert ranker.top_k("alpha beta", 25) == exhaustive_top_k(ranker, "alpha beta", 25)
    # Anserini shows equal scores nudged apart by 1e-6 per tie.
    assert [round(h.score, 6) for h in hits[:3]] == [
        round(hits[0].score, 6),
        round(hits[0].score - 1e-6, 6),
        round(hits[0].score - 2e-6, 6),
    ]


def test_kernel_refuses_bad_calls_and_inconsistent_arrays(index: Index) -> None:
    from toolgym.tools.search._bm25kernel import Ranker

    ranker = _ranker(index)
    kernel = ranker._kernel  # noqa: SLF001
    with pytest.raises(IndexError, match="out of range"):
        kernel.search(np.array([10**9], np.int64).tobytes(), np.array([1], np.float32).tobytes(), 5)
    with pytest.raises(ValueError, match="k >= 1"):
        kernel.search(np.array([0], np.int64).tobytes(), np.array([1], np.float32).tobytes(), 0)
    with pytest.raises(ValueError, match="k >= 1"):
        kernel.search(np.array([0, 1], np.int64).tobytes(), np.array([1], np.float32).tobytes(), 5)
    arrays = dict(ranker.arrays)
    arrays["blockptr"] = arrays["blockptr"][:-1]
    with pytest.raises(ValueError, match="inconsistent array sizes"):
        Ranker(**arrays, block=bm25_build.BLOCK)
    arrays = dict(ranker.arrays)
    arrays["blockptr"] = np.ascontiguousarray(arrays["blockptr"] * 2)
    with pytest.raises(ValueError, match="term offsets do not span the postings"):
        Ranker(**arrays, block=bm25_build.BLOCK)
    with pytest.raises(RuntimeError, match="initialised once"):
        kernel.__init__(**ranker.arrays, block=bm25_build.BLOCK)


def test_corrupt_postings_are_an_error_not_a_crash(docs, tmp_path) -> None:
    # Arrays that pass the structural checks but hold garbage (what a checksum-clean index built by a
    # buggy writer would hold): every search raises ValueError or answers; the process never crashes.
    ix = build_index(docs[:300], path=tmp_path / "ix")
    from toolgym.tools.search._bm25kernel import Ranker

    arrays = {name: np.array(a) for name, a in _ranker(ix).arrays.items()}
    n_terms = len(arrays["idf"])
    beyond = dict(arrays, blockbase=np.full_like(arrays["blockbase"], 10**8))  # every id past the end
    kernel = Ranker(**beyond, block=bm25_build.BLOCK)
    with pytest.raises(ValueError, match="a document beyond the collection or out of order"):
        kernel.search(
            np.arange(n_terms, dtype=np.int64).tobytes(), np.ones(n_terms, np.float32).tobytes(), 10
        )
    rng = np.random.default_rng(0)
    garbage = dict(arrays, docbytes=rng.integers(0, 256, len(arrays["docbytes"]), dtype=np.uint8))
    garbage["tfs"] = rng.integers(0, 256, len(arrays["tfs"]), dtype=np.uint8)
    kernel = Ranker(**garbage, block=bm25_build.BLOCK)
    outcomes = set()
    for tid in range(0, n_terms, 7):
        tids = np.array([tid, (tid * 31 + 1) % n_terms], np.int64)
        tids = np.unique(tids)
        try:
            found = kernel.search(tids.tobytes(), np.ones(len(tids), np.float32).tobytes(), 10)
            outcomes.add("answered" if isinstance(found, list) else "?")
        except ValueError:
            outcomes.add("refused")
    assert outcomes <= {"answered", "refused"} and "refused" in outcomes


def test_presence_maps_cover_every_posting_at_the_documented_resolution(index: Index) -> None:
    ranker = _ranker(index)
    a = ranker.arrays
    df = np.diff(a["indptr"])
    n_docs = len(a["norms"])
    words = np.diff(a["presptr"])
    mapped = np.flatnonzero(words)
    want = (df >= bm25_build.PRESENCE_MIN_DF) & (df * 1024 >= n_docs)
    assert np.array_equal(words > 0, want) and len(mapped) > 100
    shifts = a["presshift"][mapped].astype(np.int64)
    need = bm25_build.PRESENCE_BITS * df[mapped]
    assert set(shifts.tolist()) >= {0, 1, 2}  # exact maps and coarse ones
    assert np.all((shifts == 0) | ((need << shifts) <= n_docs)) and np.all((need << (shifts + 1)) > n_docs)
    assert np.array_equal(words[mapped], (((n_docs - 1) >> shifts) >> 6) + 1)
    for t in mapped[:: max(1, len(mapped) // 200)]:
        groups = ranker.term_docs(int(t)) >> int(a["presshift"][t])
        bits = np.unpackbits(
            a["presence"][a["presptr"][t] : a["presptr"][t + 1]].view(np.uint8), bitorder="little"
        )
        assert np.array_equal(np.flatnonzero(bits), np.unique(groups))  # set exactly where the term occurs


def test_term_data_is_read_only_for_the_terms_searched(index: Index) -> None:
    ranker = BM25Ranker(index.path)  # a fresh one: nothing read yet
    lazy, a = ranker._parts.arrays, ranker.arrays  # noqa: SLF001
    assert not any(part.any() for part in lazy.values())
    query = "the history of the city and its people in the world"
    tids, _ = ranker.query_terms(query)
    assert ranker.top_k(query, 10) == exhaustive_top_k(ranker, query, 10)
    bounds = {
        "docbytes": a["blockoff"][a["blockptr"]],
        "tfs": a["indptr"],
        "presence": a["presptr"],
    }
    searched = set(tids.tolist())
    assert any(a["presptr"][t + 1] > a["presptr"][t] for t in searched)  # some maps are involved
    for name, bound in bounds.items():
        for t in range(0, len(a["idf"]), 97):
            part = slice(int(bound[t]), int(bound[t + 1]))
            expected = a[name][part] if t in searched else np.zeros_like(a[name][part])
            assert np.array_equal(lazy[name][part], expected), (name, t)
        for t in searched:
            part = slice(int(bound[t]), int(bound[t + 1]))
            assert np.array_equal(lazy[name][part], a[name][part]), (name, t)


def test_the_kernel_consults_the_presence_maps(big_index: Index) -> None:
    from toolgym.tools.search._bm25kernel import Ranker

    # Cleared maps say "absent" everywhere: the frequent terms' scores go missing, so the kernel does
    # consult them (and wrong maps would be caught by the comparisons with exhaustive scoring).
    ranker = _ranker(big_index)
    blank = dict(ranker.arrays, presence=np.zeros_like(ranker.arrays["presence"]))
    kernel = Ranker(**blank, block=bm25_build.BLOCK)
    wrong = 0
    for q in _random_queries(ranker, 100, seed=5):
        t, b = ranker.query_terms(q)
        if len(t):
            wrong += kernel.search(t.tobytes(), b.tobytes(), 10) != exhaustive_top_k(ranker, q, 10)
    assert wrong > 10


def _exact_with(ranker: BM25Ranker, arrays: dict[str, np.ndarray], queries: list[str]) -> None:
    from toolgym.tools.search._bm25kernel import Ranker

    kernel = Ranker(**arrays, block=bm25_build.BLOCK)
    for q in queries:
        t, b = ranker.query_terms(q)
        if len(t):
            for k in (10, 100):
                assert kernel.search(t.tobytes(), b.tobytes(), k) == exhaustive_top_k(ranker, q, k), (q, k)


def test_maps_that_say_maybe_everywhere_give_the_same_answer(big_index: Index) -> None:
    # Every bit set: no candidate is dropped by a map, each set bit leads to a seek (a false alarm
    # for most documents), and the answers stay exact.
    ranker = _ranker(big_index)
    full = dict(ranker.arrays, presence=np.full_like(ranker.arrays["presence"], np.iinfo(np.uint64).max))
    _exact_with(ranker, full, _random_queries(ranker, 60, seed=9))


def test_maps_on_any_subset_of_the_terms_give_the_same_answer(big_index: Index) -> None:
    # Terms without a map between terms with one: the filter adds their bounds untested and the exact
    # step looks them up in their postings.
    ranker = _ranker(big_index)
    a = ranker.arrays
    words = np.diff(a["presptr"])
    keep = (np.random.default_rng(4).random(len(words)) < 0.5) & (words > 0)
    kept = [a["presence"][a["presptr"][t] : a["presptr"][t + 1]] for t in np.flatnonzero(keep)]
    presptr = np.zeros_like(a["presptr"])
    np.cumsum(np.where(keep, words, 0), out=presptr[1:])
    some = dict(a, presence=np.concatenate(kept), presptr=presptr)
    assert 0 < keep.sum() < (words > 0).sum()
    _exact_with(ranker, some, _random_queries(ranker, 60, seed=11))


def test_kernel_refuses_inconsistent_presence_maps(index: Index) -> None:
    from toolgym.tools.search._bm25kernel import Ranker

    arrays = dict(_ranker(index).arrays)
    with pytest.raises(ValueError, match="presence offsets do not span"):
        Ranker(**(arrays | {"presence": arrays["presence"][:-1]}), block=bm25_build.BLOCK)
    shift = np.array(arrays["presshift"])
    t = int(np.flatnonzero(np.diff(arrays["presptr"]))[0])
    shift[t] += 1
    with pytest.raises(ValueError, match=f"term {t}: a presence map of"):
        Ranker(**(arrays | {"presshift": shift}), block=bm25_build.BLOCK)


# ------------------------------------------------------------------------------------------------ build


def _file_hashes(path: Path) -> dict[str, str]:
    manifest = json.loads((path / "manifest.json").read_text())
    return {name: meta["sha256"] for name, meta in manifest["files"].items()}


def test_parallel_and_spilled_builds_are_byte_identical(docs, tmp_path, monkeypatch) -> None:
    corpus = docs[:5000]
    monkeypatch.setenv("TOOLGYM_INDEX_WORKERS", "1")
    serial = build_index(corpus, path=tmp_path / "serial")
    monkeypatch.setenv("TOOLGYM_INDEX_WORKERS", "2")
    parallel = build_index(corpus, path=tmp_path / "parallel")
    monkeypatch.setenv("TOOLGYM_INDEX_WORKERS", "1")
    # Many small runs and merge ranges: the multi-run merge path.
    monkeypatch.setattr(bm25_build, "RUN_TOKENS", 20_000)
    monkeypatch.setattr(bm25_build, "MERGE_POSTINGS", 3_000)
    spilled = build_index(corpus, path=tmp_path / "spilled")
    assert _file_hashes(serial.path) == _file_hashes(parallel.path) == _file_hashes(spilled.path)
    assert not list((tmp_path / "spilled").glob("build-runs*"))
    query = "Which NFL team represented the AFC at Super Bowl 50?"
    assert serial.search(query, k=5) == parallel.search(query, k=5)


def test_a_dying_build_worker_is_a_backend_error_and_leaves_no_index(docs, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TOOLGYM_INDEX_WORKERS", "2")
    monkeypatch.setattr(bm25_workers, "WORKER_CODE", "import os; os._exit(7)")
    with pytest.raises(BackendError, match=r"index build worker died \(exit status 7\)"):
        build_index(docs[:3000], path=tmp_path / "ix")
    assert not (tmp_path / "ix").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # the temporary directory is gone too


def test_a_failing_build_worker_reports_its_traceback(docs, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TOOLGYM_INDEX_WORKERS", "2")
    code = (
        "import toolgym.tools.search.bm25_workers as w; w.analyse_range = lambda *a: 1 / 0; w.worker_main()"
    )
    monkeypatch.setattr(bm25_workers, "WORKER_CODE", code)
    with pytest.raises(BackendError, match=r"(?s)worker failed.*ZeroDivisionError"):
        build_index(docs[:3000], path=tmp_path / "ix")


@pytest.mark.parametrize("value", ["two", "-3x"])
def test_bad_worker_count_is_named(value: str, docs, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TOOLGYM_INDEX_WORKERS", value)
    with pytest.raises(BackendError, match="TOOLGYM_INDEX_WORKERS must be an integer"):
        build_index(docs[:100], path=tmp_path / "ix")


def test_long_documents_keep_exact_term_frequencies(tmp_path) -> None:
    # tf above 255 and above 65535 widen the stored frequencies; scores stay exact.
    corpus = [
        {"id": "a", "title": "", "text": "word " * 300 + "other"},
        {"id": "b", "title": "", "text": "word " * 70_000},
        {"id": "c", "title": "", "text": "word other thing"},
    ]
    ix = build_index(corpus, path=tmp_path / "ix")
    ranker = _ranker(ix)
    assert ranker.arrays["tfs"].dtype == np.uint32
    for query in ("word", "other word", "word word thing"):
        assert ranker.top_k(query, 3) == exhaustive_top_k(ranker, query, 3)


# -------------------------------------------------------------------------------------------- analysis


@pytest.mark.parametrize(
    ("word", "stem"),
    [
        ("possibly", "possibl"),  # Lucene's step 2: BLI -> BLE, not ABLI -> ABLE
        ("biology", "biologi"),
        ("paleontology", "paleontolog"),  # LOGI -> LOG in step 2 ...
        ("paléontologie", "paléontologi"),  # ... but not for a LOGI that appears only after step 5
        ("meshhed", "mesh"),  # any doubled consonant but l, s, z is undone after -ed
        ("hopping", "hop"),
        ("falling", "fall"),
        ("generalizations", "gener"),
        ("relational", "relat"),
        ("caresses", "caress"),
        ("ponies", "poni"),
        ("agreed", "agre"),
        ("happy", "happi"),
        ("ies", "i"),
        ("as", "as"),
        ("𝐱s", "𝐱"),  # two UTF-16 units: Java stems it
    ],
)
def test_porter_stems_as_lucene_does(word: str, stem: str) -> None:
    assert porter_stem(word) == stem


def test_anserini_display_rounds_in_double_and_nudges_ties() -> None:
    f32 = np.float32
    shown = anserini_display([23.439316, 22.087432, 22.087432, 21.602508, 17.384349822998047])
    assert shown == [
        float(f32(23.4393)),
        float(f32(22.0874)),
        float(f32(f32(22.0874) - f32(1e-6))),  # a tie: nudged by 1e-6, in float
        float(f32(21.6025)),
        # 173843.498... rounds down in double; rounding the float product (173843.5f) would round up.
        float(f32(17.3843)),
    ]
    assert anserini_display([]) == []


def test_norm_cache_is_lucenes_float_arithmetic() -> None:
    from toolgym.tools.search.bm25 import BM25Settings

    cache = lucene_norm_cache(np.float32(53.62241), BM25Settings())
    assert cache.dtype == np.float32 and cache.shape == (256,)
    # Code 56 is an exact length of 56 (codes below 24 and the first buckets are exact).
    k1, b = np.float32(0.9), np.float32(0.4)
    expected = np.float32(1) / (k1 * ((np.float32(1) - b) + b * np.float32(56) / np.float32(53.62241)))
    from toolgym.tools.search.bm25 import lucene_norm_codes

    assert cache[lucene_norm_codes(np.array([56]))[0]] == expected


# ----------------------------------------------------------------------------------------- string table


def test_string_table_round_trip(tmp_path) -> None:
    strings = ["alpha", "", "βήτα", "\ud800lone", "x" * 1000, *[f"s{i}" for i in range(500)]]
    write_string_table(strings, tmp_path, "t")
    table = StringTable(tmp_path, "t")
    assert len(table) == len(strings) and table.all() == strings
    assert [table.find(s) for s in strings] == list(range(len(strings)))
    assert table.find("missing") == -1 and table.find("alph") == -1
    with pytest.raises(IndexError):
        table.get(len(strings))


def test_string_table_refuses_duplicates_and_handles_empty(tmp_path) -> None:
    with pytest.raises(ValueError, match="'b' occurs twice"):
        write_string_table(["a", "b", "b"], tmp_path, "dup")
    write_string_table([], tmp_path, "empty")
    empty = StringTable(tmp_path, "empty")
    assert len(empty) == 0 and empty.find("a") == -1 and empty.all() == []


# ------------------------------------------------------------------------------------- checksum stamps


def test_a_verified_unchanged_index_opens_without_hashing(docs, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(index_files, "RACY_SECONDS", 0.0)
    build_index(docs[:300], path=tmp_path / "ix")
    load_index(tmp_path / "ix")  # hashes everything, then stamps it
    assert (tmp_path / "ix" / "verified.json").exists()

    def no_hashing(path: Path) -> str:
        raise AssertionError(f"hashed {path}")

    monkeypatch.setattr(file_table, "sha256_file", no_hashing)
    load_index(tmp_path / "ix")
    with pytest.raises(AssertionError, match="hashed"):
        load_index(tmp_path / "ix", verify="full")


def test_a_file_changed_after_it_was_verified_is_hashed_again(docs, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(index_files, "RACY_SECONDS", 0.0)
    build_index(docs[:300], path=tmp_path / "ix")
    load_index(tmp_path / "ix")
    time.sleep(0.05)  # past the file system's timestamp granularity
    store = tmp_path / "ix" / "bm25_docs.bin"
    data = bytearray(store.read_bytes())
    data[-1] ^= 0x01
    store.write_bytes(bytes(data))
    with pytest.raises(BackendError, match="bm25_docs.bin fails its checksum"):
        load_index(tmp_path / "ix")


def test_recent_files_are_not_stamped(docs, tmp_path) -> None:
    # Just built: within RACY_SECONDS of now, so no stamp can be trusted yet.
    build_index(docs[:300], path=tmp_path / "ix")
    load_index(tmp_path / "ix")
    stamps = (
        json.loads((tmp_path / "ix" / "verified.json").read_text())["files"]
        if (tmp_path / "ix" / "verified.json").exists()
        else {}
    )
    assert stamps == {}


def test_a_read_only_index_still_opens(docs, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(index_files, "RACY_SECONDS", 0.0)
    build_index(docs[:300], path=tmp_path / "ix")

    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError("read-only file system")

    monkeypatch.setattr(index_files.os, "replace", refuse)
    assert load_index(tmp_path / "ix").search("Super Bowl", k=1)
    assert not (tmp_path / "ix" / "verified.json").exists()
    assert not [p for p in (tmp_path / "ix").iterdir() if p.name.startswith(".verified")]
