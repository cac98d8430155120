"""The ``toolgym`` command line.

The CLI is the composition root: it may import every subpackage (lazily, inside each command, so
``toolgym envs`` starts fast and a missing extra only matters to the command that needs it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from importlib import resources
from pathlib import Path
from typing import TypeAlias

from toolgym.cli.credit_command import add_credit_command
from toolgym.cli.eval_commands import (
    add_allow_import,
    cmd_audit_env,
    cmd_compare,
    cmd_eval,
    cmd_reverify,
    import_user_modules,
    parse_env_args,
)
from toolgym.cli.play import cmd_play
from toolgym.cli.results_commands import add_results_commands
from toolgym.errors import ConfigError, ToolgymError

POLICY_HELP = (
    "smollm2 (embedded model), scripted (model-free baseline), hf:PATH (local HF model dir or .gguf), "
    "run:DIR[@STEP] (a training run's newest or STEP's export), vllm:smollm2|vllm:PATH|vllm:run:DIR[@STEP] "
    "(in-process vLLM), http:URL (OpenAI-compatible server; needs --model)"
)


#: the ``toolgym`` command's sub-command table; each ``_NAME_parser`` adds its command to it
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if not sys.stderr.isatty():
        # a log file: Hugging Face's progress bars (model loading) would write carriage returns into it;
        # toolgym's own progress lines say how far each phase is
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ToolgymError as exc:
        print(f"toolgym: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("toolgym: interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    """The whole command line: the global options, then each command from its own ``_NAME_parser``."""
    parser = argparse.ArgumentParser(
        prog="toolgym", description="Multi-turn tool-use environments, evaluation and RL training."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(title="commands")
    _envs_parser(sub)
    _eval_parser(sub)
    _compare_parser(sub)
    _export_parser(sub)
    _checkpoint_parser(sub)
    _play_parser(sub)
    _serve_parser(sub)
    _mcp_parser(sub)
    _index_parser(sub)
    _sandbox_parser(sub)
    _train_parser(sub)
    _report_parser(sub)
    add_results_commands(sub)
    _reverify_parser(sub)
    add_credit_command(sub)
    _audit_env_parser(sub)
    _new_env_parser(sub)
    return parser


def _envs_parser(sub: Commands) -> None:
    p = sub.add_parser("envs", help="list registered environment ids")
    p.set_defaults(func=cmd_envs)


def _eval_parser(sub: Commands) -> None:
    p = sub.add_parser(
        "eval", help="evaluate a policy on an environment, bare and scaffold tracks side by side"
    )
    p.add_argument("--env", required=True, help="environment id, e.g. toolgym/SearchQA-v0")
    p.add_argument("--policy", default="smollm2", help=POLICY_HELP)
    p.add_argument("--model", default=None, help="served model name, for --policy http:URL only")
    p.add_argument(
        "--harness",
        default="bare,scaffold",
        help="comma-separated tracks: bare, scaffold, either with +compact or +summary "
        "(context compaction into new token segments), e.g. scaffold,scaffold+compact",
    )
    p.add_argument("--n", type=int, default=50, help="number of tasks (the same ones on every track)")
    p.add_argument("--seed", type=int, default=0, help="seed for task choice and episodes")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="run directory: eval.json (settings, summaries), trajectories per track; resumed if the "
        "settings match, refused if they differ",
    )
    p.add_argument(
        "--restart", action="store_true", help="clear --out's earlier evaluation instead of resuming"
    )
    p.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="an earlier `eval --out` run: also print the paired difference against it, per track",
    )
    p.add_argument("--concurrency", type=int, default=8, help="episodes in flight (the model batches them)")
    p.add_argument(
        "--device",
        default="cpu",
        help="where a transformers policy runs: cpu, cuda, cuda:1 (vLLM picks its own)",
    )
    p.add_argument(
        "--chat-format",
        default="auto",
        help="a model policy's chat format: auto (from the tokenizer, or the format a run: export "
        "recorded), hermes, llama3, mistral, harmony, template, template:CALLS (environments.md, Chat formats)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens per assistant turn (default 96; uncapped for the model-free scripted policy)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="token budget of an episode's context (default 8192; uncapped for the scripted policy)",
    )
    _add_logger_option(p)
    _add_env_options(p)
    _add_allow_option(p)
    p.set_defaults(func=cmd_eval)


def _compare_parser(sub: Commands) -> None:
    p = sub.add_parser(
        "compare",
        help="paired difference B - A of two evaluations on the same tasks and seeds: `eval --out` "
        "directories, result files (FILE or FILE#NAME) or run directories holding a result.json",
    )
    p.add_argument("run_a", type=Path, metavar="RUN_A", help="the baseline evaluation")
    p.add_argument("run_b", type=Path, metavar="RUN_B", help="the evaluation compared against it")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    _add_allow_option(p)
    p.set_defaults(func=cmd_compare)


def _export_parser(sub: Commands) -> None:
    p = sub.add_parser(
        "export", help="write a Hugging Face model directory from a training run's checkpoint (RUN/export/)"
    )
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("--keep", type=int, default=2, help="exports to keep in RUN_DIR/export (newest first)")
    p.set_defaults(func=cmd_export)


def _checkpoint_parser(sub: Commands) -> None:
    p = sub.add_parser("checkpoint", help="training checkpoints: convert one an older toolgym wrote")
    checkpoint = p.add_subparsers(title="checkpoint commands")
    p = checkpoint.add_parser(
        "upgrade",
        help="rewrite RUN_DIR/checkpoint.pt of an older toolgym as tensors and plain values (runs no code "
        "from the file; anything an older toolgym did not write is refused)",
    )
    p.add_argument("run_dir", type=Path)
    p.set_defaults(func=cmd_checkpoint_upgrade)


def _play_parser(sub: Commands) -> None:
    p = sub.add_parser("play", help="play an environment by hand: you type the agent's turns")
    p.add_argument("env", help="environment id")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task-id", default=None)
    _add_env_options(p)
    p.set_defaults(func=cmd_play)


def _serve_parser(sub: Commands) -> None:
    p = sub.add_parser(
        "serve", help="serve an environment over HTTP, one session per episode (client: make('http://...'))"
    )
    p.add_argument("env", help="environment id")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (non-loopback needs --token)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument(
        "--max-sessions", type=int, default=64, help="open episodes at once; more are refused (503)"
    )
    p.add_argument(
        "--session-timeout", type=float, default=600.0, help="seconds idle before a session is closed"
    )
    p.add_argument(
        "--token", default=None, help="bearer token every request must carry (default: $TOOLGYM_SERVE_TOKEN)"
    )
    p.add_argument(
        "--openenv",
        action="store_true",
        help="speak OpenEnv's protocol with OpenEnv's own server (extra toolgym[openenv]), same guards",
    )
    _add_env_options(p)
    p.set_defaults(func=cmd_serve)


def _mcp_parser(sub: Commands) -> None:
    p = sub.add_parser("mcp", help="serve an environment's tools as an MCP server over stdio")
    p.add_argument("env", help="environment id")
    p.add_argument("--task-id", default=None, help="the episode's task (default: the first)")
    p.add_argument("--seed", type=int, default=0)
    _add_env_options(p)
    p.set_defaults(func=cmd_mcp)


def _index_parser(sub: Commands) -> None:
    p = sub.add_parser("index", help="search indexes")
    isub = p.add_subparsers(title="index commands")
    b = isub.add_parser("build", help="build (or reuse) a cached search index from a JSONL corpus")
    b.add_argument("--corpus", type=Path, required=True, help='JSONL, one {"id", "title", "text"} per line')
    b.add_argument("--backend", default="default", help="default (in-process BM25) or pyserini (Lucene)")
    b.add_argument(
        "--retriever",
        default="bm25",
        help="bm25, dense (a sentence encoder) or hybrid (both: two indexes, out/bm25 and out/dense)",
    )
    b.add_argument("--encoder", default=None, help="dense encoder directory (default: all-MiniLM-L6-v2)")
    b.add_argument("--query-prefix", default=None, help="prepended to queries (e5: 'query: ')")
    b.add_argument("--passage-prefix", default=None, help="prepended to passages (e5: 'passage: ')")
    b.add_argument("--dtype", default="float32", help="dense embeddings: float32 or float16")
    b.add_argument("--out", type=Path, default=None, help="index directory (default: the cache)")
    b.set_defaults(func=cmd_index_build)


def _sandbox_parser(sub: Commands) -> None:
    p = sub.add_parser("sandbox", help="the Docker code sandbox")
    ssub = p.add_subparsers(title="sandbox commands")
    b = ssub.add_parser(
        "build", help="build the sandbox image offline (debootstrap + docker import); skips if present"
    )
    b.set_defaults(func=cmd_sandbox_build)


def _train_parser(sub: Commands) -> None:
    p = sub.add_parser(
        "train", help="train a policy with the async GRPO trainer (resumes from DIR's checkpoint)"
    )
    p.add_argument("--config", default=None, help="TOML config file, or the name of a shipped config (demo)")
    p.add_argument("--out", type=Path, default=Path("runs/train"), help="run directory")
    p.add_argument(
        "--arms",
        default=None,
        help="TOML arms file, or the name of a shipped one (curriculum, compaction, mixtures, and the GPU-sized "
        "compaction-gpu, mixtures-gpu): train each "
        "arm into OUT/<arm>, then pair every arm with the baseline arm on the held-out set",
    )
    p.add_argument(
        "--arm-workers",
        type=int,
        default=1,
        metavar="N",
        help="with --arms: train up to N arms at once, side by side on Ray (default 1: one after another)",
    )
    p.add_argument(
        "--backend",
        choices=("asyncio", "ray"),
        default=None,
        help="where environments run (same as train.rollouts.backend=...): in-process asyncio, or Ray actors",
    )
    p.add_argument(
        "--learners",
        type=int,
        default=None,
        metavar="N",
        help="learner processes sharing each step's gradient (same as train.learners.count=N; gloo on CPU)",
    )
    p.add_argument(
        "--help-config",
        nargs="?",
        const="text",
        choices=("text", "json"),
        default=None,
        help="list every config field with its type, default and help (json: a JSON Schema for editors)",
    )
    _add_logger_option(p)
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.optim.lr=1e-5"
    )
    p.set_defaults(func=cmd_train)


def _report_parser(sub: Commands) -> None:
    p = sub.add_parser(
        "report",
        help="write RUN_DIR/report.html: curves and a trajectory viewer (an arms set: every arm's curves "
        "and the paired table)",
    )
    p.add_argument("run_dir", type=Path)
    p.set_defaults(func=cmd_report)


def _reverify_parser(sub: Commands) -> None:
    p = sub.add_parser(
        "reverify",
        help="re-score a run's stored trajectories with today's environment and verifier (no policy)",
    )
    p.add_argument("run_dir", type=Path, help="a `toolgym train --out` or `toolgym eval --out` directory")
    p.add_argument("--examples", type=int, default=5, help="changed episodes to show per source")
    add_allow_import(p)
    p.set_defaults(func=cmd_reverify)


def _audit_env_parser(sub: Commands) -> None:
    p = sub.add_parser(
        "audit-env", help="play scripted exploits against an environment: reward to be had without the task"
    )
    p.add_argument("env_id", metavar="ENV_ID")
    p.add_argument(
        "--n", type=int, default=20, help="tasks (a seeded choice; every exploit plays the same ones)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threshold", type=float, default=0.2, help="a task counts when an exploit earns more")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    _add_env_options(p)
    p.set_defaults(func=cmd_audit_env)


def _new_env_parser(sub: Commands) -> None:
    p = sub.add_parser("new-env", help="write a minimal environment (module + test) to start from")
    p.add_argument("name", help="environment name, e.g. Weather")
    p.add_argument("--dir", type=Path, default=Path("."), help="where to write the files")
    p.set_defaults(func=cmd_new_env)


def _add_logger_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--logger",
        default=None,
        metavar="NAMES",
        help="also send metrics, config and trajectories to experiment trackers: tensorboard, wandb "
        "(offline), comma-separated; the run directory's files and report need none",
    )


def _add_allow_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="FIELD",
        help="a manifest field that may differ between the runs (e.g. toolgym.version; a prefix allows what is "
        "under it; 'manifest' accepts runs without one)",
    )


def _add_env_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--env-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment constructor argument (JSON value)",
    )
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import a module that registers your environment",
    )


# ----------------------------------------------------------------------------- commands
def cmd_envs(args: argparse.Namespace) -> int:
    import gymnasium

    from toolgym.registry import ENVIRONMENTS, register_all

    register_all()
    width = max(len(e.id) for e in ENVIRONMENTS)
    for entry in ENVIRONMENTS:
        assert entry.id in gymnasium.registry
        print(f"{entry.id:<{width}}  {entry.description}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from toolgym.training.export import export_from_checkpoint

    path = export_from_checkpoint(args.run_dir, keep=args.keep)
    print(f"export written to {path}; evaluate it: toolgym eval --policy run:{args.run_dir} ...")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from toolgym.serving.server import serve_command

    import_user_modules(args.imports)
    serve_command(
        args.env,
        parse_env_args(args.env_arg, args.env),
        host=args.host,
        port=args.port,
        max_sessions=args.max_sessions,
        session_timeout=args.session_timeout,
        token=args.token or os.environ.get("TOOLGYM_SERVE_TOKEN") or None,
        openenv=args.openenv,
    )
    return 0


def cmd_mcp(args: argparse.Namespace) -> int:
    from toolgym.registry import check_id
    from toolgym.serving.mcp import mcp_command

    import_user_modules(args.imports)
    check_id(args.env)
    mcp_command(args.env, parse_env_args(args.env_arg, args.env), task_id=args.task_id, seed=args.seed)
    return 0


def cmd_index_build(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from toolgym.tools.search.retriever import RetrieverSettings, retriever_command

    settings = RetrieverSettings.from_args(
        args.retriever, args.backend, args.encoder, args.query_prefix, args.passage_prefix
    )
    settings = replace(settings, dense=replace(settings.dense, dtype=args.dtype))
    for path in retriever_command(args.corpus, settings, args.out):
        print(f"index ready: {path}")
    return 0


def cmd_sandbox_build(args: argparse.Namespace) -> int:
    from toolgym.tools.sandbox.image import build_command

    build_command()
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    if args.help_config:
        from toolgym.training.config.help import config_schema, help_text

        print(json.dumps(config_schema(), indent=2) if args.help_config == "json" else help_text())
        return 0
    from toolgym.training.commands import train_command

    backend = [f"train.rollouts.backend={args.backend}"] if args.backend else []
    if args.learners is not None:
        backend.append(f"train.learners.count={args.learners}")
    if args.logger is not None:
        from toolgym.records.trackers import parse_trackers

        backend.append(f"train.loggers={json.dumps(list(parse_trackers(args.logger)))}")
    if args.arms is not None:
        from toolgym.training.experiments.arms_run import arms_command

        run_dir = arms_command(
            args.arms, args.config, [*args.overrides, *backend], args.out, workers=args.arm_workers
        )
        print(f"arms written to {run_dir}; next: toolgym report {run_dir}")
        return 0
    run_dir = train_command(args.config, [*args.overrides, *backend], args.out)
    print(f"run written to {run_dir}; next: toolgym report {run_dir}")
    return 0


def cmd_checkpoint_upgrade(args: argparse.Namespace) -> int:
    from toolgym.training.checkpoint import upgrade_checkpoint

    if upgrade_checkpoint(args.run_dir):
        print(f"checkpoint upgraded: {args.run_dir / 'checkpoint.pt'}; rerun the command that trains into it")
    else:
        print(f"{args.run_dir / 'checkpoint.pt'} is already in today's form: nothing to do")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from toolgym.training.experiments.arms_report import is_arms_dir, write_arms_report
    from toolgym.training.experiments.report import write_report

    if is_arms_dir(args.run_dir):
        print(f"report: {write_arms_report(args.run_dir)}")
        return 0

    print(f"report: {write_report(args.run_dir)}")
    return 0


def cmd_new_env(args: argparse.Namespace) -> int:
    name = args.name.strip()
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", name):
        raise ConfigError(f"environment name must be letters and digits starting with a letter, got {name!r}")
    class_name = name[0].upper() + name[1:]
    module = re.sub(r"(?<!^)(?=[A-Z])", "_", class_name).lower() + "_env"
    args.dir.mkdir(parents=True, exist_ok=True)
    targets = {
        args.dir / f"{module}.py": "env_module.py.txt",
        args.dir / f"test_{module}.py": "env_test.py.txt",
    }
    for path in targets:
        if path.exists():
            raise ConfigError(f"{path} exists; choose another name or directory")
    for path, template in targets.items():
        text = render_template(template, class_name, module)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    print(
        f"{module}.py is a template: a working calculator environment, so that its tests pass as written. "
        "Replace its tool, verifier and tasks (each marked in the file) with yours, and its tests with yours"
    )
    print(f"next: python -m pytest {args.dir / f'test_{module}.py'}")
    return 0


def render_template(template: str, name: str, module: str) -> str:
    """The ``new-env`` skeleton with its placeholders filled (also what environments.md shows)."""
    text = (resources.files("toolgym.cli") / "templates" / template).read_text(encoding="utf-8")
    return text.replace("{{Name}}", name).replace("{{module}}", module)
