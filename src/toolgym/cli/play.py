"""``toolgym play``: play an environment by hand, typing the agent's turns."""

from __future__ import annotations

import argparse
import json
import re

from toolgym.cli.eval_commands import import_user_modules, parse_env_args
from toolgym.errors import ConfigError

__all__ = ["cmd_play"]


def cmd_play(args: argparse.Namespace) -> int:
    from toolgym.registry import check_id, make

    import_user_modules(args.imports)
    check_id(args.env)
    try:
        env = make(args.env, **parse_env_args(args.env_arg, args.env))
    except TypeError as exc:
        raise ConfigError(f"{args.env} rejected its arguments ({exc}); fix the --env-arg values") from exc
    options = {"task_id": args.task_id} if args.task_id else None
    obs, info = env.reset(seed=args.seed, options=options)
    names = info["allowed_tools"]
    print(
        f"# {args.env} · task {info['task_id']} · tools: {', '.join(names)} · max turns {info['max_turns']}"
    )
    print("# Type a turn: raw text, a <tool_call>...</tool_call>, or the shorthand `TOOL {json arguments}`.")
    print("# End a multi-line turn with an empty line. :q quits, :reset starts a new episode.\n")
    _print_messages(obs)
    try:
        while True:
            turn = _read_turn()
            if turn is None or turn.strip() == ":q":
                break
            if turn.strip() == ":reset":
                obs, info = env.reset()
                _print_messages(obs)
                continue
            obs, reward, terminated, truncated, info = env.step(_expand_shorthand(turn, names))
            _print_messages(obs)
            if terminated or truncated:
                print(
                    f"# episode {'terminated' if terminated else 'truncated'} · reward {reward} · metrics {json.dumps(info.get('metrics', {}))}"
                )
                print("# :reset for another episode, :q to quit")
    finally:
        env.close()
    return 0


def _read_turn() -> str | None:
    lines: list[str] = []
    while True:
        try:
            line = input("agent> " if not lines else "...... ")
        except EOFError:
            return "\n".join(lines) if lines else None
        if not line and lines:
            return "\n".join(lines)
        if line.startswith(":") and not lines:
            return line
        if line:
            lines.append(line)
            if line.rstrip().endswith("</tool_call>") or re.match(r"^\w+\s*\{.*\}\s*$", line):
                return "\n".join(lines)


def _expand_shorthand(turn: str, tools: list[str]) -> str:
    match = re.match(r"^\s*(\w+)\s*(\{.*\})\s*$", turn, re.DOTALL)
    if match and match.group(1) in tools:
        return f'<tool_call>{{"name": "{match.group(1)}", "arguments": {match.group(2)}}}</tool_call>'
    return turn


def _print_messages(messages: list[dict[str, str]]) -> None:
    for message in messages:
        who = message["role"] + (f" ({message['name']})" if "name" in message else "")
        print(f"--- {who}\n{message['content']}\n")
