"""SearchQA's question sets side by side: what copying the question finds, and what other queries find.

Usage::

    python bench/search_split.py [--sets xquad,hard] [--splits train,test] [--n N] [--json FILE]

For each question set (``questions="xquad"``, the default XQuAD questions, and ``questions="hard"``,
built so that the question's own words fail: :mod:`toolgym.envs.search_qa.hard`) and split, three
scripted rules play every question through the environment (``toolgym/SearchQA-v0`` with its defaults:
3 results a search, 6 turns, the worked example; the ``bare`` track):

* **copy** — :func:`~toolgym.envs.search_qa.reference_rule`: search the question itself, answer with a
  gold answer the results show, else ``"unknown"`` (copying with a perfect reader: an upper bound).
* **reformulate** — :func:`~toolgym.envs.search_qa.reformulating_rule`: search the question's ``hops``
  (a part of it, or a name a first search showed), open the gold document if it was shown without the
  answer, answer with a gold answer shown (on XQuAD questions its only hop is the question itself).

* **scripted** — :func:`~toolgym.envs.search_qa.baseline_rule` (``toolgym eval --policy scripted``):
  search the question, answer with the top hit's title (no reference).

Per cell: EM and F1 (the verifier's) and the environment's own tool-use measures (``use/*``,
:mod:`toolgym.tool_use`): **gold shown** (the gold document's id appeared in a tool result), **answer
shown** (a gold answer appeared in a tool result, SQuAD words), searches per episode, the queries'
word overlap with the question, and the share of episodes with a reformulated query (overlap < 0.8). A second table splits the hard set's rows by
construction (bridge, chain, year). ``--n`` takes the first N questions of each cell (a smoke run).
Model rows (the base model, a warm start) are runs of ``toolgym eval`` on the same env arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium

import toolgym  # noqa: F401  (registers the environments)
from toolgym.agents.harness import get_harness
from toolgym.agents.policies.base import RulePolicy
from toolgym.agents.rollout import run_episode
from toolgym.core import SamplingParams, Task, Trajectory
from toolgym.envs.search_qa import baseline_rule, reference_rule, reformulating_rule

ENV_ID = "toolgym/SearchQA-v0"
RULES: dict[str, Callable[[Task], Callable[[str], str]]] = {
    "copy": reference_rule,
    "reformulate": reformulating_rule,
    "scripted": lambda task: baseline_rule(),  # toolgym eval --policy scripted: the top hit's title
}
# Rules write whole calls; the byte tokenizer counts bytes: budgets large enough never to cut a turn.
SAMPLING = SamplingParams(max_tokens=2048)
MAX_TOTAL_TOKENS = 1 << 17


def _episode_row(task: Task, trajectory: Trajectory) -> dict[str, Any]:
    """One episode's figures: the verifier's scores and the environment's own tool-use measures."""
    m = trajectory.metrics
    return {
        "template": task.metadata.get("template", "xquad"),
        "em": m["reward/em"],
        "f1": m["reward/f1"],
        "gold_shown": m["use/gold_doc_shown"],
        "answer_shown": m["use/answer_shown"],
        "searches": m["use/searches"],
        "overlap": m.get("use/query_overlap", 1.0),  # no search: nothing reformulated
        "reformulated": m.get("use/reformulated", 0.0),
        "status": trajectory.status,
    }


async def _play(
    env: gymnasium.Env, tasks: Sequence[Task], make_rule: Callable[[Task], Any]
) -> list[dict[str, Any]]:
    harness = get_harness("bare")
    rows = []
    for i, task in enumerate(tasks):
        trajectory = await run_episode(
            env,
            RulePolicy(make_rule(task)),
            harness,
            seed=i,
            options={"task_id": task.id},
            sampling=SAMPLING,
            max_total_tokens=MAX_TOTAL_TOKENS,
        )
        rows.append(_episode_row(task, trajectory))
    return rows


def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    return {
        "n": float(len(rows)),
        "em": statistics.fmean(r["em"] for r in rows),
        "f1": statistics.fmean(r["f1"] for r in rows),
        "gold_shown": statistics.fmean(r["gold_shown"] for r in rows),
        "answer_shown": statistics.fmean(r["answer_shown"] for r in rows),
        "searches": statistics.fmean(r["searches"] for r in rows),
        "overlap": statistics.fmean(r["overlap"] for r in rows),
        "reformulated": statistics.fmean(r["reformulated"] for r in rows),
        "not_ok": float(sum(r["status"] != "ok" for r in rows)),
    }


def _table(title: str, cells: Sequence[tuple[str, str, str, dict[str, float]]]) -> str:
    lines = [
        f"### {title}",
        "",
        "| questions | split | rule | n | EM | F1 | gold shown | answer shown | searches / episode | query overlap | reformulated |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, split, rule, s in cells:
        lines.append(
            f"| {name} | {split} | {rule} | {int(s['n'])} | {s['em']:.3f} | {s['f1']:.3f} | {s['gold_shown']:.3f} "
            f"| {s['answer_shown']:.3f} | {s['searches']:.2f} | {s['overlap']:.2f} | {s['reformulated']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="xquad,hard", help="question sets, comma-separated")
    parser.add_argument("--splits", default="train,test", help="splits, comma-separated")
    parser.add_argument("--n", type=int, default=0, help="first N questions per cell (0: all)")
    parser.add_argument("--json", default=None, help="also write every figure to this file")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    cells, by_template = [], []
    for name in args.sets.split(","):
        for split in args.splits.split(","):
            env = gymnasium.make(ENV_ID, questions=name, split=split)
            tasks = list(env.unwrapped.tasks)[: args.n or None]
            for rule, make_rule in RULES.items():
                rows = asyncio.run(_play(env, tasks, make_rule))
                cells.append((name, split, rule, summarise(rows)))
                templates = sorted({r["template"] for r in rows})
                if name == "hard":
                    for template in templates:
                        picked = [r for r in rows if r["template"] == template]
                        by_template.append((f"hard: {template}", split, rule, summarise(picked)))
            env.close()
    wall = time.perf_counter() - start
    print(_table("Question sets: copying the question against reformulating", cells))
    if by_template:
        print()
        print(_table("The hard set by construction", by_template))
    one, five, fifteen = os.getloadavg()
    print(
        f"\nsearch_split: {sum(int(c[3]['n']) for c in cells)} episodes in {wall:.1f}s (load {one:.2f} {five:.2f} {fifteen:.2f})"
    )
    result = {
        "cells": [{"questions": n, "split": s, "rule": r, **v} for n, s, r, v in cells],
        "by_template": [{"questions": n, "split": s, "rule": r, **v} for n, s, r, v in by_template],
        "wall_s": wall,
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
    return result


if __name__ == "__main__":
    main()
