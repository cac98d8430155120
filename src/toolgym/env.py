"""The thin environment base: turn bookkeeping for every multi-turn tool environment.

A concrete environment supplies tasks, its tools and a verifier; :class:`ToolEnv` does the rest:
seeded task choice, the tool-set restriction (``options["tools"]``, the curriculum's lever), tools
that unlock mid-episode (``options["unlocks"]``, :mod:`toolgym.unlocks`), parsing the assistant's
raw text, running calls under their timeouts at the one try/except boundary, turning the model's
mistakes into observations, the turn limit (truncation), and the sparse terminal reward. The
observation and action spaces live in :mod:`toolgym.spaces` (importable from here too).

Episode protocol:
    * ``reset`` returns a system message listing the allowed tools as JSON schemas in the default call
      format, an optional worked example (:meth:`ToolEnv.demonstration`), and the task prompt as the
      last (user) message. ``info["tools"]`` holds the same
      schemas as structured data (for OpenAI-style servers). ``options["call_format"]`` (a name in
      :mod:`toolgym.call_formats`; the rollout passes the policy's) writes the tool list, the worked
      example and the parsing of every action in that model family's call syntax (default ``hermes``).
    * ``step(action)`` takes the assistant's raw text. A call to a *terminal* tool (``answer``,
      ``submit``) ends the episode, and so does an ``<answer>...</answer>`` tag or, by default, a turn
      with no tool call at all (its text is the answer). Otherwise the observation is one ``tool``
      message per call or error, and the reward is 0.
    * ``options["unlocks"]`` (rules, see :mod:`toolgym.unlocks`) withholds tools from the system
      prompt; when a rule fires at the end of a step, that step's observation ends with one ``user``
      message holding the new tools' schemas, ``info["unlocked"]`` lists them (``tool``, ``turn``,
      ``mode``), and the episode's metrics record ``tool/<name>/unlocked_turn`` and ``env/unlocks``.
      Earlier messages are never changed, so the tokens sampled so far stay exact.
    * The reward is the verifier's, computed once, at the terminal step. ``options["score_as"]`` (a
      task id; the shuffled-rewards control, ``train.reward_control``) scores the episode against that
      task's reference instead of its own.

Failures (the rule is in :mod:`toolgym.errors`). :meth:`ToolEnv._run_tool` and
:meth:`ToolEnv._ascore` are the one boundary between an episode and what can fail under it:

    * a :class:`~toolgym.errors.ToolError` (the model's mistake) becomes the call's observation;
    * an :class:`~toolgym.errors.InfraError` from a tool call or from the verifier is retried
      ``retry.retries`` times, waiting ``retry.backoff_s * 2**k`` before retry ``k``; each retry
      counts in ``env/infra_retries``. When the retries run out the error propagates with the
      episode's metrics attached (``episode_metrics``) and the rollout marks the trajectory
      ``infra_error``; a verifier's becomes :class:`~toolgym.errors.VerificationUnavailable`;
    * anything else (a verifier bug, a bug of ours) propagates at once, never retried or scored; a
      package missing under a tool (or under the parser's validation) is a
      :class:`~toolgym.errors.MissingDependencyError` naming it, never an ``Error:`` shown to the model.

A retried ``python`` call may run twice if its first try ran but its result was lost; a retried
verification is harmless because verifiers are pure.

The async methods (``areset``/``astep``) are the primary API; ``reset``/``step`` run them on a private
event loop owned by the environment.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import gymnasium

from toolgym.call_formats import get_call_format, translate_calls
from toolgym.core import Message, Score, Task, Tool, Verifier, call_tool, tool_schema
from toolgym.errors import (
    ConfigError,
    InfraError,
    MissingDependencyError,
    ToolError,
    ToolgymError,
    VerificationUnavailable,
    did_you_mean,
)
from toolgym.parsing import HERMES, CallFormat, ParsedTurn, parse
from toolgym.spaces import MessagesSpace, TextSpace
from toolgym.tool_use import ToolUse
from toolgym.unlocks import UnlockTracker, announcement, check_rules, parse_rules, split_tools

if TYPE_CHECKING:
    import asyncio

# asyncio and concurrent.futures are imported where they are used: `import toolgym` (and with it every
# `toolgym.tools...` import, e.g. a search index opened in a fresh process) should not pay for them.

__all__ = ["MessagesSpace", "RetryPolicy", "TextSpace", "ToolEnv"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Longest tool observation kept; longer outputs are cut with a note saying how much was dropped.
MAX_OBSERVATION_CHARS = 8_000


@dataclass(frozen=True)
class RetryPolicy:
    """How often an infrastructure failure of a tool or verifier call is retried before giving up.

    Attributes:
        retries: retries after the first try (0 = give up at once).
        backoff_s: wait before the first retry; doubles for each further one (``backoff_s * 2**k``).
            The default (2 retries, 0.5 s then 1 s) rides out a container restart or a brief engine
            hiccup without holding an episode for long when the failure is permanent.
    """

    retries: int = 2
    backoff_s: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.retries, int) or self.retries < 0:
            raise ConfigError(f"infra retries must be an integer >= 0, got {self.retries!r}")
        if self.backoff_s < 0:
            raise ConfigError(f"infra back-off must be >= 0 seconds, got {self.backoff_s!r}")

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (0-based)."""
        return self.backoff_s * 2.0**retry


