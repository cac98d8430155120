"""The hidden-test verifier of ``toolgym/CodeExec-v0``: scores submitted code without trusting it.

Threat model: the candidate is adversarial and runs with the same knowledge as this file. Rule: whatever
the candidate does, it is scored; only failures it could not have caused are infrastructure errors
(:class:`~toolgym.errors.SandboxError`), and a failure of the harness itself is a
:class:`~toolgym.errors.VerifierError`, never reward 0.

* The tests are evaluated on the host, with the data set's own (trusted) test code; only the calls to
  the candidate's functions run in the sandbox. Expected values never enter a container.
* HumanEval tests are ``check(candidate)`` functions. We run ``check`` on the host with a proxy for
  ``candidate``, its ``assert`` statements rewritten so each one is counted instead of stopping the
  function. A first pass records every call's arguments (the proxy answers with a placeholder);
  the recorded calls are executed in a fresh container; the next pass answers each call with its
  recorded result and counts passing asserts. Calls whose arguments depend on earlier results are
  found in the next pass (up to :data:`MAX_ROUNDS`). Random inputs are reproduced by seeding.
* MBPP tests are ``assert`` lines. Each operand of the assert's comparison that mentions the
  candidate's names (``f(x)`` in ``assert f(x) == 3``) is shipped as source to the container
  (together with ``test_setup_code``, which only builds inputs); the comparison runs on the host.
* In the container, the trusted runner (``programs/runner.py``) runs as the container's root
  with only CAP_SETUID/CAP_SETGID/CAP_KILL, and starts one isolated interpreter per call
  (``programs/driver.py``) as the unprivileged sandbox user: a different uid, so the candidate
  cannot signal, stop, trace or read the runner (``os.kill(os.getppid(), ...)``, ``kill(-1)``,
  ``killpg`` all fail with EPERM). Each call has a fresh directory, a CPU-time limit, the first place
  in line for the OOM killer, and writes its result, tagged with a per-call random nonce, to a pipe.
  After each call every leftover process is killed. Results cross to the host as plain data
  (:mod:`toolgym.envs.code_exec.codec`), so an object whose ``__eq__`` always answers True never reaches a
  comparison: anything else arrives as an opaque value equal to nothing. The runner's report is
  tagged with its own nonce; the candidate's exit status and printed output are never read.
* The container is fresh from the warm pool: the episode's session container is never reused, so
  files planted during the episode (``sitecustomize.py``, ``conftest.py``) do not exist there.

Consequently the only way to make an assert pass is to return the value it expects. A candidate can
crash or kill its own interpreter: its call counts as failed. When the runner brings no report, the
cause decides: out of memory, output cap or the whole budget spent are the candidate's doing (all its
calls fail); a container stopped from outside, or a runner killed by a signal without an OOM, is a
:class:`~toolgym.errors.SandboxError`; anything else (the runner crashed) is a
:class:`~toolgym.errors.VerifierError`, as is a report the runner flags as a harness error.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import json
import logging
import math
import random
import re
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from toolgym.core import Message, Score, Task
from toolgym.envs.code_exec.codec import dec, enc
from toolgym.envs.code_exec.data import find_task
from toolgym.errors import SandboxError, VerifierError
from toolgym.tools.sandbox import DockerSandbox, ExecResult, new_nonce, program_source

__all__ = ["MAX_ROUNDS", "HiddenTestVerifier", "default_sandbox", "extract_code", "score_submission"]

log = logging.getLogger(__name__)

#: Passes over a HumanEval ``check`` to discover calls that depend on earlier results.
MAX_ROUNDS = 4
#: Call statuses (from the runner) that count as the candidate running out of time.
_TIMEOUT_STATUSES = ("timeout", "cpu_limit")


def _program(name: str) -> str:
    return program_source("toolgym.envs.code_exec", name)


# --------------------------------------------------------------------------- value codec (host side)


class _Opaque:
    """A candidate's value that is not plain data: equal to nothing, not even itself."""

    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return False

    def __ne__(self, other: object) -> bool:
        return True

    def __repr__(self) -> str:
        return "<opaque candidate value>"


