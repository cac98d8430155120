"""ArxivRefs at scale: build time and peak RSS with a collection of 5k to 300k records.

Usage::

    python bench/arxiv_scale.py [--sizes 5000,100000,300000] [--cores 2] [--compare-max 20000]

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
``--cores`` CPUs with an empty cache (``TOOLGYM_CACHE``): the *cold* construction of
``ArxivRefsEnv(collection=...)`` (import, read, merge, near-duplicates, bans, tasks, BM25 index,
writing the cache entry of :mod:`toolgym.envs.arxiv_refs.cache`), the CPU time it used (less
sensitive than wall time to other jobs on a shared machine; the index build's worker processes
included) and the peak RSS of its processes together (``bench/memory.py``). A second fresh process
then constructs the same environment *warm*, from the cache (what every later start on the same
data pays: rollout workers, evaluation pools, served sessions), and plays one search and one read,
which decode records on first use; the median of ``--warm-repeats`` (3) such processes is shown. Then the same for the shipped data alone (no ``collection``).
Each line gives the load average (1 min) before and after it. Up to ``--compare-max`` records it
also times the near-duplicate rule side by side with the all-pairs comparison it replaced and checks
both give the same bans. The growth exponent is the least-squares slope of log(measure) over
log(size).

``--write-unlinked PATH`` instead writes the shipped corpus with a share (``--unlinked-share``, 0.45)
of its bibliography entries removed, so that their citation markers link to no record: the corpus
environments.md measures the scripted baseline on with ``unlinked`` marked, omitted and plain.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
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
env = ArxivRefsEnv(collection=sys.argv[1] if sys.argv[1] != "-" else None)
build = time.perf_counter() - start
t = time.perf_counter()
task = env.tasks[0]
hits = env.search(task, task.metadata["title"] or "paper", 10)
env.read(task, hits[0].id)
first_use = time.perf_counter() - t
usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
out = {"build_s": build, "cpu_s": sum(u.ru_utime + u.ru_stime for u in usage), "rss_mb": peak.stop(),
       "first_use_s": first_use, "records": env.stats["records"],
       "linked": env.stats.get("collection_records_linked", 0), "tasks": len(env.tasks)}
if int(sys.argv[2]):
    from toolgym.tools.papers import build_collection, load_papers, load_records
    from toolgym.tools.papers.copies import near_duplicates, shingles
    collection = build_collection(load_papers(), load_records(sys.argv[1]))
    t = time.perf_counter(); fast = near_duplicates(collection); out["index_s"] = time.perf_counter() - t
    t = time.perf_counter()
    docs = {r.id: shingles(r.abstract + "\n" + r.text) for r in collection.records.values() if r.text or r.abstract}
    slow = {}
    for p in collection.papers:
        own = collection.paper_ids[p.paper_id]
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


def write_unlinked(path: Path, share: float) -> tuple[int, int]:
    """The shipped corpus with ``share`` of its bibliography entries removed (by a hash of the paper id
    and the ref id, so the same ones every time); returns (entries, removed)."""
    import gzip
    import hashlib

    from toolgym.tools.papers import default_corpus_path

    entries = removed = 0
    with (
        gzip.open(default_corpus_path(), "rt", encoding="utf-8") as fh,
        path.open("w", encoding="utf-8") as out,
    ):
        for raw in fh:
            if not raw.strip():
                continue
            paper = json.loads(raw)
            kept = {}
            for ref, entry in paper["bib_entries"].items():
                digest = hashlib.sha256(f"{paper['paper_id']}#{ref}".encode()).digest()
                entries += 1
                if int.from_bytes(digest[:8], "big") / 2**64 < share:
                    removed += 1
                else:
                    kept[ref] = entry
            paper["bib_entries"] = kept
            out.write(json.dumps(paper, ensure_ascii=False) + "\n")
    return entries, removed


def build(cmd: list[str], env: dict[str, str], records: str) -> dict[str, float]:
    """Run one construction process and return its JSON line."""
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        sys.exit(f"construction with {records} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def exponent(sizes: list[int], values: list[float]) -> float:
    """Least-squares slope of log(value) over log(size)."""
    xs, ys = [math.log(s) for s in sizes], [math.log(max(v, 1e-9)) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else float("nan")


def load() -> str:
    """The 1-minute load average now (other jobs on a shared machine inflate wall times)."""
    return f"{os.getloadavg()[0]:.1f}"


def cold_and_warm(records: str, compare: bool, args: argparse.Namespace, cache: Path) -> dict[str, float]:
    """One cold construction (empty cache), then warm ones (from the entry it wrote), each in a fresh process."""
    env = dict(os.environ, TOOLGYM_CACHE=str(cache))
    here = str(Path(__file__).resolve().parent)
    cmd = [sys.executable, "-c", CHILD, records, str(int(compare)), str(args.cores), here]
    before = load()
    row = build(cmd, env, records)
    # NOTE: the median of --warm-repeats fresh processes: one warm start is short enough for another
    # job's burst on a shared machine to double it
    warm = sorted(
        (build([*cmd[:4], "0", *cmd[5:]], env, records) for _ in range(args.warm_repeats)), key=_wall
    )
    row |= {f"warm_{k}": v for k, v in warm[len(warm) // 2].items() if k.endswith(("_s", "_mb"))}
    row["load"] = f"{before}-{load()}"
    return row


def _wall(row: dict[str, float]) -> float:
    return row["build_s"]


def line(label: str, row: dict[str, float]) -> str:
    return (
        f"{label:>16}  cold {row['build_s']:6.1f} s (CPU {row['cpu_s']:6.1f} s, peak RSS "
        f"{row['rss_mb']:5.0f} MB)  warm {row['warm_build_s']:5.2f} s (CPU {row['warm_cpu_s']:5.2f} s, "
        f"peak RSS {row['warm_rss_mb']:4.0f} MB, first search + read {row['warm_first_use_s'] * 1000:.0f} ms)  "
        f"collection {row['records']:>7}  linked {row['linked']:>5}  tasks {row['tasks']}  load {row['load']}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="5000,100000,300000", help="comma-separated record counts")
    ap.add_argument("--cores", type=int, default=2, help="CPUs each build process may use (0: all)")
    ap.add_argument("--compare-max", type=int, default=20000, help="largest size for the all-pairs check")
    ap.add_argument("--no-shipped", action="store_true", help="skip the shipped data alone")
    ap.add_argument(
        "--warm-repeats", type=int, default=3, help="warm constructions per size (the median is shown)"
    )
    ap.add_argument("--write-unlinked", type=Path, help="only write the corpus with unlinked citations")
    ap.add_argument(
        "--unlinked-share", type=float, default=0.45, help="share of bibliography entries removed"
    )
    args = ap.parse_args()
    if args.write_unlinked is not None:
        entries, removed = write_unlinked(args.write_unlinked, args.unlinked_share)
        print(f"{args.write_unlinked}: {removed} of {entries} bibliography entries removed")
        return
    sizes = [int(s) for s in args.sizes.split(",") if s]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_shipped:
            print(
                line("shipped data", cold_and_warm("-", False, args, Path(tmp) / "cache-shipped")), flush=True
            )
        for n in sizes:
            path = Path(tmp) / f"records-{n}.jsonl"
            t = time.perf_counter()
            synthesise(n, path)
            made = time.perf_counter() - t
            row = cold_and_warm(str(path), n <= args.compare_max, args, Path(tmp) / f"cache-{n}")
            rows.append((n, row))
            text = line(f"{n:,} records", row) + f"  (synthesised in {made:.1f} s)"
            if "index_s" in row:
                ratio = row["all_pairs_s"] / max(row["index_s"], 1e-9)
                text += (
                    f"  near-duplicates: inverted index {row['index_s']:.2f} s, all pairs "
                    f"{row['all_pairs_s']:.2f} s ({ratio:.1f}x), same bans: {row['same']}"
                )
            print(text, flush=True)
            shutil.rmtree(Path(tmp) / f"cache-{n}", ignore_errors=True)
    if len(rows) >= 2:
        ns = [n for n, _ in rows]
        cold = exponent(ns, [r["build_s"] for _, r in rows])
        warm = exponent(ns, [r["warm_build_s"] for _, r in rows])
        rss = exponent(ns, [r["rss_mb"] for _, r in rows])
        print(
            f"growth exponents ({ns[0]} -> {ns[-1]} records): cold construction {cold:.2f}, "
            f"warm construction {warm:.2f}, cold peak RSS {rss:.2f}"
        )


if __name__ == "__main__":
    main()
