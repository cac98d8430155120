"""Tools that unlock mid-episode: the rule format, its checks, and the per-episode tracker.

``reset(options={"unlocks": [...]})`` withholds some tools at the start of an episode and unlocks (or
only announces) each one when its rule fires. A rule is a small JSON object::

    {"tool": "open", "after": {"failed_calls": {"tool": "search", "n": 3}}}   # 3 failed searches
    {"tool": "open", "after": {"first_success": "search"}}                    # first good search
    {"tool": "open", "after": {"turn": 2}, "mode": "announce"}                # after turn 2

``after`` holds exactly one condition:

* ``{"turn": N}`` — after the N-th assistant turn (``1 <= N < max_turns``);
* ``{"failed_calls": {"tool": T, "n": N}}`` — after N failed calls of ``T``: calls whose observation
  is an ``Error:`` (arguments that break the schema, or a :class:`~toolgym.errors.ToolError` from the
  tool itself);
* ``{"first_success": T}`` — after the first call of ``T`` that returned without an error.

``mode`` is ``"unlock"`` (the default: the tool cannot be called before the rule fires; a call is an
``unknown tool`` observation) or ``"announce"`` (the tool can be called all along, but its schema is
only shown when the rule fires). Either way the tool is left out of the system prompt, and when the
rule fires at the end of a step its schema arrives as one ``user`` message appended after that step's
tool results (:func:`announcement`, the ``<tools>`` format of the system prompt). Earlier messages are
never changed, so the tokens of the conversation so far, sampled ones included, stay exactly as they
were.

Bad input is a :class:`~toolgym.errors.ConfigError` at ``reset`` (:func:`check_rules`): an unknown
tool or rule kind (with "did you mean"), a rule for a terminal tool or for a tool ``options["tools"]``
already allows, a second rule for one tool, malformed counts, a turn the episode never gets past, a
rule that watches a tool the episode can never call.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from toolgym.core import Tool
from toolgym.errors import ConfigError, did_you_mean

__all__ = [
    "KINDS",
    "MODES",
    "UnlockRule",
    "UnlockTracker",
    "announcement",
    "check_rules",
    "is_announcement",
    "parse_rule",
    "parse_rules",
    "split_tools",
]

#: The conditions a rule's ``after`` may hold (exactly one).
KINDS = ("turn", "failed_calls", "first_success")
#: ``unlock``: not callable before the rule fires; ``announce``: callable all along, shown when it fires.
MODES = ("unlock", "announce")
_RULE_KEYS = ("tool", "after", "mode")


@dataclass(frozen=True)
class UnlockRule:
    """One parsed rule: unlock (or announce) ``tool`` once ``kind`` holds.

    Attributes:
        tool: the tool the rule unlocks.
        kind: one of :data:`KINDS`.
        n: the turn (``turn``), the number of failed calls (``failed_calls``); 1 for ``first_success``.
        watch: the tool whose calls are counted (``failed_calls``, ``first_success``); ``""`` for ``turn``.
        mode: one of :data:`MODES`.
    """

    tool: str
    kind: str
    n: int = 1
    watch: str = ""
    mode: str = "unlock"

    def to_dict(self) -> dict[str, Any]:
        """The rule in its JSON form (what :func:`parse_rules` reads back)."""
        after: dict[str, Any]
        if self.kind == "turn":
            after = {"turn": self.n}
        elif self.kind == "failed_calls":
            after = {"failed_calls": {"tool": self.watch, "n": self.n}}
        else:
            after = {"first_success": self.watch}
        out: dict[str, Any] = {"tool": self.tool, "after": after}
        if self.mode != "unlock":
            out["mode"] = self.mode
        return out

    def describe(self) -> str:
        """Plain words, for logs: ``open after 3 failed calls of search``."""
        if self.kind == "turn":
            when = f"after turn {self.n}"
        elif self.kind == "failed_calls":
            when = f"after {self.n} failed call{'s' if self.n != 1 else ''} of {self.watch}"
        else:
            when = f"after the first successful call of {self.watch}"
        return f"{self.mode} {self.tool} {when}"


def _count(value: Any, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {what} must be a whole number >= 1, got {value!r}")
    return value


def _name(value: Any, what: str, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: {what} must be a tool name (a non-empty string), got {value!r}")
    return value


def parse_rule(spec: Any, where: str = "unlock rule") -> UnlockRule:
    """One rule from its JSON form; a malformed one is a :class:`ConfigError` saying what to write."""
    if not isinstance(spec, Mapping):
        raise ConfigError(
            f'{where} must be an object like {{"tool": "open", "after": {{"turn": 2}}}}, got {spec!r}'
        )
    for key in spec:
        if key not in _RULE_KEYS:
            raise ConfigError(
                f"{where}: unknown key {key!r}.{did_you_mean(str(key), _RULE_KEYS)} "
                f"Keys: {', '.join(_RULE_KEYS)}"
            )
    if "tool" not in spec or "after" not in spec:
        raise ConfigError(f"{where} needs 'tool' (what to unlock) and 'after' (when), got {dict(spec)!r}")
    tool = _name(spec["tool"], "'tool'", where)
    mode = spec.get("mode", "unlock")
    if mode not in MODES:
        raise ConfigError(
            f"{where}: unknown mode {mode!r}.{did_you_mean(str(mode), MODES)} Modes: {', '.join(MODES)}"
        )
    after = spec["after"]
    if not isinstance(after, Mapping) or len(after) != 1:
        raise ConfigError(
            f"{where}: 'after' must hold exactly one condition ({', '.join(KINDS)}), got {after!r}"
        )
    kind, arg = next(iter(after.items()))
    if kind not in KINDS:
        raise ConfigError(
            f"{where}: unknown rule kind {kind!r}.{did_you_mean(str(kind), KINDS)} Kinds: {', '.join(KINDS)}"
        )
    if kind == "turn":
        return UnlockRule(tool, kind, n=_count(arg, "'turn'", where), mode=mode)
    if kind == "first_success":
        return UnlockRule(tool, kind, watch=_name(arg, "'first_success'", where), mode=mode)
    if not isinstance(arg, Mapping) or set(arg) != {"tool", "n"}:
        raise ConfigError(f'{where}: failed_calls must be {{"tool": <name>, "n": <count>}}, got {arg!r}')
    watch = _name(arg["tool"], "failed_calls.tool", where)
    return UnlockRule(tool, kind, n=_count(arg["n"], "failed_calls.n", where), watch=watch, mode=mode)


def parse_rules(specs: Any, where: str = "options['unlocks']") -> tuple[UnlockRule, ...]:
    """A list of rules; one tool may have one rule only."""
    if isinstance(specs, str | Mapping) or not isinstance(specs, Sequence):
        raise ConfigError(f"{where} must be a list of rules, got {specs!r}")
    rules = tuple(parse_rule(spec, f"{where}[{i}]") for i, spec in enumerate(specs))
    seen: set[str] = set()
    for rule in rules:
        if rule.tool in seen:
            raise ConfigError(f"{where}: two rules unlock {rule.tool!r}; give each tool one rule")
        seen.add(rule.tool)
    return rules


def check_rules(
    rules: Sequence[UnlockRule],
    tools: Mapping[str, Tool],
    allowed: Sequence[str] | None,
    max_turns: int,
    where: str = "options['unlocks']",
) -> None:
    """Check ``rules`` against an episode: its tools, the explicit ``options["tools"]`` and ``max_turns``."""
    ruled = {rule.tool for rule in rules}
    for rule in rules:
        if rule.tool not in tools:
            raise ConfigError(
                f"{where}: unknown tool {rule.tool!r} to unlock.{did_you_mean(rule.tool, tools)} "
                f"Available: {', '.join(tools)}"
            )
        if tools[rule.tool].terminal:
            raise ConfigError(
                f"{where}: {rule.tool!r} is the terminal tool, allowed from the start (an episode must "
                "be able to end): drop its rule"
            )
        if allowed is not None and rule.tool in allowed:
            raise ConfigError(
                f"{where}: {rule.tool!r} is already allowed by options['tools'], so its rule would "
                "change nothing: leave it out of options['tools'] (ruled tools are withheld until their "
                "rule fires) or drop the rule"
            )
        if rule.kind == "turn" and rule.n >= max_turns:
            raise ConfigError(
                f"{where}: {rule.describe()}: turn must be below max_turns ({max_turns}), or the "
                "episode ends before the tool can be used"
            )
        if rule.watch and rule.watch not in tools:
            raise ConfigError(
                f"{where}: {rule.tool!r} waits on unknown tool "
                f"{rule.watch!r}.{did_you_mean(rule.watch, tools)} Available: {', '.join(tools)}"
            )
    # Which rules can ever fire: start from the tools callable at reset, add what each rule unlocks.
    callable_now = {
        name
        for name, tool in tools.items()
        if (allowed is None or name in allowed or tool.terminal)
        and (name not in ruled or _rule_of(rules, name).mode == "announce")
    } | {r.tool for r in rules if r.kind == "turn"}
    pending = [r for r in rules if r.watch]
    grew = True
    while grew:
        grew = False
        for rule in list(pending):
            if rule.watch in callable_now:
                callable_now.add(rule.tool)
                pending.remove(rule)
                grew = True
    if pending:
        rule = pending[0]
        raise ConfigError(
            f"{where}: {rule.describe()} can never fire: {rule.watch!r} cannot be called in this "
            "episode (add it to options['tools'] or give it a rule that can fire)"
        )


def split_tools(
    rules: Sequence[UnlockRule], tools: Mapping[str, Tool], allowed: Mapping[str, Tool]
) -> tuple[dict[str, Tool], dict[str, Tool], dict[str, Tool]]:
    """An episode's tools at reset: ``(callable, shown in the prompt, withheld until their rule fires)``.

    ``allowed`` is the set after ``options["tools"]``; a ruled tool is left out of the prompt, and an
    ``unlock`` rule's tool is also withheld (an ``announce`` rule's is callable from the start).
    """
    callable_now, withheld = dict(allowed), {}
    for rule in rules:
        if rule.mode == "unlock":
            callable_now.pop(rule.tool, None)
            withheld[rule.tool] = tools[rule.tool]
        else:
            callable_now[rule.tool] = tools[rule.tool]
    ruled = {rule.tool for rule in rules}
    shown = {name: tool for name, tool in allowed.items() if name not in ruled}
    return callable_now, shown, withheld


def _rule_of(rules: Sequence[UnlockRule], tool: str) -> UnlockRule:
    return next(r for r in rules if r.tool == tool)


ANNOUNCEMENT_HEADS = ("New tool available from now on: ", "New tools available from now on: ")


def announcement(schemas: Sequence[Mapping[str, Any]]) -> str:
    """The message that shows newly unlocked tools, in the ``<tools>`` format of the system prompt."""
    names = ", ".join(str(s["function"]["name"]) for s in schemas)
    return "\n".join(
        [
            f"{ANNOUNCEMENT_HEADS[len(schemas) > 1]}{names}. "
            "Described as JSON schemas inside <tools></tools>:",
            "<tools>",
            *(json.dumps(s, ensure_ascii=False) for s in schemas),
            "</tools>",
        ]
    )


def is_announcement(message: Mapping[str, Any]) -> bool:
    """Whether a message is an unlock's announcement (a context compaction keeps these verbatim)."""
    return message.get("role") == "user" and str(message.get("content", "")).startswith(ANNOUNCEMENT_HEADS)


