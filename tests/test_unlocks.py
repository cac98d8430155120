"""Tools that unlock mid-episode (``reset(options={"unlocks": [...]})``).

Rules firing on the real SearchQA and a small env, bad input at reset, the checker, exact tokens.
"""

from __future__ import annotations

import json
from typing import Any

import gymnasium
import pytest

import toolgym  # noqa: F401  (registers the shipped environments)
from toolgym import FunctionTool, Score, Task, ToolEnv
from toolgym.core import tool_schema
from toolgym.errors import ConfigError, ToolCallError
from toolgym.parsing import format_tool_call
from toolgym.unlocks import UnlockRule, parse_rules

OPEN_AFTER_TWO_FAILED_SEARCHES = {"tool": "open", "after": {"failed_calls": {"tool": "search", "n": 2}}}


def call(name: str, **arguments: Any) -> str:
    return format_tool_call(name, arguments)


class Exact:
    def score(self, task: Task, answer: object, trajectory: object) -> Score:
        return Score(float(str(answer) == str(task.reference)), {})


def _search(q: str) -> str:
    if not q.strip():
        raise ToolCallError("empty query", tool="search")
    return f"[d1] result for {q}"


class Library(ToolEnv):
    """Four tools: search (fails on an empty query), open, note and the terminal answer."""

    def __init__(self, max_turns: int = 6) -> None:
        super().__init__(max_turns=max_turns)
        self.tasks = [Task("t0", "Find it.", "it")]
        self.verifier = Exact()

    async def episode_tools(self, task: Task) -> list[FunctionTool]:
        def params(*names: str) -> dict[str, Any]:
            return {
                "type": "object",
                "properties": {n: {"type": "string"} for n in names},
                "required": list(names),
            }

        return [
            FunctionTool("search", "Search.", params("q"), fn=_search),
            FunctionTool("open", "Open a document.", params("doc"), fn=lambda doc: f"text of {doc}"),
            FunctionTool("note", "Write a note.", params("x"), fn=lambda x: "noted"),
            FunctionTool("answer", "Answer.", params("answer"), terminal=True),
        ]


@pytest.fixture
def library():
    env = Library()
    yield env
    env.close()


@pytest.fixture(scope="module")
def search_qa():
    env = gymnasium.make("toolgym/SearchQA-v0", max_turns=7)
    yield env
    env.close()


def schema_line(env: gymnasium.Env, tool: str) -> str:
    """The JSON line the system prompt shows for ``tool`` when it is allowed from the start."""
    obs, _ = env.reset(options={"task_index": 0})
    lines = [line for line in obs[0]["content"].splitlines() if f'"name": "{tool}"' in line]
    assert len(lines) == 1
    return lines[0]


# ----------------------------------------------------------------- rules firing, on the real SearchQA
def test_open_unlocks_after_two_failed_searches_on_search_qa(search_qa):
    open_line = schema_line(search_qa, "open")
    obs, info = search_qa.reset(options={"task_index": 0, "unlocks": [OPEN_AFTER_TWO_FAILED_SEARCHES]})
    assert open_line not in obs[0]["content"] and '"name": "open"' not in obs[0]["content"]
    assert "open" not in info["allowed_tools"] and info["unlocks"] == [OPEN_AFTER_TWO_FAILED_SEARCHES]

    obs, *_ = search_qa.step(call("search", query="capital of France", k=1))  # a success: no unlock
    doc_id = obs[0]["content"].split("]")[0].lstrip("[")
    assert obs[0]["role"] == "tool" and not obs[0]["content"].startswith("Error")

    obs, reward, terminated, truncated, info = search_qa.step(call("open", doc_id=doc_id))
    assert obs[0]["content"].startswith("Error: unknown tool 'open'")  # not callable yet
    assert "unlocked" not in info

    obs, _, _, _, info = search_qa.step(call("search", query="   "))  # failed search 1
    assert obs[0]["content"].startswith("Error: search") and len(obs) == 1 and "unlocked" not in info
    before = search_qa.unwrapped.history

    obs, reward, terminated, truncated, info = search_qa.step(call("search", query="x", k=99))  # failed 2
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert [m["role"] for m in obs] == ["tool", "user"]  # the schema follows the step's tool results
    assert obs[0]["content"].startswith("Error: search")
    assert open_line in obs[1]["content"].splitlines()  # the system prompt's format, line for line
    assert info["unlocked"] == [{"tool": "open", "turn": 4, "mode": "unlock"}]
    assert "open" in info["allowed_tools"]
    assert [s["function"]["name"] for s in info["tools"]] == ["open"]
    after = search_qa.unwrapped.history
    assert after[: len(before)] == before  # nothing shown so far was changed

    obs, *_ = search_qa.step(call("open", doc_id=doc_id))
    assert obs[0]["name"] == "open" and not obs[0]["content"].startswith("Error")
    *_, terminated, _, info = search_qa.step(call("answer", answer="Paris"))
    assert terminated
    assert info["metrics"]["tool/open/unlocked_turn"] == 4.0 and info["metrics"]["env/unlocks"] == 1.0


