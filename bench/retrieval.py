"""Benchmark the retrievers side by side: BM25, dense and hybrid, on the environments' own questions.

Usage::

    python bench/retrieval.py [--part shipped|scale|all] [--scale 100000] [--encoder DIR] [--smoke]
                              [--json FILE]
    python bench/retrieval.py --agents RUN_BM25 RUN_OTHER [...]

``--agents`` takes ``toolgym eval`` run directories that differ only in the retriever (``--env-arg
retriever=dense``, ...) and prints each one's paired reward difference against the first, per track and
pooled (``toolgym compare`` refuses such a pair by design: its manifests differ in the retriever).

What is measured, in one process, for each retriever (BM25: the default backend; dense: the encoder,
exact inner product, and HNSW where the collection is large enough; hybrid: RRF, k = 60, depth 100):

* SearchQA (``--part shipped``) — its 10,273 documents; the 266 test-split questions, each with its
  gold paragraph: recall@1/3/10 (gold in the top k) and MRR@10.
* ArxivRefs (``--part shipped``) — its 1,824 records; all 40 tasks, queried as the scripted baseline
  queries (one query per placeholder sentence, ``placeholder_queries``), through the environment's own
  search (banned ids removed): recall@k is the share of a task's cited papers found in the top k of
  any of its queries (averaged over tasks); MRR@10 the first cited paper's reciprocal rank per query.
* Scale (``--part scale``) — SearchQA's documents plus synthetic passages up to ``--scale`` (100,000):
  real text the package ships (the Wikipedia lead paragraphs and the unarXive papers' paragraphs, never
  XQuAD's, which hold the answers), cut into consecutive windows of equal word count, as many words as
  needed to fill the count. Same questions and metrics; the dense index has an HNSW graph, measured
  against exact search on the same vectors (recall@10 vs exact).

Costs: build seconds (BM25 built fresh; a dense build's encode and graph seconds as recorded in its
``dense.json`` when it was built, since the embeddings are cached by content hash), query latency
(one query at a time: p50, p95, encoding included) and throughput (q/s of one ``search_batch`` over
all queries). The machine's load average is printed with the results: dense encoding is CPU-bound.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from toolgym.tools.search.dense import DenseSettings, recall_vs_exact
from toolgym.tools.search.hybrid import FusionSettings, HybridIndex
from toolgym.tools.search.index import Index, SearchIndex, load_index
from toolgym.tools.search.index_build import build_index

DATA = resources.files("toolgym.envs") / "data"
KS = (1, 3, 10)


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _latency(index: SearchIndex, queries: Sequence[str], k: int) -> dict[str, float]:
    times = []
    cpu = time.process_time()
    for query in queries:
        _, seconds = _timed(lambda q=query: index.search(q, k))
        times.append(seconds * 1000)
    cpu = time.process_time() - cpu
    times.sort()
    _, batch = _timed(lambda: index.search_batch(list(queries), k))
    return {
        "p50_ms": round(statistics.median(times), 2),
        "p95_ms": round(times[int(0.95 * (len(times) - 1))], 2),
        "cpu_ms": round(cpu * 1000 / len(queries), 2),
        "qps": round(len(queries) / batch, 1),
    }


def _gold_metrics(results: Sequence[Sequence[str]], gold: Sequence[str]) -> dict[str, float]:
    out = {f"recall@{k}": sum(g in r[:k] for r, g in zip(results, gold, strict=True)) / len(gold) for k in KS}
    out["mrr@10"] = sum(
        1 / (r[:10].index(g) + 1) if g in r[:10] else 0.0 for r, g in zip(results, gold, strict=True)
    ) / len(gold)
    return {k: round(v, 3) for k, v in out.items()}


def _dense_build(index: Index) -> dict[str, float]:
    meta = json.loads((index.path / "dense.json").read_text(encoding="utf-8"))
    return dict(meta["build_seconds"])


def _retrievers(
    docs: Callable[[], list[dict[str, str]]], dense: DenseSettings, tmp: Path
) -> tuple[dict[str, SearchIndex], dict[str, dict[str, float]]]:
    bm25, bm25_s = _timed(lambda: build_index(docs(), path=tmp / "bm25"))
    dense_index = build_index(docs(), backend="dense", dense=dense)
    retrievers: dict[str, SearchIndex] = {"bm25": bm25}
    builds = {"bm25": {"index": round(bm25_s, 3)}, "dense": _dense_build(dense_index)}
    if dense_index.provenance["search"]["method"] == "hnsw":
        exact = load_index(dense_index.path, dense=DenseSettings(encoder=dense.encoder, search="exact"))
        retrievers["dense (exact)"] = exact
        retrievers["dense (hnsw)"] = dense_index
        retrievers["hybrid (rrf, hnsw)"] = HybridIndex(bm25, dense_index, FusionSettings())
    else:
        retrievers["dense (exact)"] = dense_index
        retrievers["hybrid (rrf)"] = HybridIndex(bm25, dense_index, FusionSettings())
    return retrievers, builds


def searchqa(dense: DenseSettings, docs: Callable[[], list[dict[str, str]]], smoke: bool) -> dict[str, Any]:
    from toolgym.envs.search_qa import default_questions

    tasks = [t for t in default_questions() if t.metadata["split"] == "test"]
    if smoke:
        tasks = tasks[:40]
    queries = [t.metadata["question"] for t in tasks]
    gold = [t.metadata["gold_doc"] for t in tasks]
    with tempfile.TemporaryDirectory() as tmp:
        retrievers, builds = _retrievers(docs, dense, Path(tmp))
        n_docs = len(retrievers["bm25"])
        rows = {}
        for name, index in retrievers.items():
            found = [[h.doc_id for h in hits] for hits in index.search_batch(queries, 10)]
            rows[name] = {**_gold_metrics(found, gold), **_latency(index, queries, 10)}
        extra = {}
        hnsw = retrievers.get("dense (hnsw)")
        if isinstance(hnsw, Index):
            ranker = hnsw._ranker
            extra["hnsw_recall@10_vs_exact"] = round(recall_vs_exact(ranker, queries, 10), 4)  # type: ignore[arg-type]
    return {"docs": n_docs, "queries": len(queries), "rows": rows, "build_s": builds, **extra}


def arxivrefs(dense: DenseSettings, smoke: bool) -> dict[str, Any]:
    from toolgym.envs.arxiv_refs import ArxivRefsEnv
    from toolgym.envs.arxiv_refs.baseline import placeholder_queries

    rows, builds = {}, {}
    for retriever in ("bm25", "dense", "hybrid"):
        kwargs: dict[str, Any] = {"retriever": retriever}
        if retriever != "bm25":
            kwargs["encoder"] = dense.encoder
        env, build_s = _timed(lambda kw=kwargs: ArxivRefsEnv(**kw))
        builds[retriever] = round(build_s, 2)
        recall = {k: 0.0 for k in KS}
        mrr, n_queries, times = 0.0, 0, []
        cpu = time.process_time()
        tasks = env.tasks[:5] if smoke else env.tasks
        for task in tasks:
            gold = set(task.reference)
            found: dict[int, set[str]] = {k: set() for k in KS}
            for query in placeholder_queries(task.prompt):
                records, seconds = _timed(lambda q=query, e=env, t=task: e.search(t, q, 10))
                times.append(seconds * 1000)
                ids = [r.id for r in records]
                for k in KS:
                    found[k] |= set(ids[:k]) & gold
                first = next((i for i, doc in enumerate(ids) if doc in gold), None)
                mrr += 1 / (first + 1) if first is not None else 0.0
                n_queries += 1
            for k in KS:
                recall[k] += len(found[k]) / len(gold)
        cpu = time.process_time() - cpu
        times.sort()
        rows[retriever] = {
            **{f"recall@{k}": round(recall[k] / len(tasks), 3) for k in KS},
            "mrr@10": round(mrr / n_queries, 3),
            "p50_ms": round(statistics.median(times), 2),
            "p95_ms": round(times[int(0.95 * (len(times) - 1))], 2),
            "cpu_ms": round(cpu * 1000 / n_queries, 2),  # with the metrics' bookkeeping (negligible)
        }
        env.close()
    return {"tasks": len(tasks), "queries": n_queries, "rows": rows, "env_build_s": builds}


def _paragraphs() -> list[tuple[str, str]]:
    """Real distractor text the package ships: Wikipedia leads and unarXive paragraphs (not XQuAD)."""
    paragraphs: list[tuple[str, str]] = []
    with gzip.open(str(DATA / "search_qa" / "wiki_vital_summaries_en.json.gz"), "rt", encoding="utf-8") as fh:
        wiki = json.load(fh)
    paragraphs.extend((wiki[key]["title"], wiki[key]["extract"]) for key in sorted(wiki))
    with gzip.open(
        str(DATA / "citations" / "unarxive_arXiv_src_2212_086.jsonl.gz"), "rt", encoding="utf-8"
    ) as fh:
        for line in fh:
            paper = json.loads(line)
            title = paper["metadata"].get("title") or paper["paper_id"]
            paragraphs.extend((title, block["text"]) for block in paper["body_text"])
    return paragraphs


def scaled_corpus(base: list[dict[str, str]], total: int) -> list[dict[str, str]]:
    """``base`` plus windows of real shipped text up to ``total`` documents (module docstring)."""
    needed = total - len(base)
    if needed <= 0:
        return base[:total]
    paragraphs = _paragraphs()
    lengths = [len(text.split()) for _, text in paragraphs]
    window = max(4, sum(lengths) // needed)
    while window > 4 and sum(n // window for n in lengths) < needed:
        window -= 1  # each paragraph's last partial window is dropped
    passages = []
    for title, text in paragraphs:
        tokens = text.split()
        for part, lo in enumerate(range(0, len(tokens) - window + 1, window)):
            passages.append((f"{title} (part {part + 1})", " ".join(tokens[lo : lo + window])))
    random.Random(0).shuffle(passages)
    if len(passages) < needed:
        raise SystemExit(f"only {len(passages)} windows of {window} words; lower --scale")
    extra = [{"id": f"sx{i:06d}", "title": t, "text": x} for i, (t, x) in enumerate(passages[:needed])]
    print(f"scale: {needed:,} synthetic passages of {window} words each", file=sys.stderr)
    return base + extra


def _table(title: str, result: dict[str, Any]) -> str:
    lines = [
        f"### {title}",
        "",
        "| retriever | R@1 | R@3 | R@10 | MRR@10 | p50 ms | p95 ms | CPU ms/query | q/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in result["rows"].items():
        lines.append(
            f"| {name} | {row['recall@1']:.3f} | {row['recall@3']:.3f} | {row['recall@10']:.3f} | {row['mrr@10']:.3f} | "
            f"{row['p50_ms']} | {row['p95_ms']} | {row['cpu_ms']} | {row.get('qps', '-')} |"
        )
    rest = {k: v for k, v in result.items() if k != "rows"}
    lines += ["", json.dumps(rest)]
    return "\n".join(lines)


#: Environment arguments that choose the retriever: the only ones ``--agents`` runs may differ in.
RETRIEVER_ARGS = ("retriever", "encoder", "query_prefix", "passage_prefix")


def agents(runs: Sequence[Path]) -> None:
    """Paired reward differences of eval runs that differ only in the retriever (module docstring)."""
    from toolgym.agents.eval.evaluate import paired_bootstrap
    from toolgym.agents.eval.runs import COMPARE_FIELDS, load_eval_run, paired_rewards, pooled_comparison

    base = load_eval_run(runs[0])
    for path in runs[1:]:
        other = load_eval_run(path)
        for name in COMPARE_FIELDS:
            mine, theirs = getattr(base.settings, name), getattr(other.settings, name)
            if name == "env_kwargs":
                mine = {k: v for k, v in mine.items() if k not in RETRIEVER_ARGS}
                theirs = {k: v for k, v in theirs.items() if k not in RETRIEVER_ARGS}
            if mine != theirs:
                raise SystemExit(
                    f"{base.label} and {other.label} differ in {name}, not only in the retriever"
                )
        retriever = other.settings.env_kwargs.get("retriever", "bm25")
        print(
            f"{other.label} ({retriever}) - {base.label} ({base.settings.env_kwargs.get('retriever', 'bm25')}):"
        )
        for harness in base.settings.harnesses:
            a, b, dropped = paired_rewards(base.trajectories[harness], other.trajectories[harness])
            mean, low, high = paired_bootstrap(a, b)
            print(
                f"  {harness}: n={len(a)} {sum(a) / len(a):.3f} -> {sum(b) / len(b):.3f}, "
                f"{mean:+.3f} [{low:+.3f}, {high:+.3f}] (dropped {dropped})"
            )
        if len(base.settings.harnesses) > 1:
            pooled = pooled_comparison(base, other)
            print(f"  pooled: n={pooled.n} {pooled.diff:+.3f} [{pooled.low:+.3f}, {pooled.high:+.3f}]")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("shipped", "scale", "all"), default="all")
    parser.add_argument("--scale", type=int, default=100_000, help="documents in the scale run")
    parser.add_argument("--encoder", default=None, help="encoder directory (default: all-MiniLM-L6-v2)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a quick check: 40 questions, 2,000 documents, 5 ArxivRefs tasks, a 5,000-passage scale run "
        "with an HNSW graph",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--agents", type=Path, nargs="+", default=None, help="eval runs to pair (see above)")
    args = parser.parse_args(argv)
    if args.agents is not None:
        agents(args.agents)
        return 0
    from toolgym.envs.search_qa import default_corpus

    dense = DenseSettings(encoder=args.encoder)
    results: dict[str, Any] = {"cpus": os.cpu_count(), "load_start": _load()}
    base = default_corpus()
    if args.smoke:
        base = base[:2_000]
    if args.part in ("shipped", "all"):
        results["searchqa"] = searchqa(dense, lambda: base, args.smoke)
        print(_table("SearchQA (shipped collection, test split)", results["searchqa"]), flush=True)
        results["arxivrefs"] = arxivrefs(dense, args.smoke)
        print(_table("ArxivRefs (shipped collection, all tasks)", results["arxivrefs"]), flush=True)
    if args.part in ("scale", "all"):
        total = 5_000 if args.smoke else args.scale
        corpus = scaled_corpus(base, total)
        scale_dense = replace(dense, hnsw_min_docs=4_000) if args.smoke else dense
        results["scale"] = searchqa(scale_dense, lambda: corpus, args.smoke)
        print(_table(f"SearchQA at {total:,} passages", results["scale"]), flush=True)
    results["load_end"] = _load()
    print(
        f"load average (1, 5, 15 min): start {results['load_start']}, end {results['load_end']}; {results['cpus']} CPUs"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
