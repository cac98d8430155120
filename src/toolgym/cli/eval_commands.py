"""``toolgym eval`` and ``toolgym compare``, and the environment options every command shares.

Part of the command line's composition root (see :mod:`toolgym.cli`): commands import what they need
inside their bodies, so loading this module costs nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from toolgym.errors import ConfigError

__all__ = ["cmd_compare", "cmd_eval", "import_user_modules", "parse_env_args"]


def import_user_modules(names: list[str]) -> None:
    """Import user modules that register their own environments (``--import my_envs.weather_env``)."""
    import importlib

    sys.path.insert(0, str(Path.cwd()))
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(
                f"cannot import {name!r} ({exc}); run from the folder that contains it"
            ) from None


def parse_env_args(pairs: list[str], env_id: str | None = None) -> dict[str, Any]:
    """``--env-arg KEY=VALUE`` pairs (values parsed as JSON, else kept as text), checked against the
    environment's constructor when ``env_id`` is given (a misspelt key gets "did you mean")."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--env-arg expects KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    if env_id is not None:
        from toolgym.agents.eval.evaluate import check_env_kwargs

        check_env_kwargs(env_id, out)
    return out


def add_allow_import(parser: argparse.ArgumentParser) -> None:
    """``--allow-import``: commands that rebuild an environment a stored file names (reverify, credit)."""
    parser.add_argument(
        "--allow-import",
        action="store_true",
        help="build environments the stored files name in module:id form, importing (running) that module; "
        "only for a run directory you trust",
    )


