"""ArxivRefs' on-disk cache: what it stores is what a fresh build gives, any change of an input file or
of a setting builds a new entry, and a foreign, truncated, corrupt or concurrently built entry is
rebuilt or refused, never read as a wrong task."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest

from toolgym.envs.arxiv_refs import ArxivRefsEnv, ContextRule
from toolgym.envs.arxiv_refs import cache as cache_module
from toolgym.envs.arxiv_refs.cache import PREFIX, CacheSettings, cache_key, load_or_build
from toolgym.errors import ConfigError
from toolgym.tools.papers.store import RecordStore

RELATED = (
    "Shortest paths in graphs were solved by {{cite:d}}. Information is measured as in {{cite:s}}. "
    "Compilers translate arithmetic {{cite:h}}."
)
BIB = {
    "d": (
        "E. Dijkstra. A note on two problems in connexion with graphs. Numer. Math., 1959.",
        {"doi": "10.1007/x1"},
    ),
    "s": ("C. Shannon. A mathematical theory of communication. Bell Syst. Tech. J., 1948.", {}),
    "h": ("G. Hopper. Compiling arithmetic expressions for early computers. J. ACM, 1952.", {}),
}


def paper(pid, title, body=RELATED, date="2022-01-10"):
    return {
        "paper_id": pid,
        "metadata": {"title": title, "authors": "Ada Lovelace", "update_date": date},
        "abstract": {"text": f"We study {title.lower()} in one framework."},
        "body_text": [{"section": "Related Work", "text": body, "cite_spans": []}],
        "bib_entries": {ref: {"bib_entry_raw": raw, "ids": ids} for ref, (raw, ids) in BIB.items()},
    }


RECORDS = [
    {
        "id": "W-dij",
        "title": "A Note on Two Problems in Connexion with Graphs",
        "year": 1959,
        "doi": "10.1007/x1",
    },
    {"id": "W-late", "title": "Graph algorithms of a later decade", "year": 2030, "abstract": "Later."},
    {"id": "W-other", "title": "Dynamic programming for sequential decisions", "year": 1957},
]


def write(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory of its own (index and ArxivRefs entries), and no in-process copies."""
    root = tmp_path / "cache"
    monkeypatch.setenv("TOOLGYM_CACHE", str(root))
    monkeypatch.setattr("toolgym.envs.arxiv_refs.env._SHARED", {})
    return root / "index"


@pytest.fixture
def files(tmp_path):
    corpus = write(tmp_path / "papers.jsonl", [paper("2201.00001", "Graphs and communication")])
    return corpus, write(tmp_path / "records.jsonl", RECORDS)


SETTINGS = CacheSettings(ContextRule(), True, 0.3, "mark", "default")


def snapshot(derived):
    """What an environment serves: tasks, stats, bans, every record, and the index's key."""
    return (
        [t.to_json() for t in derived.tasks],
        derived.stats,
        {p: sorted(b) for p, b in derived.banned.items()},
        {cid: r for cid, r in derived.collection.records.items()},
        derived.index.provenance["key"],
    )


def entries(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith((PREFIX, f".{PREFIX}")))


def test_a_second_load_opens_the_entry_and_derives_nothing(cache, files, monkeypatch):
    corpus, records = files
    first = load_or_build(corpus, records, SETTINGS)
    assert isinstance(first.collection.records, RecordStore) and first.path.parent == cache

    def derive_again(*args, **kwargs):
        raise AssertionError("a cached configuration was derived again")

    monkeypatch.setattr(cache_module, "derive", derive_again)
    again = load_or_build(corpus, records, SETTINGS)
    assert snapshot(again) == snapshot(first)
    assert set(entries(cache)) == {first.path.name, f".{first.path.name}.lock"}  # no temporary left


def test_the_entry_serves_what_a_build_without_cache_gives(cache, files):
    from toolgym.envs.arxiv_refs.derive import derive

    corpus, records = files
    collection, tasks, stats, banned = derive(corpus, records, SETTINGS)
    opened = load_or_build(corpus, records, SETTINGS)
    assert [t.to_json() for t in opened.tasks] == [t.to_json() for t in tasks]
    assert opened.stats == stats and {p: set(b) for p, b in opened.banned.items()} == banned
    assert dict(opened.collection.records.items()) == dict(collection.records)
    assert opened.collection.counts() == collection.counts()
    late = opened.collection.resolve("W-late")
    assert late in opened.banned["2201.00001"] and "0000000000" not in opened.banned["2201.00001"]


