"""Benchmark the search backends side by side: quality, throughput and cold start.

Usage::

    python bench/search.py [--threads 2] [--rounds 3] [--window 10] [--smoke]

Two corpora, both real text the package ships (see bench/README.md for the choice):

* quality — XQuAD-en's 240 paragraphs + 10,033 Wikipedia lead paragraphs; the 1,190 XQuAD questions
  have a known gold paragraph, so MRR@10 is measurable; top-10 overlap compares the two rankings.
* speed — every paragraph of the Wikipedia leads, XQuAD and the unarXive papers cut into consecutive
  ``--window``-word passages (>100k documents); the XQuAD questions are the queries.

Both backends run in this one process on the same machine (ratios, not absolute speeds, are the
result). Cold start is a fresh ``python`` process that imports toolgym, opens the index and answers one
query, timed from spawn to answer.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

from toolgym.tools.search.index import Index
from toolgym.tools.search.index_build import build_index

DATA = resources.files("toolgym.envs") / "data"
#: Corpus sizes of a ``--smoke`` run.
SMOKE_QUESTIONS, SMOKE_DOCS = 50, 1_000


def quality_corpus() -> tuple[list[dict[str, str]], list[tuple[str, str]]]:
    """XQuAD paragraphs + Wikipedia leads, and (question, gold paragraph id) pairs."""
    from toolgym.envs.search_qa import default_corpus, default_questions

    questions = [(t.metadata["question"], t.metadata["gold_doc"]) for t in default_questions()]
    return default_corpus(), questions


def shipped_paragraphs() -> list[tuple[str, str]]:
    """Every paragraph the package ships, as (title, text): XQuAD, Wikipedia leads, unarXive body text."""
    paragraphs: list[tuple[str, str]] = []
    xquad = json.loads((DATA / "search_qa" / "xquad.en.json").read_text(encoding="utf-8"))
    for article in xquad["data"]:
        paragraphs.extend((article["title"].replace("_", " "), p["context"]) for p in article["paragraphs"])
    with gzip.open(str(DATA / "search_qa" / "wiki_vital_summaries_en.json.gz"), "rt", encoding="utf-8") as fh:
        paragraphs.extend((entry["title"], entry["extract"]) for entry in json.load(fh).values())
    with gzip.open(
        str(DATA / "citations" / "unarxive_arXiv_src_2212_086.jsonl.gz"), "rt", encoding="utf-8"
    ) as fh:
        for line in fh:
            paper = json.loads(line)
            title = paper["metadata"].get("title") or paper["paper_id"]
            paragraphs.extend((title, block["text"]) for block in paper["body_text"])
    return paragraphs


def speed_corpus(window: int) -> list[dict[str, str]]:
    """All shipped paragraphs cut into ``window``-word passages (title = source document)."""
    paragraphs = shipped_paragraphs()
    docs = []
    for title, text in paragraphs:
        words = text.split()
        for start in range(0, len(words), window):
            docs.append(
                {"id": f"p{len(docs):06d}", "title": title, "text": " ".join(words[start : start + window])}
            )
    return docs


def mrr_at_10(results: list[list[str]], gold: list[str]) -> float:
    total = 0.0
    for ids, answer in zip(results, gold, strict=True):
        if answer in ids[:10]:
            total += 1.0 / (ids.index(answer) + 1)
    return total / len(gold)


def overlap_at_10(a: list[list[str]], b: list[list[str]]) -> float:
    scores = [len(set(x[:10]) & set(y[:10])) / max(1, min(10, len(y))) for x, y in zip(a, b, strict=True)]
    return sum(scores) / len(scores)


def throughput(index: Index, queries: list[str], threads: int, rounds: int) -> float:
    index.search_batch(queries[:50], k=10, threads=threads)  # warm-up (JIT for Lucene, page cache)
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        index.search_batch(queries, k=10, threads=threads)
        best = max(best, len(queries) / (time.perf_counter() - start))
    return best


COLD = """
import sys, time
t0 = time.perf_counter()
from toolgym.tools.search.index import load_index
index = load_index(sys.argv[1])
hits = index.search(sys.argv[2], k=10)
assert hits, "no hits"
print(time.perf_counter() - t0)
"""


def cold_start(path: Path, query: str, repeats: int = 3) -> tuple[float, float]:
    """Best (spawn → first answer, in-process import → first answer) over ``repeats`` fresh processes."""
    walls, inner = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", COLD, str(path), query], capture_output=True, text=True, check=True
        )
        walls.append(time.perf_counter() - start)
        inner.append(float(out.stdout.strip().splitlines()[-1]))
    return min(walls), min(inner)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2, help="search threads for both backends")
    parser.add_argument("--rounds", type=int, default=3, help="timed passes over the queries (best kept)")
    parser.add_argument("--window", type=int, default=10, help="words per passage in the speed corpus")
    parser.add_argument("--cache", type=Path, default=None, help="index directory (default: a temp dir)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"tiny corpora ({SMOKE_QUESTIONS} questions, {SMOKE_DOCS} documents, {SMOKE_DOCS} passages) and one "
        "cold start: runs the whole script in seconds so tests keep it working; its numbers mean nothing",
    )
    args = parser.parse_args()
    root = args.cache or Path(tempfile.mkdtemp(prefix="toolgym-bench-"))

    docs, pairs = quality_corpus()
    if args.smoke:
        pairs = pairs[:SMOKE_QUESTIONS]
        gold_ids = {g for _, g in pairs}
        docs = [d for d in docs if d["id"] in gold_ids] + [d for d in docs if d["id"] not in gold_ids][
            :SMOKE_DOCS
        ]
    queries = [q for q, _ in pairs]
    gold = [g for _, g in pairs]
    ranked: dict[str, list[list[str]]] = {}
    hits: dict[str, list[list[tuple[str, float]]]] = {}
    for backend in ("default", "pyserini"):
        index = build_index(docs, backend=backend, path=root / f"quality-{backend}")
        found = index.search_batch(queries, k=10, threads=1)
        hits[backend] = [[(h.doc_id, h.score) for h in row] for row in found]
        ranked[backend] = [[doc_id for doc_id, _ in row] for row in hits[backend]]
        index.close()
    print(f"quality corpus: {len(docs):,} docs, {len(queries):,} XQuAD questions")
    for backend, results in ranked.items():
        print(f"  {backend:9s} MRR@10 {mrr_at_10(results, gold):.4f}")
    print(
        f"  mean top-10 overlap default vs pyserini: {overlap_at_10(ranked['default'], ranked['pyserini']):.4f}"
    )
    same = sum(a == b for a, b in zip(hits["default"], hits["pyserini"], strict=True))
    print(f"  identical top-10 hit lists (ids, order, shown scores): {same}/{len(queries)}")

    passages = speed_corpus(args.window)[: SMOKE_DOCS if args.smoke else None]
    print(
        f"speed corpus: {len(passages):,} passages of <= {args.window} words; {len(queries):,} queries, k=10"
    )
    qps: dict[str, float] = {}
    cold: dict[str, tuple[float, float]] = {}
    for backend in ("default", "pyserini"):
        start = time.perf_counter()
        index = build_index(passages, backend=backend, path=root / f"speed-{backend}")
        built = time.perf_counter() - start
        qps[backend] = throughput(index, queries, args.threads, args.rounds)
        single = throughput(index, queries, 1, 1)
        path = index.path
        index.close()
        cold[backend] = cold_start(path, queries[0], repeats=1 if args.smoke else 3)
        print(
            f"  {backend:9s} build {built:6.1f} s  {qps[backend]:8,.0f} q/s ({args.threads} threads)  "
            f"{single:8,.0f} q/s (1 thread)  cold start {cold[backend][0]:.2f} s "
            f"(spawn to answer; {cold[backend][1]:.2f} s after interpreter start)"
        )
    print(f"  throughput ratio default / pyserini: {qps['default'] / qps['pyserini']:.2f}x")


if __name__ == "__main__":
    main()
