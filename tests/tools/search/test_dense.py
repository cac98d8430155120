"""The dense backend: the shipped encoder for real, a tiny encoder for the machinery, and bad input."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil

import numpy as np
import pytest

from toolgym.errors import BackendError, ConfigError, ToolCallError
from toolgym.tools.search.dense import DenseSettings
from toolgym.tools.search.encoder import (
    DEFAULT_WEIGHTS_SHA256,
    SentenceEncoder,
    default_encoder_path,
    inspect_encoder,
)
from toolgym.tools.search.index import load_index
from toolgym.tools.search.index_build import build_index


def _docs(n: int) -> list[dict[str, str]]:
    from toolgym.envs.search_qa import default_corpus

    return default_corpus()[:n]


def _exact_top(index, encoder_dir: str, query: str, k: int) -> list[str]:
    """Brute force over the stored vectors, as a reference."""
    emb = np.load(index.path / "dense_embeddings.npy").astype(np.float32)
    q = SentenceEncoder(inspect_encoder(encoder_dir)).encode_queries([query])[0]
    order = np.lexsort((np.arange(len(emb)), -(emb @ q)))[:k]
    ids = [index._store.ids.get(int(i)) for i in order]
    return ids


# ------------------------------------------------------------------------------ the shipped encoder


def test_shipped_encoder_is_upstream_all_minilm_l6_v2():
    """The package's weights are upstream's (revision 1110a243), and the model reproduces the similarity
    matrix sentence-transformers publishes for it (README quickstart), to its 4 printed digits."""
    path = default_encoder_path()
    assert hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest() == DEFAULT_WEIGHTS_SHA256
    info = inspect_encoder(path)
    assert (info.dim, info.pooling, info.normalize, info.max_tokens) == (384, "mean", True, 256)
    vectors = SentenceEncoder(info).encode_queries(
        ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."]
    )
    published = np.array([[1.0, 0.6660, 0.1046], [0.6660, 1.0, 0.1411], [0.1046, 0.1411, 1.0]])
    assert np.abs(vectors @ vectors.T - published).max() < 6e-5


@pytest.mark.slow
def test_shipped_encoder_finds_gold_paragraphs(tmp_path):
    """Real retrieval: XQuAD questions against their 240 paragraphs (+ 60 distractors)."""
    from toolgym.envs.search_qa import default_questions

    index = build_index(_docs(300), backend="dense", path=tmp_path / "dense")
    questions = [t.metadata for t in default_questions()][::12]  # 100 questions over every article
    results = index.search_batch([q["question"] for q in questions], k=10)
    top1 = sum(hits[0].doc_id == q["gold_doc"] for hits, q in zip(results, questions, strict=True))
    top10 = sum(q["gold_doc"] in [h.doc_id for h in hits] for hits, q in zip(results, questions, strict=True))
    assert top1 >= 75 and top10 >= 95, (top1, top10)
    assert index.provenance["settings"]["encoder"]["sha256"] == inspect_encoder(default_encoder_path()).sha256


# ------------------------------------------------------------------------- the machinery (tiny model)


def test_exact_search_equals_brute_force_and_reopens(tiny_encoder, tmp_path):
    dense = DenseSettings(encoder=tiny_encoder)
    index = build_index(_docs(200), backend="dense", path=tmp_path / "d", dense=dense)
    assert index.provenance["search"] == {"method": "exact"}
    for query in ("Super Bowl 50", "the city of Warsaw", "photosynthesis in plants"):
        assert [h.doc_id for h in index.search(query, 7)] == _exact_top(index, tiny_encoder, query, 7)
    again = load_index(tmp_path / "d")  # the encoder is found from the index's record
    assert again.search("Super Bowl 50", 5) == index.search("Super Bowl 50", 5)
    # A batch pads its queries to one length: the same hits, scores equal up to float rounding.
    batch = index.search_batch(["Super Bowl 50", "Warsaw"], 4)
    single = [index.search("Super Bowl 50", 4), index.search("Warsaw", 4)]
    assert [[h.doc_id for h in hits] for hits in batch] == [[h.doc_id for h in hits] for hits in single]
    assert np.allclose(
        [h.score for hits in batch for h in hits], [h.score for hits in single for h in hits], atol=1e-6
    )
    assert len(index.search("Warsaw", 1000)) == 200  # k beyond the collection: all of it
    with pytest.raises(ToolCallError):
        index.search("  ", 3)


def test_cache_hit_encodes_nothing(tiny_encoder, tmp_path, monkeypatch):
    dense = DenseSettings(encoder=tiny_encoder)
    first = build_index(_docs(50), backend="dense", path=tmp_path / "d", dense=dense)

    def refuse(self, passages):
        raise AssertionError("passages encoded again")

    monkeypatch.setattr(SentenceEncoder, "encode_passages", refuse)
    second = build_index(_docs(50), backend="dense", path=tmp_path / "d", dense=dense)
    assert second.provenance == first.provenance


def test_a_renamed_copy_of_an_encoder_is_the_same_encoder(tiny_encoder, tmp_path):
    copy = tmp_path / "renamed"
    shutil.copytree(tiny_encoder, copy)
    a = build_index(
        _docs(30), backend="dense", path=tmp_path / "a", dense=DenseSettings(encoder=tiny_encoder)
    )
    b = build_index(_docs(30), backend="dense", path=tmp_path / "b", dense=DenseSettings(encoder=str(copy)))
    assert a.provenance["key"] == b.provenance["key"]


def test_hnsw_is_reproducible_and_agrees_with_exact(tiny_encoder, tmp_path):
    from toolgym.tools.search.dense import recall_vs_exact

    dense = DenseSettings(encoder=tiny_encoder, hnsw_min_docs=0, hnsw_ef_search=400)
    a = build_index(_docs(400), backend="dense", path=tmp_path / "a", dense=dense)
    b = build_index(_docs(400), backend="dense", path=tmp_path / "b", dense=dense)
    assert a.provenance["search"] == {"method": "hnsw", "ef_search": 400}
    graph = json.loads((a.path / "manifest.json").read_text())["files"]["dense_hnsw.faiss"]["sha256"]
    assert graph == json.loads((b.path / "manifest.json").read_text())["files"]["dense_hnsw.faiss"]["sha256"]
    queries = ["Super Bowl", "Warsaw", "Amazon rainforest", "Normans", "Huguenots", "oxygen", "Victoria"]
    assert recall_vs_exact(a._ranker, queries, 10) >= 0.97
    exact = load_index(tmp_path / "a", dense=DenseSettings(search="exact"))
    assert exact.provenance["search"] == {"method": "exact"}


def test_float16_embeddings_rank_like_float32(tiny_encoder, tmp_path):
    f32 = build_index(
        _docs(100), backend="dense", path=tmp_path / "a", dense=DenseSettings(encoder=tiny_encoder)
    )
    f16 = build_index(
        _docs(100),
        backend="dense",
        path=tmp_path / "b",
        dense=DenseSettings(encoder=tiny_encoder, dtype="float16"),
    )
    assert np.load(f16.path / "dense_embeddings.npy", mmap_mode="r").dtype == np.float16
    assert f16.provenance["key"] != f32.provenance["key"]
    for query in ("Super Bowl", "Warsaw", "plants"):
        assert f16.search(query, 1)[0].doc_id == f32.search(query, 1)[0].doc_id


# -------------------------------------------------------------------------------------- bad input


def test_a_directory_that_is_not_an_encoder_is_refused(tmp_path, tiny_encoder):
    with pytest.raises(ConfigError, match="not a directory"):
        inspect_encoder(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a sentence encoder: it has no config.json"):
        build_index(
            _docs(5),
            backend="dense",
            path=tmp_path / "i",
            dense=DenseSettings(encoder=str(tmp_path / "empty")),
        )
    causal = tmp_path / "causal"
    causal.mkdir()
    (causal / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    with pytest.raises(ConfigError, match=r"generative model \(LlamaForCausalLM\)"):
        inspect_encoder(causal)
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_encoder, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="holds no weights"):
        inspect_encoder(no_weights)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_encoder, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ConfigError, match="transformers cannot load it"):
        SentenceEncoder(inspect_encoder(broken)).encode_queries(["hello"])
    dense_module = tmp_path / "dense-module"
    shutil.copytree(tiny_encoder, dense_module)
    modules = json.loads((dense_module / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (dense_module / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match="'Dense' module"):
        inspect_encoder(dense_module)


def test_an_index_opened_with_another_encoder_is_refused(tiny_encoder, tmp_path):
    """The index holds 32-wide vectors of the tiny encoder; the shipped one makes 384-wide ones."""
    build_index(_docs(20), backend="dense", path=tmp_path / "d", dense=DenseSettings(encoder=tiny_encoder))
    with pytest.raises(
        ConfigError, match=r"32 dimensions\), but queries would be embedded by .*384 dimensions"
    ):
        load_index(tmp_path / "d", dense=DenseSettings(encoder=str(default_encoder_path())))


def test_another_encoder_at_the_same_path_rebuilds_with_a_warning(tiny_encoder, tmp_path, caplog):
    build_index(_docs(20), backend="dense", path=tmp_path / "d", dense=DenseSettings(encoder=tiny_encoder))
    with caplog.at_level(logging.WARNING):
        index = build_index(_docs(20), backend="dense", path=tmp_path / "d")
    assert "with another encoder" in caplog.text and "32 dimensions; now" in caplog.text
    assert np.load(index.path / "dense_embeddings.npy").shape == (20, 384)


def test_a_changed_corpus_under_cached_embeddings_is_rebuilt(tiny_encoder, tmp_path, caplog):
    dense = DenseSettings(encoder=tiny_encoder)
    docs = _docs(30)
    build_index(docs, backend="dense", path=tmp_path / "d", dense=dense)
    docs[7] = {**docs[7], "text": "Completely new words about zebras and volcanoes."}
    with caplog.at_level(logging.WARNING):
        index = build_index(docs, backend="dense", path=tmp_path / "d", dense=dense)
    assert "from another corpus" in caplog.text
    assert index.get(docs[7]["id"])["text"].startswith("Completely new")
    assert [h.doc_id for h in index.search("zebras volcanoes", 30)] == _exact_top(
        index, tiny_encoder, "zebras volcanoes", 30
    )


def test_altered_embeddings_are_caught(tiny_encoder, tmp_path):
    build_index(_docs(20), backend="dense", path=tmp_path / "d", dense=DenseSettings(encoder=tiny_encoder))
    emb = np.load(tmp_path / "d" / "dense_embeddings.npy")
    emb[3] = -emb[3]
    np.save(tmp_path / "d" / "dense_embeddings.npy", emb)
    with pytest.raises(BackendError, match="dense_embeddings.npy fails its checksum"):
        load_index(tmp_path / "d")


def test_a_query_longer_than_the_window_is_truncated_and_said_once(tiny_encoder, tmp_path, caplog):
    index = build_index(
        _docs(20), backend="dense", path=tmp_path / "d", dense=DenseSettings(encoder=tiny_encoder)
    )
    long_query = "Warsaw " * 100  # ~100 tokens, the tiny encoder's window is 32
    with caplog.at_level(logging.WARNING, logger="toolgym.tools.search.encoder"):
        first = index.search(long_query, 3)
        index.search(long_query + "Vistula", 3)
    said = [r for r in caplog.records if "longer than the encoder" in r.getMessage()]
    assert len(said) == 1 and "truncated to their first 32 tokens" in said[0].getMessage()
    # Truncation keeps the first 32 tokens: the same as a query of just those tokens.
    assert first == index.search("Warsaw " * 30, 3)


def test_bad_dense_settings_are_config_errors(tiny_encoder, tmp_path):
    with pytest.raises(ConfigError, match="dtype"):
        DenseSettings(dtype="int8")
    with pytest.raises(ConfigError, match="Did you mean 'exact'"):
        DenseSettings(search="exakt")
    with pytest.raises(ConfigError, match="max_tokens must be an integer from 2 to 64"):
        DenseSettings(encoder=tiny_encoder, max_tokens=10_000).encoder_info()
    with pytest.raises(ConfigError, match="apply to 'dense' only"):
        build_index(_docs(5), path=tmp_path / "i", dense=DenseSettings())


def test_queries_run_on_one_torch_thread_and_restore_the_count(tiny_encoder, monkeypatch):
    import torch

    encoder = SentenceEncoder(inspect_encoder(tiny_encoder))
    seen = []
    forward = encoder._encode
    monkeypatch.setattr(
        encoder, "_encode", lambda texts: (seen.append(torch.get_num_threads()), forward(texts))[1]
    )
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        encoder.encode_queries(["Warsaw"])
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
