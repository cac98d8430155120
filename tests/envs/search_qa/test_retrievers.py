"""The environments' retriever argument: dense and hybrid search behind the same tools, recorded in the
run manifest so that runs of two retrievers never compare; and `toolgym index build` for each."""

from __future__ import annotations

import asyncio
import json

import pytest

from toolgym.cli import main
from toolgym.errors import ConfigError
from toolgym.records.manifest import env_fingerprint, manifest_differences


@pytest.fixture()
def small_data(tmp_path):
    from toolgym.envs.search_qa import default_corpus, default_questions

    docs = default_corpus()[:60]
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tasks = [t for t in default_questions() if t.metadata["gold_doc"] < "xq0060"][:10]
    questions = tmp_path / "questions.jsonl"
    rows = [
        {
            "id": t.id,
            "question": t.metadata["question"],
            "answers": t.reference,
            "gold_doc": t.metadata["gold_doc"],
        }
        for t in tasks
    ]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return corpus, questions


def _search(env, query: str) -> str:
    tool = {t.name: t for t in env._tool_list}["search"]
    return asyncio.run(tool(query=query, k=3))


@pytest.mark.parametrize("retriever", ["dense", "hybrid"])
def test_searchqa_searches_with_the_chosen_retriever(
    small_data, tiny_encoder, tmp_path, monkeypatch, retriever
):
    from toolgym.envs.search_qa import SearchQAEnv

    monkeypatch.setenv("TOOLGYM_CACHE", str(tmp_path / "cache"))
    corpus, questions = small_data
    env = SearchQAEnv(corpus, questions, retriever=retriever, encoder=tiny_encoder)
    expected = env.index.search("Super Bowl 50", 3)
    assert _search(env, "Super Bowl 50").splitlines()[0].startswith(f"[{expected[0].doc_id}]")
    provenance = env.provenance()["index"]
    dense = provenance if retriever == "dense" else provenance["dense"]
    assert dense["backend"] == "dense" and dense["settings"]["encoder"]["dim"] == 32
    bm25 = SearchQAEnv(corpus, questions)
    differences = manifest_differences(
        {"env": env_fingerprint(env, "toolgym/SearchQA-v0", {"retriever": retriever})},
        {"env": env_fingerprint(bm25, "toolgym/SearchQA-v0", {})},
    )
    assert any(d.startswith("env.provenance.index") for d in differences), differences


def test_an_unknown_retriever_is_a_config_error(small_data):
    from toolgym.envs.search_qa import SearchQAEnv

    with pytest.raises(ConfigError, match="Did you mean 'dense'"):
        SearchQAEnv(*small_data, retriever="dens")


def test_arxivrefs_searches_with_a_dense_retriever(tiny_encoder, tmp_path, monkeypatch):
    from toolgym.envs.arxiv_refs import ArxivRefsEnv

    monkeypatch.setenv("TOOLGYM_CACHE", str(tmp_path / "cache"))
    env = ArxivRefsEnv(retriever="dense", encoder=tiny_encoder)
    task = env.tasks[0]
    found = env.search(task, "graph neural networks", 5)
    assert len(found) == 5 and not {r.id for r in found} & env.banned_for(task)
    assert env.provenance()["index"]["settings"]["encoder"]["dim"] == 32
    tools = {t.name: t for t in asyncio.run(env.episode_tools(task))}
    assert "(dense retrieval over" in tools["search_papers"].description
    bm25_tools = {t.name: t for t in asyncio.run(ArxivRefsEnv().episode_tools(task))}
    assert "(BM25 over" in bm25_tools["search_papers"].description  # v0's prompt unchanged


def test_index_build_command_builds_each_retriever(small_data, tiny_encoder, tmp_path, capsys):
    corpus, _ = small_data
    common = ["index", "build", "--corpus", str(corpus), "--encoder", tiny_encoder]
    assert main([*common, "--retriever", "dense", "--dtype", "float16", "--out", str(tmp_path / "d")]) == 0
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["backend"] == "dense" and manifest["settings"]["dtype"] == "float16"
    assert main([*common, "--retriever", "hybrid", "--out", str(tmp_path / "h")]) == 0
    out = capsys.readouterr().out
    assert (
        f"index ready: {tmp_path / 'h' / 'bm25'}" in out and f"index ready: {tmp_path / 'h' / 'dense'}" in out
    )


def test_the_random_retriever_shows_a_gold_document_no_more_often_than_chance() -> None:
    """The control retriever (``retriever="random"``): k documents of the collection for any query,
    one answer per query, the same prompt as BM25's, a manifest no BM25 run pairs with unasked."""
    import gymnasium

    import toolgym  # noqa: F401

    env = gymnasium.make("toolgym/SearchQA-v0", split="test", retriever="random")
    bm25 = gymnasium.make("toolgym/SearchQA-v0", split="test")
    try:
        index, tasks = env.unwrapped.index, env.unwrapped.tasks
        shown = sum(
            any(h.doc_id == t.metadata["gold_doc"] for h in index.search(t.metadata["question"], 3))
            for t in tasks
        )
        chance = 3 * len(tasks) / len(index)  # 0.08 of 266 questions over 10,273 documents
        assert shown <= 3 and chance < 0.1, (shown, chance)  # BM25 shows it for 1,132 of 1,190 questions
        first = index.search("Super Bowl 50", 3)
        assert first == index.search("Super Bowl 50", 3) and first != index.search("Super Bowl", 3)
        assert len(first) == 3 and index.get(first[0].doc_id)["id"] == first[0].doc_id  # open works
        _, real = bm25.reset(seed=0)
        _, control = env.reset(seed=0)
        assert control["tools"] == real["tools"]  # the model is not told it searches at random
        differences = manifest_differences(
            {"env": env_fingerprint(env.unwrapped, "toolgym/SearchQA-v0", {"retriever": "random"})},
            {"env": env_fingerprint(bm25.unwrapped, "toolgym/SearchQA-v0", {})},
        )
        assert any(d.startswith("env.provenance.index") for d in differences), differences
    finally:
        env.close()
        bm25.close()


def test_the_default_retriever_named_or_left_out_is_the_same_environment() -> None:
    """``retriever="bm25"`` is SearchQA's default: a record that names it pairs with one that leaves it
    out (a held-out evaluation that had to name it, beside one that did not); any other value does not."""
    import gymnasium

    import toolgym  # noqa: F401
    from toolgym.registry import explicit_kwargs

    env_id = "toolgym/SearchQA-v0"
    assert explicit_kwargs(env_id, {"retriever": "bm25", "max_turns": 4}) == {"max_turns": 4}
    assert explicit_kwargs(env_id, {"retriever": "random", "max_turns": 3}) == {
        "retriever": "random",
        "max_turns": 3,
    }
    assert explicit_kwargs("toolgym/NoSuchEnv-v0", {"retriever": "bm25"}) == {"retriever": "bm25"}
    named = gymnasium.make(env_id, split="test", retriever="bm25")
    plain = gymnasium.make(env_id, split="test")
    try:
        a = {"env": env_fingerprint(named.unwrapped, env_id, {"split": "test", "retriever": "bm25"})}
        b = {"env": env_fingerprint(plain.unwrapped, env_id, {"split": "test"})}
        assert manifest_differences(a, b) == []
        other = {"env": {**b["env"], "kwargs": {"split": "test", "retriever": "dense"}}}
        assert manifest_differences(other, b) == ['env.kwargs.retriever: "dense" vs "(absent)"']
    finally:
        named.close()
        plain.close()