def _decode(encoded: Any) -> Any:
    return dec(encoded, _Opaque)


# --------------------------------------------------------------------------- host-side test logic

# Host-side evaluation reseeds the global random module (HumanEval draws inputs from it); one at a time.
_HOST_LOCK = threading.Lock()


class _Pending:
    """What the candidate proxy answers before a call's result is known."""


class _CandidateRaised(Exception):
    """The candidate's call raised (or produced no result) in the container."""


@dataclass
class _Tally:
    passed: int = 0
    total: int = 0
    final: bool = False


class _Proxy:
    """Stands in for the candidate on the host: records calls, answers them from known results."""

    def __init__(self, known: dict[str, dict[str, Any]], entry: str) -> None:
        self.known = known
        self.entry = entry
        self.missing: dict[str, dict[str, Any]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            payload = {
                "entry": self.entry,
                "args": enc(list(args)),
                "kwargs": enc(kwargs),
            }
        except (TypeError, ValueError) as exc:
            raise VerifierError(f"test arguments for {self.entry} are not plain data: {args!r}") from exc
        key = json.dumps(payload, sort_keys=True)
        if key not in self.known:
            self.missing[key] = payload
            return _Pending()
        result = self.known[key]
        if not result.get("ok"):
            raise _CandidateRaised(result.get("error", "no result"))
        return _decode(result["value"])


class _AssertCounter(ast.NodeTransformer):
    """``assert T, M`` -> ``__tg_assert(lambda: T)``: count every assert instead of stopping."""

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        lam = ast.Lambda(
            args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[]),
            body=node.test,
        )
        call = ast.Call(func=ast.Name("__tg_assert", ast.Load()), args=[lam], keywords=[])
        return ast.copy_location(ast.Expr(call), node)


def _make_assert(tally: _Tally) -> Callable[[Any], None]:
    def check(fn: Any) -> None:
        tally.total += 1
        try:
            ok = bool(fn())
        except NameError as exc:
            if tally.final:
                raise VerifierError(f"test code refers to an undefined name: {exc}") from exc
            ok = False
        except Exception:
            ok = False
        tally.passed += ok

    return check


@functools.cache
def _humaneval_program(test: str) -> Any:
    tree = _AssertCounter().visit(ast.parse(test))
    return compile(ast.fix_missing_locations(tree), "<humaneval test>", "exec")


def _run_check(reference: dict[str, Any], proxy: _Proxy, final: bool) -> _Tally:
    tally = _Tally(final=final)
    ns: dict[str, Any] = {"__name__": "humaneval_test", "__tg_assert": _make_assert(tally)}
    with _HOST_LOCK:
        state = random.getstate()
        random.seed(0)
        try:
            exec(compile(reference["prompt"], "<humaneval prompt>", "exec"), ns)
            # Some tests call the function by its own name (HumanEval/33): that is the candidate too.
            ns[reference["entry_point"]] = proxy
            exec(_humaneval_program(reference["test"]), ns)
            try:
                ns["check"](proxy)
            except VerifierError:
                raise
            except Exception:
                # Test code outside an assert crashed on the candidate's value: one more failure.
                tally.total += 1
        finally:
            random.setstate(state)
    return tally


@dataclass(frozen=True)
class _MbppTest:
    expr: ast.Expression  # the assert's test with shipped operands replaced by __tg_r[i]
    shipped: tuple[str, ...]


class _Ship(ast.NodeTransformer):
    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.shipped: list[str] = []

    def _mentions(self, node: ast.AST) -> bool:
        return any(isinstance(n, ast.Name) and n.id in self.names for n in ast.walk(node))

    def _ship(self, node: ast.expr) -> ast.expr:
        self.shipped.append(ast.unparse(node))
        index = ast.Constant(len(self.shipped) - 1)
        return ast.copy_location(ast.Subscript(ast.Name("__tg_r", ast.Load()), index, ast.Load()), node)

    def top(self, node: ast.expr) -> ast.expr:
        if isinstance(node, ast.Compare):
            node.left = self._ship(node.left) if self._mentions(node.left) else node.left
            node.comparators = [self._ship(c) if self._mentions(c) else c for c in node.comparators]
            return node
        return self.visit(node)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if self._mentions(node.func):
            return self._ship(node)
        return self.generic_visit(node)


