"""Search at scale: the default (numpy BM25) and pyserini (Lucene) backends over up to a million passages.

Usage::

    python bench/search_scale.py --sizes 100000,300000,1000000 [--words 100] [--queries 1000]

No corpus of a million passages ships or can be downloaded here, so passages are synthesised from the
real text the package ships (Wikipedia lead paragraphs, XQuAD paragraphs, the unarXive papers' body
text: ~1.5M words): passage *i* is four 25-word runs of that text taken at offsets drawn by a
generator seeded with *i*, joined, with the title of the first run's source. The word distribution is
real English, exact duplicate passages are practically absent, and every size is reproducible. The
queries are the XQuAD questions.

Per size and backend, each in a fresh process (so peak RSS is that backend's alone): build time and
peak RSS of the build (the sum over the build's process tree, sampled every 50 ms: the default
backend analyses in worker processes); index size on disk; cold start (a fresh ``python`` that
imports toolgym, opens the index and answers one query, spawn to answer; best of 3) both as a later
open finds the index (checksums verified before, see ``toolgym.tools.search.index_files``) and with
every checksum recomputed (``verify="full"``, what the first open of a copied index pays); peak RSS
and q/s of a query process (k = 10, best of ``--rounds`` passes of ``search_batch`` over the queries
with ``--threads``; ``--turns`` such processes per backend, the backends taking turns so a drifting
machine speed affects both alike: the best q/s and the highest RSS are reported); and how many of the first 200 questions (the quality subset) get identical
top-10 hit lists from both backends (ids, order and shown scores), and of all queries. The growth
exponent of each measure is the slope of log(measure) over log(size) between the smallest and largest
size.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from memory import TreePeak, self_peak_mb  # bench/memory.py (this script's folder is on sys.path)
from search import shipped_paragraphs  # bench/search.py

RUN = 25  # words per run; four runs per 100-word passage


def source_text() -> tuple[list[str], list[str], list[int]]:
    """Every shipped word in order, the source titles, and each word's source index."""
    sources = shipped_paragraphs()  # bench/search.py: the same text, read the same way
    words: list[str] = []
    owner: list[int] = []
    titles = []
    for i, (title, text) in enumerate(sources):
        titles.append(title)
        split = text.split()
        words.extend(split)
        owner.extend([i] * len(split))
    return words, titles, owner


def passages(n: int, words_per_passage: int):  # type: ignore[no-untyped-def]
    """The first ``n`` synthetic passages (a generator: a million never sit in memory as dicts)."""
    words, titles, owner = source_text()
    runs = max(1, words_per_passage // RUN)
    limit = len(words) - RUN
    for i in range(n):
        starts = np.random.default_rng(i).integers(0, limit, size=runs)
        text = " ".join(" ".join(words[s : s + RUN]) for s in starts)
        yield {"id": f"s{i:07d}", "title": titles[owner[int(starts[0])]], "text": text}


def queries(limit: int) -> list[str]:
    from toolgym.envs.search_qa import default_questions

    return [t.metadata["question"] for t in default_questions()][:limit]


def worker_build(args: argparse.Namespace) -> dict[str, float]:
    from toolgym.tools.search.index_build import build_index

    peak = TreePeak()
    start = time.perf_counter()
    index = build_index(passages(args.size, args.words), backend=args.backend, path=args.dir)
    built = time.perf_counter() - start
    index.close()
    size = sum(f.stat().st_size for f in Path(args.dir).rglob("*") if f.is_file())
    return {"build_s": built, "build_rss_mb": peak.stop(), "disk_mb": size / 2**20}


def worker_query(args: argparse.Namespace) -> dict[str, object]:
    from toolgym.tools.search.index import load_index

    qs = queries(args.queries)
    index = load_index(args.dir)
    index.search_batch(qs[:50], k=10, threads=args.threads)  # warm-up (JIT for Lucene, page cache)
    best = 0.0
    for _ in range(args.rounds):
        start = time.perf_counter()
        index.search_batch(qs, k=10, threads=args.threads)
        best = max(best, len(qs) / (time.perf_counter() - start))
    hits = (
        [[[h.doc_id, h.score] for h in found] for found in index.search_batch(qs, k=10, threads=1)]
        if args.hits
        else []
    )
    index.close()
    return {"qps": best, "query_rss_mb": self_peak_mb(), "hits": hits}


COLD = """
import sys
from toolgym.tools.search.index import load_index
hits = load_index(sys.argv[1], verify=sys.argv[3] if sys.argv[3] == "full" else True).search(sys.argv[2], k=10)
assert hits, "no hits"
"""


def cold_start(path: Path, query: str, verify: str = "stamped", repeats: int = 3) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-c", COLD, str(path), query, verify], check=True, capture_output=True
        )
        best = min(best, time.perf_counter() - start)
    return best


