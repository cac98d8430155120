"""Hybrid retrieval: the fusion rules' exact values, and a hybrid index over real BM25 and dense indexes."""

from __future__ import annotations

import pytest

from toolgym.errors import ConfigError, ToolCallError
from toolgym.tools.search.dense import DenseSettings
from toolgym.tools.search.hybrid import FusionSettings, HybridIndex, fuse
from toolgym.tools.search.index import Hit
from toolgym.tools.search.index_build import build_index
from toolgym.tools.search.retriever import RetrieverSettings, open_retriever


def _docs(n: int) -> list[dict[str, str]]:
    from toolgym.envs.search_qa import default_corpus

    return default_corpus()[:n]


def test_rrf_sums_reciprocal_ranks():
    lexical = [Hit("a", 12.0), Hit("b", 9.0), Hit("c", 1.0)]
    dense = [Hit("c", 0.9), Hit("a", 0.8), Hit("d", 0.7)]
    fused = fuse(lexical, dense, FusionSettings(k=60))
    assert [h.doc_id for h in fused] == ["a", "c", "b", "d"]
    assert fused[0].score == pytest.approx(1 / 61 + 1 / 62)
    assert fused[1].score == pytest.approx(1 / 63 + 1 / 61)
    assert fused[2].score == pytest.approx(1 / 62)
    assert fused[3].score == pytest.approx(1 / 63)


def test_rrf_ties_go_to_the_better_rank_then_the_id():
    fused = fuse([Hit("x", 5.0), Hit("y", 4.0)], [Hit("y", 0.9), Hit("x", 0.8)], FusionSettings(k=1))
    assert [h.doc_id for h in fused] == ["x", "y"]  # equal sums 1/2 + 1/3; both have a rank 1: by id


def test_weighted_sum_of_min_max_normalised_scores():
    lexical = [Hit("a", 10.0), Hit("b", 6.0), Hit("c", 2.0)]
    dense = [Hit("c", 0.9), Hit("d", 0.5)]
    fused = {h.doc_id: h.score for h in fuse(lexical, dense, FusionSettings(method="weighted", weight=0.25))}
    assert fused == pytest.approx({"a": 0.25, "b": 0.125, "c": 0.75, "d": 0.0})


def test_bad_fusion_settings():
    with pytest.raises(ConfigError, match="Did you mean 'rrf'"):
        FusionSettings(method="rff")
    with pytest.raises(ConfigError, match="weight"):
        FusionSettings(weight=1.5)
    with pytest.raises(ConfigError, match="depth"):
        FusionSettings(depth=0)
    with pytest.raises(ConfigError, match="Did you mean 'hybrid'"):
        RetrieverSettings(retriever="hybird")
    with pytest.raises(ConfigError, match="apply to retriever='dense' or 'hybrid'"):
        RetrieverSettings.from_args("bm25", encoder="/some/model")


def test_hybrid_index_fuses_both_sides(tiny_encoder, tmp_path):
    docs = _docs(120)
    lexical = build_index(docs, path=tmp_path / "bm25")
    dense = build_index(
        docs, backend="dense", path=tmp_path / "dense", dense=DenseSettings(encoder=tiny_encoder)
    )
    hybrid = HybridIndex(lexical, dense, FusionSettings(depth=120))
    query = "Super Bowl 50 Denver Broncos"
    expected = fuse(lexical.search(query, 120), dense.search(query, 120), FusionSettings())[:5]
    assert hybrid.search(query, 5) == expected
    assert [[h.doc_id for h in hits] for hits in hybrid.search_batch([query], 5)] == [
        [h.doc_id for h in expected]
    ]
    assert hybrid.get("xq0001") == lexical.get("xq0001")
    assert len(hybrid) == 120
    provenance = hybrid.provenance
    assert provenance["retriever"] == "hybrid" and provenance["fusion"]["method"] == "rrf"
    assert provenance["dense"]["settings"]["encoder"]["dim"] == 32
    with pytest.raises(ToolCallError):
        hybrid.search("Warsaw", 0)


def test_hybrid_refuses_indexes_of_different_corpora(tiny_encoder, tmp_path):
    lexical = build_index(_docs(30), path=tmp_path / "bm25")
    dense = build_index(
        _docs(31), backend="dense", path=tmp_path / "dense", dense=DenseSettings(encoder=tiny_encoder)
    )
    with pytest.raises(ConfigError, match="different corpora"):
        HybridIndex(lexical, dense)
    with pytest.raises(ConfigError, match="fuses a BM25 index and a dense one"):
        HybridIndex(dense, lexical)


def test_open_retriever_reuses_each_cached_index(tiny_encoder, tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLGYM_CACHE", str(tmp_path))
    settings = RetrieverSettings(retriever="hybrid", dense=DenseSettings(encoder=tiny_encoder))
    hybrid = open_retriever(lambda: iter(_docs(40)), settings)
    dense = open_retriever(
        lambda: iter(_docs(40)), RetrieverSettings(retriever="dense", dense=settings.dense)
    )
    bm25 = open_retriever(lambda: iter(_docs(40)), RetrieverSettings())
    assert isinstance(hybrid, HybridIndex)
    assert hybrid.provenance["dense"]["key"] == dense.provenance["key"]
    assert hybrid.provenance["lexical"] == bm25.provenance
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "index").iterdir()) == ["default", "dense"]