def test_first_success_ignores_failures_and_fires_once(library):
    rule = {"tool": "open", "after": {"first_success": "search"}}
    library.reset(options={"unlocks": [rule]})
    obs, *_, info = library.step(call("search", q=""))
    assert len(obs) == 1 and "unlocked" not in info
    obs, *_, info = library.step(call("search", q="a"))
    assert info["unlocked"] == [{"tool": "open", "turn": 2, "mode": "unlock"}]
    assert '"name": "open"' in obs[-1]["content"]
    obs, *_, info = library.step(call("search", q="b"))
    assert len(obs) == 1 and "unlocked" not in info  # a rule fires once
    assert library.allowed_tools == ("search", "note", "answer", "open")


def test_turn_rules_and_several_unlocks_in_one_step(library):
    rules = [{"tool": "open", "after": {"turn": 2}}, {"tool": "note", "after": {"turn": 2}}]
    obs, info = library.reset(options={"unlocks": rules})
    assert info["allowed_tools"] == ["search", "answer"]
    obs, *_, info = library.step(call("note", x="hi"))
    assert obs[0]["content"].startswith("Error: unknown tool 'note'") and len(obs) == 1
    obs, *_, info = library.step(call("search", q="a"))
    assert [u["tool"] for u in info["unlocked"]] == ["open", "note"]
    assert obs[-1]["content"].startswith("New tools available from now on: open, note.")
    assert obs[-1]["content"].count('{"type": "function"') == 2


def test_announce_mode_is_callable_before_its_schema_is_shown(library):
    rule = {"tool": "note", "after": {"turn": 1}, "mode": "announce"}
    obs, info = library.reset(options={"unlocks": [rule]})
    assert '"name": "note"' not in obs[0]["content"] and "note" in info["allowed_tools"]
    obs, *_, info = library.step(call("note", x="hi"))
    assert obs[0]["content"] == "noted"  # callable before the announcement
    assert info["unlocked"] == [{"tool": "note", "turn": 1, "mode": "announce"}]
    note = next(t for t in library.episode_tool_objects if t.name == "note")
    assert json.dumps(tool_schema(note), ensure_ascii=False) in obs[-1]["content"].splitlines()


def test_no_announcement_on_the_terminal_or_truncating_step():
    env = Library(max_turns=3)
    env.reset(options={"unlocks": [{"tool": "open", "after": {"failed_calls": {"tool": "search", "n": 1}}}]})
    env.step(call("note", x="a"))
    env.step(call("note", x="b"))
    obs, _, _, truncated, info = env.step(call("search", q=""))  # the rule holds, but the episode is over
    assert truncated and len(obs) == 1 and "unlocked" not in info
    assert "tool/open/unlocked_turn" not in info["metrics"] and info["metrics"]["env/unlocks"] == 0.0
    env.close()


def test_without_rules_reset_and_step_are_unchanged(library):
    obs, info = library.reset()
    assert "unlocks" not in info and '"name": "open"' in obs[0]["content"]
    *_, info = library.step(call("answer", answer="it"))
    assert "env/unlocks" not in info["metrics"]