def run_worker(
    kind: str, args: argparse.Namespace, backend: str, size: int, path: Path, hits: bool = False
) -> dict[str, object]:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        kind,
        "--backend",
        backend,
        "--size",
        str(size),
        "--dir",
        str(path),
    ]
    cmd += ["--words", str(args.words), "--queries", str(args.queries), "--threads", str(args.threads)]
    cmd += ["--rounds", str(args.rounds)] + (["--hits"] if hits else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def slope(sizes: list[int], values: list[float]) -> float:
    if len(sizes) < 2 or min(values) <= 0:
        return float("nan")
    return math.log(values[-1] / values[0]) / math.log(sizes[-1] / sizes[0])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="100000,300000,1000000", help="passage counts, comma-separated")
    parser.add_argument("--words", type=int, default=100, help="words per passage (a multiple of 25)")
    parser.add_argument("--queries", type=int, default=1000, help="XQuAD questions used as queries")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="passes over the queries per query process")
    parser.add_argument("--turns", type=int, default=3, help="query processes per backend, taking turns")
    parser.add_argument("--backends", default="default,pyserini")
    parser.add_argument("--dir", type=Path, default=None, help="where indexes go (default: a temp dir)")
    parser.add_argument("--worker", choices=("build", "query"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="default", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--hits", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = worker_build(args) if args.worker == "build" else worker_query(args)
        print(json.dumps(result))
        return
    if args.turns < 1 or args.rounds < 1:
        parser.error("--turns and --rounds must be at least 1")

    sizes = [int(s) for s in args.sizes.split(",")]
    backends = args.backends.split(",")
    root = args.dir or Path(tempfile.mkdtemp(prefix="toolgym-scale-"))
    query = queries(1)[0]
    rows: dict[str, dict[int, dict[str, object]]] = {b: {} for b in backends}
    print(
        f"synthetic passages of {args.words} words; {args.queries} XQuAD questions, k=10, {args.threads} threads"
    )
    print(
        f"{'backend':9} {'passages':>9} {'build s':>8} {'build RSS':>10} {'disk MB':>8} {'cold s':>7} "
        f"{'cold full':>9} {'q/s':>8} {'query RSS':>10}"
    )
    for size in sizes:
        for backend in backends:
            rows[backend][size] = run_worker("build", args, backend, size, root / f"{backend}-{size}")
        # Query processes of the backends take turns, so a machine whose speed drifts (a shared one)
        # drifts for both: each backend's best q/s and highest RSS over its turns are reported.
        # The hit lists are collected (one more pass) in the last turn only.
        for turn in range(args.turns):
            for backend in backends:
                row = rows[backend][size]
                last = turn == args.turns - 1
                found = run_worker("query", args, backend, size, root / f"{backend}-{size}", hits=last)
                row["qps"] = max(float(row.get("qps", 0.0)), float(found["qps"]))  # type: ignore[arg-type]
                row["query_rss_mb"] = max(float(row.get("query_rss_mb", 0.0)), float(found["query_rss_mb"]))  # type: ignore[arg-type]
                if last:
                    row["hits"] = found["hits"]
        for backend in backends:
            path = root / f"{backend}-{size}"
            row = rows[backend][size]
            row["cold_s"] = cold_start(path, query)
            row["cold_full_s"] = cold_start(path, query, verify="full")
            print(
                f"{backend:9} {size:>9,} {row['build_s']:>8.1f} {row['build_rss_mb']:>8.0f}MB {row['disk_mb']:>8.0f} "
                f"{row['cold_s']:>7.2f} {row['cold_full_s']:>9.2f} {row['qps']:>8,.0f} {row['query_rss_mb']:>8.0f}MB",
                flush=True,
            )
        if len(backends) == 2:
            a, b = (rows[x][size]["hits"] for x in backends)
            same = [x == y for x, y in zip(a, b, strict=True)]  # type: ignore[call-overload]
            same_ids = [
                [h[0] for h in x] == [h[0] for h in y]
                for x, y in zip(a, b, strict=True)  # type: ignore[call-overload]
            ]
            ratio = float(rows[backends[0]][size]["qps"]) / float(rows[backends[1]][size]["qps"])
            print(
                f"  {size:,}: q/s ratio {backends[0]}/{backends[1]} {ratio:.2f}x; identical top-10 hit lists: "
                f"{sum(same[:200])}/{len(same[:200])} of the quality subset, {sum(same)}/{len(same)} of all "
                f"queries ({sum(same_ids)}/{len(same_ids)} with the same ids in the same order)"
            )
    if len(sizes) > 1:
        print(f"growth exponents ({sizes[0]:,} -> {sizes[-1]:,} passages):")
        for backend in backends:
            r = rows[backend]
            parts = [
                f"{name} {slope(sizes, [float(r[s][key]) for s in sizes]):.2f}"  # type: ignore[arg-type]
                for name, key in (
                    ("build", "build_s"),
                    ("disk", "disk_mb"),
                    ("build RSS", "build_rss_mb"),
                    ("query RSS", "query_rss_mb"),
                    ("cold start", "cold_s"),
                    ("q/s", "qps"),
                )
            ]
            print(f"  {backend:9} " + ", ".join(parts))


if __name__ == "__main__":
    main()
