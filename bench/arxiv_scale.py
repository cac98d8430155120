"""ArxivRefs at scale: build time and peak RSS with a collection of 5k to 300k records.

Usage::

    python bench/arxiv_scale.py [--sizes 5000,20000,100000,300000] [--cores 2] [--compare-max 20000]

No citation collection of that size ships or can be downloaded here, so records are synthesised from
the shipped unarXive sample (49 full-text papers, 1,786 bibliography entries). Record *i* takes base
entry ``i mod B`` (the bibliography entries, parsed, then the 49 papers), with these perturbations:

- the first copy of each bibliography entry keeps its arXiv id / DOI / OpenAlex id and its parsed
  title, so it links to that entry (as a real collection's record of a cited paper would); later
  copies get a synthetic DOI (``10.99999/synth.<i>``) and OpenAlex id, and their title is the base
  title with its words rotated and a ``variant <i>`` suffix (a distinct normalised title: no merge);
- the abstract is 120 words of the shipped body text from an offset drawn by a generator seeded with
  *i*, shuffled (real vocabulary, but no 8-word run of a query paper survives, so records are not
  copies of the query papers: the near-duplicate rule must still look at every one of them);
- authors are the base entry's parsed authors (or 1 to 4 names of the author pool); the year is the
  base year (or 2015) minus ``i mod 8``, given as ``year`` or, every third record, as ``"YYYY-MM"``.

The query papers are the 49 shipped papers (40 tasks). Per size, in a fresh process pinned to
``--cores`` CPUs with an empty index cache: the time to build ``ArxivRefsEnv(collection=...)`` (read,
merge, near-duplicates, bans, tasks, BM25 index), the CPU time it used (less sensitive than wall time
to other jobs on a shared machine; the index build's worker processes included) and the peak RSS of
the build's processes together (``bench/memory.py``). Up to ``--compare-max``
records it also times the near-duplicate rule side by side with the all-pairs comparison it replaced
and checks both give the same bans. A second process then builds the same environment with the
index already cached (what every later start on the same data pays). The growth exponent is the
least-squares slope of log(measure) over log(size).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, os, resource, sys, time
cores = int(sys.argv[3])
if hasattr(os, "sched_setaffinity") and cores > 0:
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])
sys.path.insert(0, sys.argv[4])
from memory import TreePeak  # bench/memory.py: the index build analyses in worker processes
peak = TreePeak()
start = time.perf_counter()
from toolgym.envs.arxiv_refs import ArxivRefsEnv
env = ArxivRefsEnv(collection=sys.argv[1])
build = time.perf_counter() - start
usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
out = {"build_s": build, "cpu_s": sum(u.ru_utime + u.ru_stime for u in usage), "rss_mb": peak.stop(),
       "records": env.stats["records"], "linked": env.stats.get("collection_records_linked", 0),
       "tasks": len(env.tasks)}
if int(sys.argv[2]):
    from toolgym.tools.papers.copies import near_duplicates, shingles
    t = time.perf_counter(); fast = near_duplicates(env.collection); out["index_s"] = time.perf_counter() - t
    t = time.perf_counter()
    docs = {r.id: shingles(r.abstract + "\n" + r.text) for r in env.collection.records.values() if r.text or r.abstract}
    slow = {}
    for p in env.collection.papers:
        own = env.collection.paper_ids[p.paper_id]
        q = shingles(p.abstract + "\n" + "\n".join(x.text for x in p.paragraphs))
        slow[p.paper_id] = {c for c, d in docs.items() if c != own and d and q and len(d & q) / min(len(d), len(q)) >= 0.3}
    out["all_pairs_s"] = time.perf_counter() - t
    out["same"] = slow == fast
print(json.dumps(out))
"""