def progress_bar() -> Any:
    """The commands' progress bar, on stderr (a ``rich.progress.Progress``, not yet started)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )


def bar_updater(bar: Any, task: Any) -> Callable[[int, int], None]:
    """A ``progress(done, total)`` callback for ``task`` of ``bar``.

    NOTE: the bar starts with the first update, after the checks, so an error stays one line.
    """

    def progress(done: int, total: int) -> None:
        if not bar.live.is_started:
            bar.start()
        bar.update(task, completed=done, total=total)

    return progress


def episode_progress(name: str) -> tuple[Callable[[int, int], None], Callable[[], None]]:
    """``(progress(done, total), stop())`` for episodes: a bar on a terminal (stderr), else timestamped
    lines (every tenth and every 30 s, with the rate), so a log of a long evaluation is never silent."""
    import contextlib
    import sys

    if sys.stderr.isatty():
        bar = progress_bar()
        return bar_updater(
            bar, bar.add_task(name, total=None)
        ), lambda: bar.stop() if bar.live.is_started else None
    from toolgym.training.progress import RunProgress

    stack = contextlib.ExitStack()
    tasks: list[Any] = []

    def update(done: int, total: int) -> None:
        if not tasks:  # the first line with the first update, after the checks: an error stays one line
            tasks.append(stack.enter_context(RunProgress(sys.stderr, terminal=False).task(name)))
        tasks[0].update(done, total=total)

    return update, stack.close


def cmd_eval(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from toolgym.agents.eval.evaluate import evaluate
    from toolgym.agents.eval.runs import early_differences, load_eval_run
    from toolgym.agents.harness import get_harness
    from toolgym.agents.policies.factory import policy_factory
    from toolgym.agents.policies.spec import parse_policy_spec
    from toolgym.agents.policies.vllm_log import ENGINE_LOG
    from toolgym.core import SamplingParams
    from toolgym.registry import check_id

    import_user_modules(args.imports)
    check_id(args.env)
    env_kwargs = parse_env_args(args.env_arg, args.env)
    harnesses = [h.strip() for h in args.harness.split(",") if h.strip()]
    for name in harnesses:
        get_harness(name)
    if args.n < 1:
        raise ConfigError(f"n must be >= 1, got {args.n}")
    spec = parse_policy_spec(args.policy, model=args.model)
    loggers = _check_loggers(args)
    baseline = load_eval_run(args.baseline) if args.baseline is not None else None  # fail before the work
    if baseline is not None:
        differences = early_differences(baseline, args.env, env_kwargs, harnesses, args.seed)
        if differences:
            raise ConfigError(
                f"--baseline {args.baseline} ran other episodes: differs in {'; '.join(differences)}. Fix: repeat "
                "its --env, --env-arg, --harness, --n and --seed"
            )
    model_free = spec.model_free
    # model-free policies write whole turns (a long submit list) in byte tokens: no caps unless given
    max_tokens = args.max_tokens if args.max_tokens is not None else (1 << 20 if model_free else 96)
    max_total = (
        args.max_total_tokens if args.max_total_tokens is not None else (1 << 30 if model_free else 8192)
    )
    chat_format = args.chat_format
    from toolgym.chat_format_names import check_chat_format_name

    check_chat_format_name(chat_format, "--chat-format")
    if chat_format != "auto" and spec.engine in ("rule", "http"):
        raise ConfigError(
            f"--chat-format {chat_format} applies to model policies (hf, vllm, run:); {spec.text!r} "
            + (
                "writes its own turns"
                if spec.model_free
                else "is rendered by its server with the model's template"
            )
        )
    if args.out is not None:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    factory = policy_factory(
        spec,
        env_id=args.env,
        seed=args.seed,
        max_model_len=max_total,
        device=args.device,
        chat_format=chat_format,
        log_file=Path(args.out) / ENGINE_LOG if args.out is not None else None,
    )
    policy_info = (
        spec.describe() if chat_format == "auto" else {**spec.describe(), "chat_format": chat_format}
    )
    progress, stop_progress = episode_progress(f"eval {args.env}")

    try:
        factory()  # load the model now: a model that cannot load is an error before any output
        report = asyncio.run(
            evaluate(
                args.env,
                factory,
                harnesses,
                n=args.n,
                seed=args.seed,
                concurrency=args.concurrency,
                sampling=SamplingParams(max_tokens=max_tokens, temperature=args.temperature, seed=args.seed),
                max_total_tokens=max_total,
                out_dir=args.out,
                env_kwargs=env_kwargs,
                progress=progress,
                policy_label=spec.text if chat_format == "auto" else f"{spec.text} [{chat_format}]",
                policy_info=policy_info,
                restart=args.restart,
            )
        )
    finally:
        stop_progress()
        factory.close()
    table = Table(
        title=f"{report.env_id} · policy {report.policy} · n={len(report.task_ids)} · seed {report.seed}"
    )
    reward_keys = sorted({k for t in report.tracks for k in t.metrics if not k.startswith("use/")})
    for col in [
        "track",
        "success",
        *[k.removeprefix("reward/") for k in reward_keys],
        "tool calls",
        "tokens",
        "seconds",
        "infra err",
    ]:
        table.add_column(col, justify="left" if col == "track" else "right")
    for t in report.tracks:
        table.add_row(
            t.harness,
            f"{t.success:.3f}",
            *[
                f"{t.metrics.get(k, float(k == 'episode/segments')):.3f}" for k in reward_keys
            ],  # uncompacted: 1
            f"{t.tool_calls:.2f}",
            f"{t.tokens:.0f}",
            f"{t.seconds:.1f}",
            str(t.infra_errors),
        )
    Console(width=140).print(table)
    use_table = tool_use_table(report.tracks)
    if use_table is not None:
        Console(width=140).print(use_table)
    base = report.tracks[0].harness
    for name, (diff, low, high) in report.paired.items():
        print(
            f"paired reward difference {name} - {base}: {diff:+.3f} (95% bootstrap CI [{low:+.3f}, {high:+.3f}], n={len(report.task_ids)} tasks)"
        )
    if args.out is not None:
        from toolgym.agents.eval.results import write_evaluation_result

        result = write_evaluation_result(args.out)
        print(f"eval.json and trajectories written to {args.out}; compare: toolgym compare RUN_A {args.out}")
        print(f"result file (kilobytes; compares on any machine): {result}")
    if loggers:
        track_eval(loggers, args.out, report)
    if baseline is not None:
        from toolgym.agents.eval.runs import EvalRun, EvalSettings, compare_runs

        settings = EvalSettings.from_dict(report.settings)
        this = EvalRun(args.out, settings, "complete", report.trajectories, report.manifest)
        _print_comparison(compare_runs(baseline, this, seed=args.seed, allow=args.allow))
    return 0


def tool_use_table(tracks: Sequence[Any]) -> Any:
    """A rich table of each track's tool-use measures (``use/*``, :mod:`toolgym.tool_use`), or None
    when the environment measures none; a measure a track lacks shows as "-" (not measured)."""
    from rich.table import Table

    keys = sorted({k for t in tracks for k in t.metrics if k.startswith("use/")})
    if not keys:
        return None
    table = Table(title="tool use (means over episodes; toolgym.tool_use)")
    table.add_column("measure", justify="left")
    for t in tracks:
        table.add_column(t.harness, justify="right")
    for k in keys:  # one row a measure: every name shows whole, however many there are
        table.add_row(
            k.removeprefix("use/"), *(f"{t.metrics[k]:.3f}" if k in t.metrics else "-" for t in tracks)
        )
    return table


def _check_loggers(args: argparse.Namespace) -> tuple[str, ...]:
    from toolgym.records.trackers import check_trackers, parse_trackers

    loggers = parse_trackers(args.logger or "")
    if loggers and args.out is None:
        raise ConfigError("--logger writes into the run directory: give --out DIR as well")
    check_trackers(loggers)  # a missing package is an error before the evaluation, not after it
    return loggers


def track_eval(loggers: Sequence[str], out: Path, report: Any) -> None:
    """Send an evaluation's settings, per-track summary, paired differences and episodes to trackers."""
    from toolgym.records.trackers import open_trackers, trajectory_rows

    config = {"eval": report.settings, "manifest": report.manifest}
    trackers = open_trackers(loggers, out, config=config, kind="eval")
    try:
        metrics: dict[str, float] = {}
        for t in report.tracks:
            metrics.update({f"{t.harness}/success": t.success, f"{t.harness}/reward": t.reward})
            metrics.update({f"{t.harness}/{k}": v for k, v in t.metrics.items()})
            metrics.update({f"{t.harness}/tool_calls": t.tool_calls, f"{t.harness}/tokens": t.tokens})
            metrics[f"{t.harness}/infra_errors"] = float(t.infra_errors)
        base = report.tracks[0].harness
        for name, (diff, low, high) in report.paired.items():
            key = f"paired/{name}-{base}"
            metrics.update({f"{key}/diff": diff, f"{key}/low": low, f"{key}/high": high})
        trackers.log_metrics(0, metrics)
        episodes = [t for track in report.trajectories.values() for t in track]
        trackers.log_table("trajectories", 0, *trajectory_rows(episodes))
    finally:
        trackers.close()