def test_any_change_of_either_file_builds_a_new_entry(cache, files):
    corpus, records = files
    before = load_or_build(corpus, records, SETTINGS)
    write(corpus, [paper("2201.00001", "Graphs and information")])
    after_corpus = load_or_build(corpus, records, SETTINGS)
    assert after_corpus.key != before.key and '"Graphs and information"' in after_corpus.tasks[0].prompt
    write(records, [{**RECORDS[0], "venue": "Numerische Mathematik"}, *RECORDS[1:]])
    after_records = load_or_build(corpus, records, SETTINGS)
    assert after_records.key != after_corpus.key
    venue = after_records.collection.records[after_records.collection.resolve("W-dij") or ""].venue
    assert venue == "Numerische Mathematik"
    assert len({before.path, after_corpus.path, after_records.path}) == 3


@pytest.mark.parametrize(
    "change",
    [
        {"rule": ContextRule(sections="method")},
        {"rule": ContextRule(fallback_sections="motivation")},
        {"rule": ContextRule(max_context_chars=100)},
        {"date_filter": False},
        {"near_duplicate_threshold": 0.5},
        {"unlinked": "omit"},
        {"unlinked": "plain"},
        {"backend": "pyserini"},
    ],
)
def test_every_setting_that_changes_the_result_is_in_the_key(cache, files, change):
    from dataclasses import replace

    corpus, records = files
    assert cache_key(corpus, records, replace(SETTINGS, **change)) != cache_key(corpus, records, SETTINGS)
    assert cache_key(corpus, records, SETTINGS) == cache_key(corpus, records, replace(SETTINGS))
    assert cache_key(corpus, None, SETTINGS) != cache_key(corpus, records, SETTINGS)


def test_an_entry_written_from_other_files_is_rebuilt(cache, files, tmp_path, caplog):
    corpus, records = files
    other = write(tmp_path / "other.jsonl", [paper("2201.00002", "Compilers and entropy")])
    wrong = load_or_build(other, records, SETTINGS)
    target = cache / f"{PREFIX}{cache_key(corpus, records, SETTINGS)}"
    shutil.copytree(wrong.path, target)  # the other files' entry under this configuration's name
    with caplog.at_level(logging.WARNING):
        right = load_or_build(corpus, records, SETTINGS)
    assert "written for key" in caplog.text and "rebuilding it" in caplog.text
    assert [t.id for t in right.tasks] == ["arxiv-2201.00001"]
    assert '"Graphs and communication"' in right.tasks[0].prompt


@pytest.mark.parametrize("name", ["records.bin", "tasks.jsonl", "banned.npy", "papers.json"])
def test_a_truncated_cache_file_is_rebuilt(cache, files, name, caplog):
    corpus, records = files
    good = snapshot(load_or_build(corpus, records, SETTINGS))
    path = next(cache.glob(f"{PREFIX}*")) / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with caplog.at_level(logging.WARNING):
        again = load_or_build(corpus, records, SETTINGS)
    assert f"{name} has" in caplog.text and "rebuilding it" in caplog.text
    assert snapshot(again) == good


@pytest.mark.parametrize("name", ["records.bin", "tasks.jsonl", "banned.npy", "record_ids.bin"])
def test_a_cache_file_altered_in_place_is_rebuilt(cache, files, name, caplog):
    corpus, records = files
    first = load_or_build(corpus, records, SETTINGS)
    good = snapshot(first)
    load_or_build(corpus, records, SETTINGS)  # a second open, which may stamp the files as verified
    path = first.path / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, one bit flipped
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        again = load_or_build(corpus, records, SETTINGS)
    assert f"{name} fails its checksum" in caplog.text
    assert snapshot(again) == good