def test_rules_round_trip_through_their_json_form():
    specs = [
        OPEN_AFTER_TWO_FAILED_SEARCHES,
        {"tool": "note", "after": {"first_success": "search"}},
        {"tool": "x", "after": {"turn": 3}, "mode": "announce"},
    ]
    rules = parse_rules(specs)
    assert rules[0] == UnlockRule("open", "failed_calls", n=2, watch="search")
    assert [r.to_dict() for r in rules] == specs
    assert rules[0].describe() == "unlock open after 2 failed calls of search"


# ----------------------------------------------------------------- bad input: clear errors at reset
@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"unlocks": [{"tool": "opn", "after": {"turn": 1}}]},
            r"unknown tool 'opn' to unlock\. Did you mean 'open'\?",
        ),
        (
            {"unlocks": [{"tool": "open", "after": {"turns": 1}}]},
            r"unknown rule kind 'turns'\. Did you mean 'turn'\?",
        ),
        (
            {"unlocks": [{"tool": "open", "aftr": {"turn": 1}}]},
            r"unknown key 'aftr'\. Did you mean 'after'\?",
        ),
        (
            {"unlocks": [{"tool": "open", "after": {"turn": 1}, "mode": "anounce"}]},
            r"Did you mean 'announce'\?",
        ),
        (
            {"tools": ["search", "open"], "unlocks": [{"tool": "open", "after": {"turn": 1}}]},
            r"'open' is already allowed by options\['tools'\]",
        ),
        ({"unlocks": [{"tool": "answer", "after": {"turn": 1}}]}, "'answer' is the terminal tool"),
        ({"unlocks": [{"tool": "open", "after": {"turn": 0}}]}, "'turn' must be a whole number >= 1, got 0"),
        (
            {"unlocks": [{"tool": "open", "after": {"turn": True}}]},
            "'turn' must be a whole number >= 1, got True",
        ),
        ({"unlocks": [{"tool": "open", "after": {"turn": 6}}]}, r"turn must be below max_turns \(6\)"),
        (
            {"unlocks": [{"tool": "open", "after": {"failed_calls": {"tool": "search", "n": "3"}}}]},
            r"failed_calls\.n must be a whole number >= 1, got '3'",
        ),
        (
            {"unlocks": [{"tool": "open", "after": {"failed_calls": {"tool": "search", "n": -1}}}]},
            "failed_calls.n must be a whole number >= 1, got -1",
        ),
        (
            {"unlocks": [{"tool": "open", "after": {"failed_calls": {"tool": "search"}}}]},
            r'failed_calls must be \{"tool": <name>, "n": <count>\}',
        ),
        (
            {"unlocks": [{"tool": "open", "after": {"turn": 1, "first_success": "search"}}]},
            "exactly one condition",
        ),
        ({"unlocks": [{"tool": "open", "after": {"first_success": "serch"}}]}, r"Did you mean 'search'\?"),
        (
            {"tools": ["note"], "unlocks": [{"tool": "open", "after": {"first_success": "search"}}]},
            "can never fire: 'search' cannot be called",
        ),
        ({"unlocks": [{"tool": "open", "after": {"first_success": "open"}}]}, "can never fire"),
        (
            {"unlocks": [{"tool": "open", "after": {"turn": 1}}, {"tool": "open", "after": {"turn": 2}}]},
            "two rules unlock 'open'",
        ),
        ({"unlocks": {"tool": "open", "after": {"turn": 1}}}, "must be a list of rules"),
        ({"unlocks": ["open"]}, r"options\['unlocks'\]\[0\] must be an object"),
        ({"unlock": []}, r"unknown reset option 'unlock'\. Did you mean 'unlocks'\?"),
    ],
)
def test_bad_unlock_rules_fail_at_reset(library, options, message):
    with pytest.raises(ConfigError, match=message):
        library.reset(options=options)


def test_unknown_tool_on_a_shipped_env_names_its_tools(search_qa):
    with pytest.raises(
        ConfigError, match=r"unknown tool 'read' to unlock\..*Available: search, open, answer"
    ):
        search_qa.reset(options={"unlocks": [{"tool": "read", "after": {"turn": 1}}]})