def cmd_compare(args: argparse.Namespace) -> int:
    from toolgym.agents.eval.results import load_evaluation
    from toolgym.agents.eval.runs import compare_runs

    comparison = compare_runs(load_evaluation(args.run_a), load_evaluation(args.run_b), allow=args.allow)
    if args.json:
        print(comparison.to_json())
    else:
        _print_comparison(comparison)
    return 0


def _print_comparison(comparison: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"B - A  ·  A = {comparison.a}  ·  B = {comparison.b}")
    for col in ("track", "pairs", "reward A", "reward B", "B - A", "95% bootstrap CI", "infra dropped"):
        table.add_column(col, justify="left" if col == "track" else "right")
    for t in [*comparison.tracks, *([comparison.pooled] if comparison.pooled else [])]:
        table.add_row(
            t.harness,
            str(t.n),
            f"{t.reward_a:.3f}",
            f"{t.reward_b:.3f}",
            f"{t.diff:+.3f}",
            f"[{t.low:+.3f}, {t.high:+.3f}]",
            str(t.infra_dropped),
        )
    Console(width=140).print(table)
    for t in [*comparison.tracks, *([comparison.pooled] if comparison.pooled else [])]:
        unit = "tasks, tracks averaged" if t.harness == "pooled" else "episodes"
        print(
            f"paired reward difference B - A on {t.harness}: {t.diff:+.3f} "
            f"(95% bootstrap CI [{t.low:+.3f}, {t.high:+.3f}], n={t.n} {unit})"
        )
    if comparison.tool_use:
        use = Table(title="tool use, B - A (paired by task and seed; toolgym.tool_use)")
        for col in ("track", "measure", "pairs", "A", "B", "B - A", "95% bootstrap CI"):
            use.add_column(col, justify="left" if col in ("track", "measure") else "right")
        for m in comparison.tool_use:
            use.add_row(
                m.harness,
                m.measure.removeprefix("use/"),
                str(m.n),
                f"{m.a:.3f}",
                f"{m.b:.3f}",
                f"{m.diff:+.3f}",
                f"[{m.low:+.3f}, {m.high:+.3f}]",
            )
        Console(width=140).print(use)
    for note in comparison.notes:
        print(f"note: the runs differ in {note}")