def test_an_unreadable_manifest_or_a_lost_index_is_rebuilt(cache, files, caplog):
    corpus, records = files
    first = load_or_build(corpus, records, SETTINGS)
    good = snapshot(first)
    (first.path / "manifest.json").write_text("{not json", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        assert snapshot(load_or_build(corpus, records, SETTINGS)) == good
    assert "manifest" in caplog.text and "rebuilding it" in caplog.text
    caplog.clear()
    shutil.rmtree(first.index.path)
    with caplog.at_level(logging.WARNING):
        assert snapshot(load_or_build(corpus, records, SETTINGS)) == good
    assert "search index" in caplog.text and "building it again" in caplog.text


def test_a_file_changed_during_the_build_is_refused_and_nothing_is_cached(cache, files, monkeypatch):
    corpus, records = files
    real = cache_module.derive

    def derive_then_edit(*args, **kwargs):
        out = real(*args, **kwargs)
        write(records, [*RECORDS, {"id": "W-new", "title": "A record added while the build ran"}])
        return out

    monkeypatch.setattr(cache_module, "derive", derive_then_edit)
    with pytest.raises(ConfigError, match="changed while it was read; nothing was cached"):
        load_or_build(corpus, records, SETTINGS)
    assert not list(cache.glob(f"{PREFIX}*"))


CHILD = """
import hashlib, json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from toolgym.envs.arxiv_refs import ArxivRefsEnv
env = ArxivRefsEnv(sys.argv[1], collection=sys.argv[2])
rows = [[t.to_json(), sorted(env.banned_for(t))] for t in env.tasks]
print(hashlib.sha256(json.dumps([rows, env.stats]).encode()).hexdigest())
"""


def test_two_processes_building_the_same_entry_at_once_build_it_once(cache, files):
    corpus, records = files
    env = {**os.environ, "TOOLGYM_CACHE": str(cache.parent)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(corpus), str(records)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert outs[0][0] == outs[1][0]  # the same tasks, bans and stats
    logs = "".join(err for _, err in outs)
    assert logs.count("ArxivRefs cache written") == 1 and logs.count("ArxivRefs cache hit") == 1
    assert [p.name for p in cache.iterdir() if ".tmp-" in p.name] == []
    here = ArxivRefsEnv(corpus, collection=records)  # and this process reads the same entry
    rows = [[t.to_json(), sorted(here.banned_for(t))] for t in here.tasks]
    import hashlib

    assert outs[0][0].strip() == hashlib.sha256(json.dumps([rows, here.stats]).encode()).hexdigest()


def test_environments_of_one_process_share_one_copy(cache, files):
    corpus, records = files
    a = ArxivRefsEnv(corpus, collection=records)
    b = ArxivRefsEnv(corpus, collection=records, split="all", max_turns=3)
    assert a._shared is b._shared and a.collection is b.collection
    c = ArxivRefsEnv(corpus, collection=records, unlinked="omit")
    assert c._shared is not a._shared


def test_another_cache_directory_gets_its_own_copy(cache, files, tmp_path, monkeypatch):
    """A process that moves TOOLGYM_CACHE reads the new place: an index whose files lived in the old one
    may be gone (a test's temporary directory, a cleared cache)."""
    corpus, records = files
    a = ArxivRefsEnv(corpus, collection=records)
    monkeypatch.setenv("TOOLGYM_CACHE", str(tmp_path / "elsewhere"))
    b = ArxivRefsEnv(corpus, collection=records)
    assert b._shared is not a._shared and (tmp_path / "elsewhere" / "index").is_dir()
    monkeypatch.setenv("TOOLGYM_CACHE", str(cache.parent))
    assert ArxivRefsEnv(corpus, collection=records)._shared is a._shared


@pytest.mark.parametrize("how", ["writable by others", "another user's"])
def test_an_entry_someone_else_could_have_edited_is_not_trusted_and_is_rebuilt(cache, files, caplog, how):
    """The manifest is only a checksum (an editor of the gold answers can recompute it): an entry is
    trusted as the user's own files are, so one another account owns or may write is rebuilt."""
    corpus, records = files
    first = load_or_build(corpus, records, SETTINGS)
    good = snapshot(first)
    path = first.path / "tasks.jsonl"
    if how == "writable by others":
        path.chmod(0o666)
    else:
        os.chown(path, 12345, -1)  # the suite runs as root in CI; another account's file
    with caplog.at_level(logging.WARNING):
        again = load_or_build(corpus, records, SETTINGS)
    reason = (
        "is writable by other users (mode 666)"
        if how == "writable by others"
        else "belongs to another user (uid 12345)"
    )
    assert (
        f"tasks.jsonl {reason}, so its gold answers are not trusted" in caplog.text
        and "rebuilding it" in caplog.text
    )
    assert snapshot(again) == good
    st = (again.path / "tasks.jsonl").stat()
    assert st.st_uid == os.getuid() and not st.st_mode & 0o002