def synthesise(n: int, path: Path) -> None:
    """Write ``n`` collection records built from the shipped data (perturbations: module docstring)."""
    from toolgym.tools.papers import load_papers, parse_reference

    papers = load_papers()
    base: list[dict[str, object]] = []
    for paper in papers:
        for entry in paper.bib.values():
            parsed = parse_reference(entry.raw)
            title = entry.title or parsed.title or " ".join(parsed.details.split()[:8]) or "untitled work"
            ids = {"arxiv_id": entry.arxiv_id, "doi": entry.doi, "open_alex_id": entry.openalex_id}
            base.append({"title": title, "authors": list(parsed.authors), "year": parsed.year, "ids": ids})
    for paper in papers:
        year = paper.date[0] if paper.date else None
        base.append({"title": paper.title, "authors": list(paper.authors), "year": year, "ids": {}})
    words = [
        w for p in papers for para in p.paragraphs for w in re.sub(r"\{\{[^}]*\}\}", " ", para.text).split()
    ]
    pool = sorted({a for b in base for a in b["authors"]} or {"Ada Lovelace"})  # type: ignore[attr-defined]
    with path.open("w", encoding="utf-8") as fh:
        for i in range(n):
            rng = random.Random(i)
            b = base[i % len(base)]
            first = i < len(base)
            title = str(b["title"])
            ids: dict[str, str] = {}
            if first:
                ids = {k: v for k, v in b["ids"].items() if v}  # type: ignore[attr-defined]
            else:
                split = title.split()
                r = i % max(1, len(split))
                title = " ".join(split[r:] + split[:r]) + f" variant {i}"
                ids = {"doi": f"10.99999/synth.{i}", "open_alex_id": f"W9{i}"}
            at = rng.randrange(max(1, len(words) - 120))
            abstract = words[at : at + 120]
            rng.shuffle(abstract)
            authors = b["authors"] or rng.sample(pool, min(len(pool), rng.randint(1, 4)))
            year = (b["year"] or 2015) - (i % 8)  # type: ignore[operator]
            record: dict[str, object] = {"id": f"rec-{i}", "title": title, "abstract": " ".join(abstract)}
            record |= {"authors": authors, "venue": f"Synthetic Venue {i % 97}", **ids}
            if i % 3 == 2:
                record["date"] = f"{year:04d}-{1 + i % 12:02d}"
            else:
                record["year"] = year
            fh.write(json.dumps(record) + "\n")


def build(cmd: list[str], env: dict[str, str], n: int) -> dict[str, float]:
    """Run one build process and return its JSON line."""
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        sys.exit(f"build of {n} records failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def exponent(sizes: list[int], values: list[float]) -> float:
    """Least-squares slope of log(value) over log(size)."""
    xs, ys = [math.log(s) for s in sizes], [math.log(max(v, 1e-9)) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="5000,20000,100000,300000", help="comma-separated record counts")
    ap.add_argument("--cores", type=int, default=2, help="CPUs each build process may use (0: all)")
    ap.add_argument("--compare-max", type=int, default=20000, help="largest size for the all-pairs check")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            path = Path(tmp) / f"records-{n}.jsonl"
            t = time.perf_counter()
            synthesise(n, path)
            made = time.perf_counter() - t
            env = dict(os.environ, TOOLGYM_CACHE=str(Path(tmp) / f"cache-{n}"))
            here = str(Path(__file__).resolve().parent)
            cmd = [
                sys.executable,
                "-c",
                CHILD,
                str(path),
                str(int(n <= args.compare_max)),
                str(args.cores),
                here,
            ]
            row = build(cmd, env, n)
            # A second build finds the index in the cache (what every later start of the same data pays).
            row["cached_s"] = build([*cmd[:4], "0", *cmd[5:]], env, n)["build_s"]
            rows.append((n, row))
            line = (
                f"{n:>8} records  synthesised {made:6.1f} s  build {row['build_s']:7.1f} s "
                f"(CPU {row['cpu_s']:6.1f} s; index cached: {row['cached_s']:6.1f} s)  "
                f"peak RSS {row['rss_mb']:7.0f} MB  collection {row['records']:>7}  "
                f"linked {row['linked']:>5}  tasks {row['tasks']}"
            )
            if "index_s" in row:
                ratio = row["all_pairs_s"] / max(row["index_s"], 1e-9)
                line += (
                    f"  near-duplicates: inverted index {row['index_s']:.2f} s, all pairs "
                    f"{row['all_pairs_s']:.2f} s ({ratio:.1f}x), same bans: {row['same']}"
                )
            print(line, flush=True)
    if len(rows) >= 2:
        ns = [n for n, _ in rows]
        slope = exponent(ns, [r["build_s"] for _, r in rows])
        cached = exponent(ns, [r["cached_s"] for _, r in rows])
        rss = exponent(ns, [r["rss_mb"] for _, r in rows])
        print(
            f"growth exponents ({ns[0]} -> {ns[-1]} records): build time {slope:.2f}, "
            f"build with the index cached {cached:.2f}, peak RSS {rss:.2f}"
        )


if __name__ == "__main__":
    main()