def _stdlib_names(tree: ast.AST) -> list[str]:
    """Standard-library modules a test expression uses by name without importing them (``sys.maxsize``)."""
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    return sorted(n for n in names if n in sys.stdlib_module_names and not hasattr(builtins, n))


def _mbpp_tests(reference: dict[str, Any]) -> list[_MbppTest]:
    defined = {
        n.name
        for n in ast.parse(reference["code"]).body
        if isinstance(n, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef)
    }
    setup_names = {
        t.id
        for n in ast.walk(ast.parse(reference["setup"]))
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    out = []
    for line in reference["tests"]:
        node = ast.parse(line).body[0]
        if not isinstance(node, ast.Assert):
            raise VerifierError(f"MBPP test is not an assert statement: {line!r}")
        ship = _Ship(defined | setup_names)
        expr = ship.top(node.test)
        if not ship.shipped:
            raise VerifierError(f"MBPP test calls none of the solution's names {sorted(defined)}: {line!r}")
        out.append(_MbppTest(ast.fix_missing_locations(ast.Expression(expr)), tuple(ship.shipped)))
    return out


# --------------------------------------------------------------------------- verifier


class HiddenTestVerifier:
    """Scores submitted code against the task's hidden tests (see the module docstring).

    Args:
        sandbox: where candidate calls run; the shared :func:`default_sandbox` when ``None``.
        call_timeout: seconds for one call (one isolated interpreter); after a timeout the
            remaining calls of that container are not run and count as failed.
    """

    def __init__(self, sandbox: DockerSandbox | None = None, *, call_timeout: float = 10.0) -> None:
        self._sandbox = sandbox
        self.call_timeout = call_timeout

    @property
    def sandbox(self) -> DockerSandbox:
        return self._sandbox if self._sandbox is not None else default_sandbox()

    def score(self, task: Task, answer: Any, trajectory: Sequence[Message] = ()) -> Score:
        code = extract_code(answer) if isinstance(answer, str) else ""
        if not code.strip():
            return Score(
                0.0,
                {
                    "reward/pass_fraction": 0.0,
                    "reward/tests_passed": 0.0,
                    "reward/tests_total": 0.0,
                    "reward/empty": 1.0,
                },
            )
        kind = task.reference["kind"]
        if kind == "humaneval":
            passed, total, timeouts = self._score_humaneval(task.reference, code)
        elif kind == "mbpp":
            passed, total, timeouts = self._score_mbpp(task.reference, code)
        else:
            raise VerifierError(f"task {task.id} has an unknown reference kind {kind!r}")
        fraction = passed / total if total else 0.0
        return Score(
            1.0 if total and passed == total else 0.0,
            {
                "reward/pass_fraction": fraction,
                "reward/tests_passed": float(passed),
                "reward/tests_total": float(total),
                "reward/timeouts": float(timeouts),
            },
        )

    # --------------------------------------------------------------- datasets
    def _score_humaneval(self, reference: dict[str, Any], code: str) -> tuple[int, int, int]:
        known: dict[str, dict[str, Any]] = {}
        timeouts = 0
        for _ in range(MAX_ROUNDS):
            proxy = _Proxy(known, reference["entry_point"])
            tally = _run_check(reference, proxy, final=False)
            if not proxy.missing:
                break
            keys = list(proxy.missing)
            results, t = self._execute(code, [proxy.missing[k] for k in keys])
            timeouts += t
            known.update(zip(keys, results, strict=True))
        proxy = _Proxy(known, reference["entry_point"])
        tally = _run_check(reference, proxy, final=True)
        # Calls never answered (past MAX_ROUNDS) made their asserts fail through the placeholder.
        return tally.passed, tally.total, timeouts

    def _score_mbpp(self, reference: dict[str, Any], code: str) -> tuple[int, int, int]:
        tests = _mbpp_tests(reference)
        calls = [
            {"expr": src, "setup": reference["setup"], "modules": _stdlib_names(ast.parse(src, mode="eval"))}
            for test in tests
            for src in test.shipped
        ]
        results, timeouts = self._execute(code, calls)
        passed, i = 0, 0
        for test in tests:
            values = []
            ok = True
            for _ in test.shipped:
                result = results[i]
                i += 1
                if not result.get("ok"):
                    ok = False
                else:
                    values.append(_decode(result["value"]))
            if ok:
                ns = {"__builtins__": builtins, "__tg_r": values}
                ns.update({name: importlib.import_module(name) for name in _stdlib_names(test.expr)})
                try:
                    ok = bool(eval(compile(test.expr, "<mbpp test>", "eval"), ns))
                except NameError as exc:
                    raise VerifierError(f"MBPP test refers to an undefined name: {exc}") from exc
                except Exception:
                    ok = False
            passed += ok
        return passed, len(tests), timeouts

    # --------------------------------------------------------------- container
    def _execute(self, code: str, calls: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
        """Run ``calls`` in one fresh container; one result dict (``ok``, ``value``/``error``) per call."""
        tagged = [dict(call, id=str(i), nonce=new_nonce()) for i, call in enumerate(calls)]
        nonce = new_nonce()
        job = {
            "code": code,
            "calls": tagged,
            "nonce": nonce,
            "timeout": self.call_timeout,
            "cpu": max(1, math.ceil(self.call_timeout)),
            "driver": _program("programs/driver"),
            "codec": _program("codec"),
        }
        budget = len(calls) * (self.call_timeout + 2.0) + 30.0
        run = self.sandbox.run_harness(_program("programs/runner"), stdin=json.dumps(job), timeout=budget)
        report = None
        for line in run.stdout.splitlines():
            if line.startswith(nonce + " "):
                report = json.loads(line[len(nonce) + 1 :])
        if report is None:
            return [{"ok": False, "error": "harness_lost"} for _ in calls], self._lost_runner(run)
        if "harness_error" in report:
            raise VerifierError(f"the test harness failed: {report['harness_error']}")
        results, timeouts = [], 0
        for call in tagged:
            entry = report["calls"].get(call["id"], {"status": "missing"})
            timeouts += entry.get("status") in _TIMEOUT_STATUSES
            result = entry.get("result") if entry.get("status") == "ok" else None
            results.append(
                result if isinstance(result, dict) else {"ok": False, "error": entry.get("status")}
            )
        return results, timeouts

    @staticmethod
    def _lost_runner(run: ExecResult) -> int:
        """Decide who lost the runner's report; returns the timeouts to count if it was the candidate.

        The candidate cannot signal the runner (another uid), and a container stopped from outside
        already raised in the sandbox. What the candidate can cause: an OOM kill, an output flood
        (huge return values), or spending the whole budget. A runner killed by a signal otherwise
        was killed from outside; any other ending is a harness bug.
        """
        if run.oom_killed or run.output_truncated or run.timed_out:
            log.info("harness lost (candidate's doing): %s", run)
            return int(run.timed_out)
        if run.exit_code is not None and run.exit_code > 128:
            raise SandboxError(
                f"the test harness was killed by signal {run.exit_code - 128} from outside its container"
            )
        raise VerifierError(
            f"the test harness returned no report (exit {run.exit_code}): {run.stderr[-2000:]}"
        )


def extract_code(answer: str) -> str:
    """The submitted code: the last fenced ``python`` block if the answer has one, else the text."""
    blocks = re.findall(r"```(?:python|py)?[ \t]*\n(.*?)```", answer, re.S)
    return blocks[-1] if blocks else answer


_DEFAULT: DockerSandbox | None = None
_DEFAULT_LOCK = threading.Lock()


def default_sandbox() -> DockerSandbox:
    """The process-wide :class:`DockerSandbox` shared by environments and :func:`score_submission`."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None or _DEFAULT._closed.is_set():
            _DEFAULT = DockerSandbox()
        return _DEFAULT


def score_submission(task_id: str, code: str) -> Score:
    """Score ``code`` against the hidden tests of ``task_id`` (``HumanEval/0``, ``MBPP/11``)."""
    return HiddenTestVerifier().score(find_task(task_id), code)