# ----------------------------------------------------------------- token exactness, with the embedded model
@pytest.fixture(scope="module")
def smollm2():
    from toolgym.agents.policies.hf import HFPolicy

    policy = HFPolicy()
    yield policy
    policy.close()


@pytest.mark.model
async def test_tokens_before_an_unlock_are_unchanged(smollm2, search_qa):
    """The unlock appends its schema: every token before it, sampled ones included, stays byte-identical."""
    from toolgym.agents.harness import get_harness
    from toolgym.agents.policies.base import ScriptedPolicy
    from toolgym.agents.rollout import run_episode

    script = [
        call("search", query="capital of France", k=1),
        call("search", query=" "),  # a failed search: rule A fires here, after turn 2
        call("open", doc_id="wk00001"),
        call("answer", answer="Paris"),
    ]
    options = {
        "task_index": 0,
        "unlocks": [{"tool": "open", "after": {"failed_calls": {"tool": "search", "n": 1}}}],
    }
    later = {"task_index": 0, "unlocks": [{"tool": "open", "after": {"turn": 3}}]}  # same prompt, fires later

    async def episode(opts: dict) -> Any:
        # The scripted turns are tokenised by the model's tokenizer and rendered by ChatPolicy.render,
        # the method HFPolicy renders with.
        policy = ScriptedPolicy(script, tokenizer=smollm2.tokenizer)
        return await run_episode(search_qa, policy, get_harness("bare"), seed=0, options=opts)

    unlocked, control = await episode(options), await episode(later)
    assert (
        unlocked.metrics["tool/open/unlocked_turn"] == 2.0
        and control.metrics["tool/open/unlocked_turn"] == 3.0
    )

    # The conversation up to (and including) the action that fired the rule, rendered by the policy.
    fired_at = next(i for i, m in enumerate(unlocked.messages) if m["content"].startswith("New tool"))
    before = smollm2.render(list(unlocked.messages[: fired_at - 2]))  # up to the turn-2 prompt
    after = smollm2.render(list(unlocked.messages[: fired_at + 1]))  # the unlock observation included
    assert len(after) > len(before) and after[: len(before)] == before
    assert (
        smollm2.tokenizer.decode(after[: len(before)]).encode() == smollm2.tokenizer.decode(before).encode()
    )
    assert '"name": "open"' in smollm2.tokenizer.decode(after[len(before) :])

    # The episode's own token sequence (rendered chunk by chunk as it ran) starts with the same tokens,
    # and equals the control episode's until the turn-2 action's last sampled token.
    assert list(unlocked.token_ids[: len(before)]) == before
    ones = [i for i, m in enumerate(unlocked.loss_mask) if m == 1]
    turn2_end = [i for i in ones if i + 1 < len(unlocked.loss_mask) and unlocked.loss_mask[i + 1] == 0][1] + 1
    assert unlocked.token_ids[:turn2_end] == control.token_ids[:turn2_end]
    assert unlocked.token_ids[turn2_end:] != control.token_ids[turn2_end:]
    assert unlocked.messages[:fired_at] == control.messages[:fired_at]


# ----------------------------------------------------------------- the checker knows the option
class IgnoresUnlocks(Library):
    async def areset(self, *, seed: int | None = None, options: dict | None = None):
        options = {k: v for k, v in (options or {}).items() if k != "unlocks"}
        return await super().areset(seed=seed, options=options)


def _registered(cls: type, env_id: str) -> gymnasium.Env:
    if env_id in gymnasium.registry:
        del gymnasium.registry[env_id]
    gymnasium.register(id=env_id, entry_point=cls)
    return gymnasium.make(env_id)


def test_check_env_checks_unlocks():
    from toolgym.envs import EnvCheckError, check_env

    check_env(_registered(Library, "toolgym-check/Library-v0"), skip_gymnasium=True)
    with pytest.raises(EnvCheckError, match="a tool with an unlock rule must be withheld at reset"):
        check_env(_registered(IgnoresUnlocks, "toolgym-check/IgnoresUnlocks-v0"), skip_gymnasium=True)
