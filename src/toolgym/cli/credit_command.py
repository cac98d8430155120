"""``toolgym credit``: what each tool call of stored episodes was worth, by counterfactual replay."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import Any

from toolgym.cli.eval_commands import add_allow_import

__all__ = ["add_credit_command"]

log = logging.getLogger("toolgym.credit")


def add_credit_command(sub: Any) -> None:
    """Add ``credit`` to the command line's sub-parsers."""
    p = sub.add_parser(
        "credit",
        help="each tool call's worth: replay stored episodes from each call with its result removed",
    )
    p.add_argument(
        "source",
        type=Path,
        metavar="DIR",
        help="a `toolgym eval --out` directory, or a training run (its heldout/trained evaluation)",
    )
    p.add_argument(
        "--policy",
        default=None,
        help="the policy that goes on after each call (default: the one that played the episodes)",
    )
    p.add_argument("--episodes", type=int, default=20, help="episodes to replay, in the evaluation's order")
    p.add_argument("--calls", type=int, default=50, help="calls to score in all (two replays each)")
    p.add_argument("--device", default="cpu", help="where a transformers policy runs (cpu, cuda)")
    p.add_argument("--out", type=Path, default=None, help="write credit.json here (default: DIR)")
    add_allow_import(p)
    p.set_defaults(func=cmd_credit)


def _evaluation(source: Path) -> Path:
    """``source`` itself when it is an evaluation, else a training run's ``heldout/trained``."""
    from toolgym.agents.eval.runs import RECORD
    from toolgym.errors import ConfigError

    trained = source / "heldout" / "trained"
    if (source / RECORD).is_file():
        return source
    if (trained / RECORD).is_file():
        return trained
    raise ConfigError(
        f"{source} is neither an evaluation ({RECORD}: `toolgym eval --out`) nor a training run with a "
        f"held-out evaluation ({trained / RECORD})"
    )


def cmd_credit(args: argparse.Namespace) -> int:
    from toolgym.agents.eval.credit import CreditReport, count_calls, credit_episodes, credit_run
    from toolgym.agents.eval.reverify import refuse_stored_import
    from toolgym.agents.eval.runs import load_eval_run
    from toolgym.agents.policies.factory import policy_factory
    from toolgym.cli.eval_commands import episode_progress
    from toolgym.errors import ConfigError
    from toolgym.registry import make

    if args.episodes < 1 or args.calls < 1:
        raise ConfigError(f"--episodes and --calls must be >= 1, got {args.episodes} and {args.calls}")
    path = _evaluation(args.source)
    run = load_eval_run(path)
    settings = run.settings
    if not args.allow_import:
        refuse_stored_import(str(path), settings.env_id, "--allow-import")
    episodes = credit_episodes(run, args.episodes)
    calls = count_calls(episodes)
    if not calls:
        print(f"{path}: no tool call with a result in its first {len(episodes)} episodes: nothing to credit")
        print(CreditReport(str(path), settings.env_id, args.policy or settings.policy).table())
        return 0
    spec = args.policy or settings.policy
    factory = policy_factory(
        spec, env_id=settings.env_id, max_model_len=settings.max_total_tokens, device=args.device
    )
    log.info(
        "credit: %d calls of %d episodes of %s, two replays each", min(calls, args.calls), args.episodes, path
    )
    progress, stop = episode_progress(f"credit {settings.env_id}")
    try:
        report = asyncio.run(
            credit_run(
                run,
                lambda: make(settings.env_id, **settings.env_kwargs),
                factory(),
                source=str(path),
                policy_name=spec,
                max_episodes=args.episodes,
                max_calls=args.calls,
                progress=progress,
            )
        )
    finally:
        stop()
    written = report.write(args.out if args.out is not None else path)
    print(
        f"credit of {len(report.calls)} tool calls in {report.episodes} episodes of {path} "
        f"(policy {spec}; reward with the call's result minus reward without it, both greedy):"
    )
    print(report.table())
    for skipped in report.not_replayable[:5]:
        print(f"not replayable: task {skipped['task_id']} seed {skipped['seed']}: {skipped['why']}")
    if report.infra_errors:
        print(f"{report.infra_errors} calls not scored: a replay ended in an infrastructure failure")
    if report.left_out:
        print(f"{report.left_out} calls left out by --calls {args.calls}")
    print(f"written to {written}")
    if report.not_replayable and not report.calls:
        raise ConfigError(
            f"{path}: none of its {report.episodes} episodes could be replayed ({report.not_replayable[0]['why']})"
        )
    return 0