def cmd_reverify(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from toolgym.agents.eval.reverify import RESULT, reverify_run

    bar = progress_bar()
    updaters: dict[str, Callable[[int, int], None]] = {}

    def progress(name: str, done: int, total: int) -> None:
        if name not in updaters:
            updaters[name] = bar_updater(bar, bar.add_task(f"replay {name}", total=total))
        updaters[name](done, total)

    try:
        report = reverify_run(
            args.run_dir, progress=progress, examples=args.examples, allow_import=args.allow_import
        )
    finally:
        bar.stop()
    table = Table(title=f"re-verification of {args.run_dir} with today's environments")
    for col in (
        "source",
        "episodes",
        "re-scored",
        "reward changed",
        "observations changed",
        "infra skipped",
        "errors",
    ):
        table.add_column(col, justify="left" if col == "source" else "right")
    means = Table(title="mean reward per track: stored -> today")
    for col in ("source", "track", "n", "stored", "today", "diff"):
        means.add_column(col, justify="left" if col in ("source", "track") else "right")
    for s in report.sources:
        table.add_row(
            s.name,
            str(s.episodes),
            str(s.rescored),
            str(s.changed),
            str(s.observation_changed),
            str(s.skipped_infra),
            str(len(s.errors)),
        )
        for harness, (n, old, new) in s.tracks.items():
            means.add_row(s.name, harness, str(int(n)), f"{old:.4f}", f"{new:.4f}", f"{new - old:+.4f}")
    console = Console(width=160)
    console.print(table)
    console.print(means)
    for s in report.sources:
        for e in s.examples:
            print(
                f"{s.name}: {e['harness']}/{e['task_id']} seed {e['seed']}: reward {e['old'][0]:.4f} ({e['old'][1]}) "
                f"-> {e['new'][0]:.4f} ({e['new'][1]})"
                + (f"; observation differs at {e['observation_diff']}" if e["observation_diff"] else "")
            )
        for error in s.errors[: args.examples]:
            print(f"{s.name}: ERROR {error}")
    print(f"written to {Path(args.run_dir) / RESULT}")
    return 1 if report.errors else 0


def cmd_audit_env(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from toolgym.envs.audit import audit_env

    import_user_modules(args.imports)
    env_kwargs = parse_env_args(args.env_arg, args.env_id)
    bar = progress_bar()
    progress = bar_updater(bar, bar.add_task(f"audit {args.env_id}", total=None))

    try:
        results = audit_env(
            args.env_id,
            n=args.n,
            seed=args.seed,
            threshold=args.threshold,
            env_kwargs=env_kwargs,
            progress=progress,
        )
    finally:
        bar.stop()
    rows = [r.to_dict() for r in results]
    if args.json:
        print(json.dumps({"env_id": args.env_id, "threshold": args.threshold, "exploits": rows}, indent=2))
    else:
        table = Table(title=f"exploit audit of {args.env_id}: share of tasks earning > {args.threshold}")
        columns = (
            "exploit",
            "tasks",
            "share",
            "mean reward",
            "max reward",
            "errors",
            "verdict",
            "what it tries",
        )
        for col in columns:
            table.add_column(
                col, justify="left" if col in ("exploit", "verdict", "what it tries") else "right"
            )
        for r in rows:
            table.add_row(
                r["exploit"],
                str(r["tasks"]),
                f"{r['share']:.0%}",
                f"{r['mean_reward']:.3f}",
                f"{r['max_reward']:.3f}",
                str(len(r["errors"])),
                r["verdict"],
                r["description"],
            )
        Console(width=160).print(table)
        for result in results:
            for error in result.errors[1:3]:  # the first is on the exploit's line below
                print(f"{result.exploit}: ERROR {error}")
        # NOTE: one line per exploit that does not pass, so the reason is read here, not off the table
        for verdict in ("fail", "accepted"):
            for result in results:
                if result.verdict == verdict:
                    print(result.line())
        failed = [r.exploit for r in results if r.verdict == "fail"]
        accepted = [r.exploit for r in results if r.verdict == "accepted"]
        note = f"; {len(accepted)} accepted by the environment ({', '.join(accepted)})" if accepted else ""
        if failed:
            print(f"audit failed: {len(failed)} of {len(results)} exploits fail ({', '.join(failed)}){note}")
        else:
            print(f"audit passed: no exploit earns reward without the task{note}")
    return 1 if any(r.verdict == "fail" for r in results) else 0