class ToolEnv(gymnasium.Env[list[Message], str]):
    """Base class of toolgym environments (see the module docstring for the protocol).

    Subclasses set ``tasks`` and ``verifier`` in ``__init__`` and implement :meth:`episode_tools`.
    They may override :meth:`close_episode` to release per-episode resources (a sandbox container).
    ``retry`` (a :class:`RetryPolicy`, default 2 retries from 0.5 s) may be replaced on any instance.

    Args:
        max_turns: assistant turns before the episode is truncated.
        render_mode: ``"ansi"`` renders the transcript as text.
        max_calls_per_turn: tool calls run per turn; extra calls get an error observation.
        plain_text_is_answer: when true, a turn with no tool call and no parse error ends the episode
            with its text as the answer.
    """

    metadata: dict[str, Any] = {"render_modes": ["ansi"], "render_fps": 1}
    #: Short description shown by ``toolgym envs``.
    description: ClassVar[str] = ""

    def __init__(
        self,
        *,
        max_turns: int = 8,
        render_mode: str | None = None,
        max_calls_per_turn: int = 1,
        plain_text_is_answer: bool = True,
    ) -> None:
        if max_turns < 1:
            raise ConfigError(f"max_turns must be >= 1, got {max_turns}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ConfigError(
                f"render_mode must be one of {self.metadata['render_modes']}, got {render_mode!r}"
            )
        self.max_turns = max_turns
        self.render_mode = render_mode
        self.max_calls_per_turn = max_calls_per_turn
        self.plain_text_is_answer = plain_text_is_answer
        self.observation_space = MessagesSpace()
        self.action_space = TextSpace()
        self.tasks: Sequence[Task] = ()
        self.verifier: Verifier | None = None
        self.retry = RetryPolicy()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: Task | None = None
        self._tools: dict[str, Tool] = {}
        self._withheld: dict[str, Tool] = {}  # tools of unlock rules that have not fired yet
        self._unlocks: UnlockTracker | None = None
        self._calls: CallFormat = HERMES  # the episode's call syntax (options["call_format"])
        self._history: list[Message] = []
        self._turn = 0
        self._done = True
        self._metrics: dict[str, float] = {}
        self._tool_log: list[ToolUse] = []  # the episode's non-terminal calls (tool_use_metrics)
        self._score_as: Task | None = None  # options["score_as"]: the task whose reference scores it
        self._closed = False

    # ----------------------------------------------------------------- subclass hooks
    async def episode_tools(self, task: Task) -> Sequence[Tool]:
        """All tools available for ``task`` (the terminal one included). Called at every reset."""
        raise NotImplementedError(f"{type(self).__name__} must implement episode_tools()")

    async def close_episode(self) -> None:
        """Release per-episode resources. Called before each reset and by ``close``; idempotent."""

    def tool_use_metrics(self, task: Task, calls: Sequence[ToolUse], answer: Any) -> Mapping[str, float]:
        """What the episode did with its tools (:mod:`toolgym.tool_use`: the names, and the shared search
        measures), called once when it ends; ``answer`` is the terminal answer (None when it ran out of
        turns). Each key lands in the episode's metrics as ``use/<name>``. Default: none (not measured)."""
        return {}

    def demonstration(self, allowed_tools: Sequence[str]) -> list[Message]:
        """A worked example shown between the tool list and the task (default: none).

        Small models copy the call format far more reliably from one example turn than from a
        description (SmolLM2-135M: 0 of 12 well-formed calls without, 7 of 12 with one). Return a
        ``user`` message and the ``assistant`` turn that answers it, using only ``allowed_tools``.
        """
        return []

    # ----------------------------------------------------------------- properties
    @property
    def task(self) -> Task:
        if self._task is None:
            raise ToolgymError("no task yet: call reset() first")
        return self._task

    @property
    def allowed_tools(self) -> tuple[str, ...]:
        return tuple(self._tools)

    @property
    def episode_tool_objects(self) -> tuple[Tool, ...]:
        """The current episode's tools (after ``reset``), in the order the prompt lists them."""
        return tuple(self._tools.values())

    @property
    def history(self) -> list[Message]:
        """The transcript of the current episode, as the environment saw it."""
        return copy.deepcopy(self._history)

    def task_ids(self) -> list[str]:
        return [t.id for t in self.tasks]

    @property
    def episode_metrics(self) -> dict[str, float]:
        """The current episode's metrics so far (the terminal step's ``info["metrics"]`` holds them all)."""
        return dict(self._metrics)

    # ----------------------------------------------------------------- async API
    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        super().reset(seed=seed)
        if self._closed:
            raise ToolgymError("this environment is closed; make a new one")
        await self.close_episode()
        options = dict(options or {})
        known = ["task_id", "task_index", "tools", "unlocks", "call_format", "score_as"]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ConfigError(
                f"unknown reset option {unknown[0]!r}.{did_you_mean(unknown[0], known)} "
                f"Known options: {', '.join(known)}"
            )
        self._calls = get_call_format(options.get("call_format", HERMES.name))
        self._task = self._choose_task(options)
        self._score_as = self._scoring_task(options["score_as"]) if "score_as" in options else None
        tools = {t.name: t for t in await self.episode_tools(self._task)}
        allowed = self._restrict(tools, options.get("tools"))
        rules = parse_rules(options["unlocks"]) if "unlocks" in options else ()
        check_rules(rules, tools, options.get("tools"), self.max_turns)
        self._tools, shown, self._withheld = split_tools(rules, tools, allowed)
        self._unlocks = UnlockTracker(rules) if rules else None
        self._turn, self._done, self._metrics, self._tool_log = 0, False, {}, []
        if self._unlocks is not None:
            self._metrics["env/unlocks"] = 0.0
        schemas = [tool_schema(t) for t in shown.values()]
        obs: list[Message] = [
            {"role": "system", "content": self._calls.tools_prompt(schemas)},
            *translate_calls(self.demonstration(list(shown)), self._calls),
            {"role": "user", "content": self._task.prompt},
        ]
        self._history = copy.deepcopy(obs)
        info = {
            "task_id": self._task.id,
            "tools": schemas,
            "allowed_tools": list(self._tools),
            "max_turns": self.max_turns,
        }
        if self._unlocks is not None:
            info["unlocks"] = [rule.to_dict() for rule in self._unlocks.rules]
        return obs, info

    async def astep(self, action: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        if self._done:
            raise ToolgymError("the episode is over (or never started): call reset() before step()")
        self._turn += 1
        self._history.append(
            {"role": "assistant", "content": action if isinstance(action, str) else repr(action)}
        )
        parsed = parse(
            action,
            {name: t.parameters for name, t in self._tools.items()},
            max_calls=self.max_calls_per_turn,
            call_format=self._calls,
        )
        obs: list[Message] = []
        for err in parsed.errors:
            self._count("env/parse_errors")
            if self._unlocks is not None and err.tool in self._tools:
                self._unlocks.record(err.tool, ok=False)
            obs.append({"role": "tool", "name": err.tool or "error", "content": err.observation()})
        terminated, answer = False, None
        for call in parsed.calls:
            tool = self._tools[call.name]
            self._count(f"tool/{call.name}/calls")
            if tool.terminal:
                terminated, answer = True, _terminal_answer(tool, call.arguments)
                break
            errors_before = self._metrics.get(f"tool/{call.name}/errors", 0.0)
            output = await self._run_tool(tool, call.arguments)
            obs.append({"role": "tool", "name": call.name, "content": output})
            self._tool_log.append(ToolUse(self._turn, call.name, copy.deepcopy(dict(call.arguments)), output))
            if self._unlocks is not None:
                self._unlocks.record(
                    call.name, ok=self._metrics.get(f"tool/{call.name}/errors", 0.0) == errors_before
                )
        if not terminated and not parsed.calls:
            terminated, answer = self._text_answer(parsed)
        info: dict[str, Any] = {"turn": self._turn}
        if not terminated and self._turn < self.max_turns:
            obs.extend(self._fire_unlocks(info))
        self._history.extend(copy.deepcopy(obs))
        reward, truncated = 0.0, False
        if terminated:
            score = await self._ascore(answer)
            reward = float(score.reward)
            info["answer"] = copy.deepcopy(answer)
        elif self._turn >= self.max_turns:
            truncated = True
            self._metrics["env/truncated"] = 1.0
        if terminated or truncated:
            self._done = True
            self._metrics["env/turns"] = float(self._turn)
            measures = self.tool_use_metrics(self.task, tuple(self._tool_log), answer)
            self._metrics.update(
                {k if k.startswith("use/") else f"use/{k}": float(v) for k, v in measures.items()}
            )
            info["metrics"] = dict(self._metrics)
        return obs, reward, terminated, truncated, info

    # ----------------------------------------------------------------- sync API (gymnasium)
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        result: tuple[list[Message], dict[str, Any]] = self._run_sync(self.areset(seed=seed, options=options))
        return result

    def step(self, action: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        result: tuple[list[Message], float, bool, bool, dict[str, Any]] = self._run_sync(self.astep(action))
        return result

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        return "\n\n".join(
            f"[{m['role']}{'/' + m['name'] if 'name' in m else ''}]\n{m['content']}" for m in self._history
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._run_sync(self.close_episode(), allow_closed=True)
        finally:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.close()
            self._loop = None

    async def aclose(self) -> None:
        """Async twin of :meth:`close` for environments driven from a running event loop."""
        if not self._closed:
            await self.close_episode()
            self._closed = True

    # ----------------------------------------------------------------- internals
    def _choose_task(self, options: dict[str, Any]) -> Task:
        if not self.tasks:
            raise ConfigError(f"{type(self).__name__} has no tasks")
        if "task_id" in options:
            wanted = str(options["task_id"])
            for task in self.tasks:
                if task.id == wanted:
                    return task
            raise ConfigError(f"no task with id {wanted!r}.{did_you_mean(wanted, self.task_ids())}")
        if "task_index" in options:
            index = options["task_index"]
            if not isinstance(index, int) or not 0 <= index < len(self.tasks):
                raise ConfigError(f"task_index must be an int in [0, {len(self.tasks)}), got {index!r}")
            return self.tasks[index]
        return self.tasks[int(self.np_random.integers(len(self.tasks)))]

    @staticmethod
    def _restrict(tools: dict[str, Tool], allowed: Any) -> dict[str, Tool]:
        """Keep only the allowed tools; terminal tools always stay (an episode must be able to end)."""
        if allowed is None:
            return tools
        if isinstance(allowed, str) or not all(isinstance(a, str) for a in allowed):
            raise ConfigError(f'options["tools"] must be a list of tool names, got {allowed!r}')
        for name in allowed:
            if name not in tools:
                raise ConfigError(
                    f"unknown tool {name!r} in options['tools'].{did_you_mean(name, tools)} Available: {', '.join(tools)}"
                )
        return {n: t for n, t in tools.items() if n in set(allowed) or t.terminal}

    def _fire_unlocks(self, info: dict[str, Any]) -> list[Message]:
        """Unlock the tools whose rules hold after this turn: the announcement, and ``info``/metrics."""
        if self._unlocks is None:
            return []
        due = self._unlocks.due(self._turn)
        if not due:
            return []
        schemas = []
        for rule in due:
            tool = self._withheld.pop(rule.tool) if rule.tool in self._withheld else self._tools[rule.tool]
            self._tools[rule.tool] = tool
            schemas.append(tool_schema(tool))
            self._metrics[f"tool/{rule.tool}/unlocked_turn"] = float(self._turn)
            self._count("env/unlocks")
            log.debug("turn %d: %s", self._turn, rule.describe())
        info["unlocked"] = [{"tool": r.tool, "turn": self._turn, "mode": r.mode} for r in due]
        info["tools"] = schemas
        info["allowed_tools"] = list(self._tools)
        # NOTE (token exactness): the schemas arrive as a new message after this step's results; the
        # system prompt and every earlier message stay as they were, so nothing sampled is re-rendered.
        return [{"role": "user", "content": announcement(schemas)}]

    async def _retrying(self, what: str, attempt: Callable[[], Awaitable[_T]]) -> _T:
        """Run ``attempt``, retrying an :class:`InfraError` per ``self.retry``; then re-raise it.

        The error that finally propagates carries the episode's metrics (``episode_metrics``), so an
        ``infra_error`` trajectory still records how many retries were spent.
        """
        for retry in range(self.retry.retries + 1):
            try:
                return await attempt()
            except InfraError as err:
                if retry == self.retry.retries:
                    err.episode_metrics = dict(self._metrics)
                    raise
                delay = self.retry.delay(retry)
                self._count("env/infra_retries")
                log.warning(
                    "%s failed (%s: %s); retry %d of %d in %.2g s",
                    what,
                    type(err).__name__,
                    err,
                    retry + 1,
                    self.retry.retries,
                    delay,
                )
                import asyncio

                await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    async def _run_tool(self, tool: Tool, arguments: Any) -> str:
        # NOTE: the one try/except boundary: the model's mistakes (ToolError) become observations;
        # InfraError is retried, then propagates; anything else (a bug) propagates at once, a missing
        # package as the MissingDependencyError that names it (never the model's "Error:").
        try:
            output = await self._retrying(f"tool {tool.name!r}", lambda: call_tool(tool, arguments))
        except ToolError as err:
            self._count(f"tool/{tool.name}/errors")
            if err.tool is None:
                err.tool = tool.name
            return err.observation()
        except ImportError as exc:
            raise MissingDependencyError.from_import_error(exc, f"The tool {tool.name!r}") from exc
        if len(output) > MAX_OBSERVATION_CHARS:
            cut = len(output) - MAX_OBSERVATION_CHARS
            output = output[:MAX_OBSERVATION_CHARS] + f"\n[... {cut} more characters not shown]"
        return output

    def _text_answer(self, parsed: ParsedTurn) -> tuple[bool, Any]:
        if parsed.answer is not None:
            return True, parsed.answer
        if self.plain_text_is_answer and not parsed.errors:
            return True, parsed.content
        return False, None

    def _scoring_task(self, task_id: Any) -> Task:
        """The task whose reference scores this episode (``options["score_as"]``, the shuffled-rewards
        control): this episode's task with that task's reference."""
        others = {t.id: t for t in self.tasks}
        if not isinstance(task_id, str) or task_id not in others:
            raise ConfigError(f"reset option score_as = {task_id!r} is not a task of this environment")
        return dataclasses.replace(self.task, reference=others[task_id].reference)

    async def _ascore(self, answer: Any) -> Score:
        """The verifier's score; its infrastructure failures are retried, its bugs raise at once."""
        verifier = self.verifier
        if verifier is None:
            raise ConfigError(f"{type(self).__name__} has no verifier")
        task, history = self._score_as or self.task, self.history

        async def attempt() -> Score:
            return verifier.score(task, answer, history)

        try:
            score = await self._retrying("verification", attempt)
        except VerificationUnavailable:
            raise
        except InfraError as err:
            unavailable = VerificationUnavailable(
                f"the verifier of {task.id} could not run after {self.retry.retries + 1} tries: "
                f"{type(err).__name__}: {err}"
            )
            unavailable.episode_metrics = err.episode_metrics
            raise unavailable from err
        self._metrics.update(score.metrics)
        return score

    def _count(self, key: str) -> None:
        self._metrics[key] = self._metrics.get(key, 0.0) + 1.0

    def _run_sync(self, coro: Coroutine[Any, Any, Any], *, allow_closed: bool = False) -> Any:
        if self._closed and not allow_closed:
            coro.close()
            raise ToolgymError("this environment is closed; make a new one")
        import asyncio
        import concurrent.futures

        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self._loop.run_until_complete(coro)
        # Called from inside a running loop (a notebook): run on our loop in a helper thread.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(self._loop.run_until_complete, coro).result()


def _terminal_answer(tool: Tool, arguments: Any) -> Any:
    """A terminal tool's answer: its single argument's value, or the whole argument dict."""
    props = list(tool.parameters.get("properties", {}))
    if len(props) == 1:
        return copy.deepcopy(arguments.get(props[0]))
    return copy.deepcopy(dict(arguments))