@dataclass
class UnlockTracker:
    """One episode's rules: what has been counted, and which rules have fired (at which turn).

    The environment reports each call's outcome (:meth:`record`) and asks at the end of each step which
    rules are now due (:meth:`due`); a rule fires once.
    """

    rules: tuple[UnlockRule, ...]
    failures: dict[str, int] = field(default_factory=dict)
    successes: dict[str, int] = field(default_factory=dict)
    fired: dict[str, int] = field(default_factory=dict)

    def withheld(self) -> set[str]:
        """Tools not callable yet (``unlock`` rules that have not fired)."""
        return {r.tool for r in self.rules if r.mode == "unlock" and r.tool not in self.fired}

    def record(self, tool: str, ok: bool) -> None:
        counts = self.successes if ok else self.failures
        counts[tool] = counts.get(tool, 0) + 1

    def due(self, turn: int) -> list[UnlockRule]:
        """Rules whose condition holds after ``turn`` and that have not fired; marks them fired."""
        out = []
        for rule in self.rules:
            if rule.tool in self.fired:
                continue
            if rule.kind == "turn":
                ready = turn >= rule.n
            elif rule.kind == "failed_calls":
                ready = self.failures.get(rule.watch, 0) >= rule.n
            else:
                ready = self.successes.get(rule.watch, 0) >= 1
            if ready:
                self.fired[rule.tool] = turn
                out.append(rule)
        return out
