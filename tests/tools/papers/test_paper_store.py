"""The stored collection (tools/papers/store.py) equals the collection written, field for field."""

from __future__ import annotations

import pytest

from toolgym.errors import BackendError
from toolgym.tools.papers import build_collection, load_papers
from toolgym.tools.papers.records import CollectionRecord
from toolgym.tools.papers.store import RecordStore, open_collection, write_collection


@pytest.fixture(scope="module")
def built():
    given = [
        CollectionRecord(
            record_id="W-1",
            title="A record with a lone surrogate \ud800 and accents: Schrödinger",
            abstract="Abstract.",
            authors=("Ada Lovelace",),
            date=(2020, 5, 0),
            venue="Venue",
            arxiv_id=None,
            doi="10.1234/x",
            openalex_id=None,
            other_ids=(("mag", "42"),),
            where="records.jsonl:1",
        )
    ]
    return build_collection(load_papers(), given)


@pytest.fixture(scope="module")
def stored(built, tmp_path_factory):
    out = tmp_path_factory.mktemp("store")
    write_collection(built, out)
    return open_collection(out), out


def test_every_record_alias_paper_and_count_round_trips(built, stored):
    collection, _ = stored
    assert isinstance(collection.records, RecordStore)
    assert list(collection.records) == list(built.records)
    assert all(collection.records[cid] == record for cid, record in built.records.items())
    assert list(collection.records.values()) == list(built.records.values())
    assert dict(collection.aliases) == dict(built.aliases)
    assert collection.papers == built.papers
    assert dict(collection.paper_ids) == dict(built.paper_ids)
    assert dict(collection.ref_ids) == dict(built.ref_ids)
    assert collection.counts() == built.counts()
    record = collection.records[collection.resolve("W-1") or ""]
    assert record.title == built.records[record.id].title and "\ud800" in (record.title or "")


def test_lookups_of_ids_the_collection_does_not_hold(stored):
    collection, _ = stored
    assert "0000000000" not in collection.records and 7 not in collection.records
    with pytest.raises(KeyError):
        collection.records["0000000000"]
    assert collection.resolve("no-such-id") is None and "doi:10.9/none" not in collection.aliases


def test_a_record_whose_bytes_changed_after_opening_is_an_error_not_a_wrong_record(built, tmp_path):
    write_collection(built, tmp_path)
    store = RecordStore(tmp_path)
    data = bytearray((tmp_path / "records.bin").read_bytes())
    data[0:1] = b"{"  # each record is a JSON array: this one no longer parses
    (tmp_path / "records.bin").write_bytes(bytes(data))
    with pytest.raises(BackendError, match="is corrupt: record 0 cannot be read"):
        RecordStore(tmp_path).at(0)
    assert len(store) == len(built.records)


def test_a_truncated_store_does_not_open(built, tmp_path):
    write_collection(built, tmp_path)
    blob = tmp_path / "records.bin"
    blob.write_bytes(blob.read_bytes()[:-10])
    with pytest.raises(ValueError, match="bytes, the offsets say"):
        open_collection(tmp_path)
