"""``toolgym results``: result files written again, a study's table, documents built from studies."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["add_results_commands"]


def add_results_commands(sub: Any) -> None:
    """Add ``results write``, ``results table`` and ``results build`` to the command line's sub-parsers."""
    p = sub.add_parser(
        "results",
        help="result files: a run's small self-contained results, a study's table from them, documents built from studies",
    )
    rsub = p.add_subparsers(title="results commands")
    b = rsub.add_parser(
        "write",
        help="write RUN/result.json from a training run directory (toolgym train writes it at its end)",
    )
    b.add_argument("run_dir", type=Path, metavar="RUN")
    b.set_defaults(func=cmd_results_write)
    b = rsub.add_parser(
        "table", help="the paired Markdown table of a study folder (study.json and its result files)"
    )
    b.add_argument("study", type=Path, metavar="STUDY_DIR")
    b.set_defaults(func=cmd_results_table)
    b = rsub.add_parser(
        "build",
        help="rebuild the tables of a Markdown file between <!-- study: NAME --> and <!-- /study --> from "
        "results/NAME beside it",
    )
    b.add_argument("document", type=Path, metavar="FILE.md")
    b.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 when a table is not the files'"
    )
    b.set_defaults(func=cmd_results_build)


def cmd_results_write(args: argparse.Namespace) -> int:
    from toolgym.training.run_result import write_run_result

    print(f"result: {write_run_result(args.run_dir)}")
    return 0


def cmd_results_table(args: argparse.Namespace) -> int:
    from toolgym.training.experiments.study import study_table

    print(study_table(args.study), end="")
    return 0


def cmd_results_build(args: argparse.Namespace) -> int:
    from toolgym.training.experiments.study import build_document

    changed = build_document(args.document, check=args.check)
    if args.check:
        if changed:
            print(f"{args.document}: tables not built from their result files: {', '.join(changed)}")
            return 1
        print(f"{args.document}: every table is its result files'")
        return 0
    print(f"{args.document}: rebuilt {', '.join(changed) if changed else 'nothing (already built)'}")
    return 0
