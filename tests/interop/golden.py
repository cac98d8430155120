"""Golden traces: scripted episodes of each shipped environment, recorded once, replayed on every path.

Each script is a fixed list of assistant turns (well-formed and malformed calls, tool errors,
truncation, terminal answers). :func:`play` runs them against an environment built by a callable and
returns every observation, reward, flag and info; :func:`canonical` turns that into the bytes a golden
file holds. Run ``python tests/interop/golden.py`` to record the files again, only after a deliberate
environment change (which also bumps the environment's version) or a fix that makes a tool keep its
documented contract (say which in the commit: the default search backend returning exactly Lucene's
hits changed two SearchQA search results here without a version bump).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden"


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


HAS_CLOSE = """from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    ordered = sorted(numbers)
    return any(b - a < threshold for a, b in zip(ordered, ordered[1:]))
"""

#: env id -> episodes: (seed, reset options, assistant turns)
SCRIPTS: dict[str, list[tuple[int, dict[str, Any], list[str]]]] = {
    "toolgym/SearchQA-v0": [
        (
            0,
            {"task_index": 0},
            [call("search", query="Panthers defense points"), call("answer", answer="308")],
        ),
        (
            1,
            {"task_index": 3},
            [
                '<tool_call>{"name": "search", "arguments": {"query": </tool_call>',  # malformed JSON
                call("lookup", query="x"),  # unknown tool
                call("search", query=7),  # wrong argument type
                "The answer is <answer>Paris</answer>",  # a plain-text answer
            ],
        ),
        (2, {"task_index": 5}, [call("search", query=f"question {i}") for i in range(6)]),  # truncated
        (3, {"task_index": 7, "tools": ["answer"]}, [call("search", query="q"), call("answer", answer="")]),
    ],
    "toolgym/ArxivRefs-v0": [
        (
            0,
            {"task_index": 0},
            [
                call("search_papers", query="zeros of derivatives of random polynomials", k=5),
                call("read_paper", paper_id="no-such-paper"),  # a tool error
                call("search_papers", query="x", k=99),  # out-of-range argument
                call("submit", paper_ids=["258356ec33", "2ba6e96dc4", "0000000000"]),
            ],
        ),
        (1, {"task_index": 2}, ["I cannot find them.", call("submit", paper_ids=[])]),
    ],
    "toolgym/CodeExec-v0": [
        (
            0,
            {"task_id": "HumanEval/0"},
            [
                call("python", code="print(sorted([3, 1, 2]))"),
                call("python", code="raise ValueError('boom')"),  # an error inside the sandbox
                call("submit", code=HAS_CLOSE),
            ],
        ),
        (
            1,
            {"task_id": "HumanEval/0"},
            ['<tool_call>{"name": "submit"}</tool_call>', call("submit", code="x = (")],
        ),
    ],
}

#: info keys whose values are measurements, not results (left out of the comparison)
_VOLATILE = ("time/", "seconds")


def _stable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if not any(part in k for part in _VOLATILE)}
    if isinstance(value, list | tuple):
        return [_stable(v) for v in value]
    return value


def play(make: Callable[[], Any], env_id: str) -> list[dict[str, Any]]:
    """Every scripted episode of ``env_id`` on the environment ``make()`` builds (closed afterwards)."""
    env = make()
    try:
        episodes = []
        for seed, options, turns in SCRIPTS[env_id]:
            obs, info = env.reset(seed=seed, options=options)
            steps = []
            for action in turns:
                o, reward, terminated, truncated, step_info = env.step(action)
                steps.append(
                    {
                        "action": action,
                        "observation": o,
                        "reward": reward,
                        "terminated": terminated,
                        "truncated": truncated,
                        "info": step_info,
                    }
                )
                if terminated or truncated:
                    break
            episodes.append(
                {
                    "seed": seed,
                    "options": options,
                    "reset": {"observation": obs, "info": info},
                    "steps": steps,
                }
            )
        return _stable(json.loads(json.dumps(episodes, default=str)))
    finally:
        env.close()


def canonical(episodes: list[dict[str, Any]]) -> str:
    return json.dumps(episodes, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def golden_path(env_id: str) -> Path:
    return GOLDEN / (env_id.split("/")[-1] + ".json")


if __name__ == "__main__":
    from toolgym.registry import make as make_env

    for env_id in sys.argv[1:] or SCRIPTS:
        golden_path(env_id).write_text(
            canonical(play(lambda e=env_id: make_env(e), env_id)), encoding="utf-8"
        )
        print(f"recorded {golden_path(env_id)}")
