"""``toolgym/CodeExec-v0``: write a Python function, try it in a sandbox, submit it to hidden tests.

Tasks come from HumanEval (164) and MBPP (974), shipped in ``toolgym/envs/data/code``. Tools:
``python(code)`` runs in the episode's sandbox container (interpreter state persists across calls);
``submit(code)`` ends the episode. Reward 1 only if every hidden test passes; the pass fraction is a
metric.

How hidden tests are run without trusting the candidate (the verifier's threat model):

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
* In the container, a trusted runner starts one isolated interpreter (``python3 -I``) per call, with
  a fresh directory; it loads the candidate, makes the one call, and writes the result tagged with a
  per-call random nonce. Results cross to the host as plain data (None, bool, int, float, str, bytes,
  list, tuple, dict, set, complex; subclasses reduced to their built-in base), so an object whose
  ``__eq__`` always answers True never reaches a comparison: anything else arrives as an opaque
  value equal to nothing. After each call every leftover process is killed. The runner's report is
  tagged with its own nonce; the candidate's exit status and printed output are never read.
* The container is fresh from the warm pool: the episode's session container is never reused, so
  files planted during the episode (``sitecustomize.py``, ``conftest.py``) do not exist there.

Consequently the only way to make an assert pass is to return the value it expects. The candidate can
crash or kill its own interpreter, or even the runner (all processes share the unprivileged user);
then its calls count as failed. A report the runner itself flags as a harness error is raised as
:class:`~toolgym.errors.VerifierError`, never scored 0.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import dataclasses
import functools
import gzip
import importlib
import json
import logging
import random
import re
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from toolgym.core import FunctionTool, Message, Score, Task, Tool
from toolgym.env import ToolEnv
from toolgym.errors import ConfigError, SandboxError, ToolTimeout, VerifierError, did_you_mean
from toolgym.tools.sandbox import DockerSandbox, ExecResult, SandboxSession, new_nonce

__all__ = [
    "CodeExecEnv",
    "HiddenTestVerifier",
    "default_sandbox",
    "load_tasks",
    "reference_code",
    "score_submission",
]

log = logging.getLogger(__name__)

DATASETS = ("humaneval", "mbpp")
#: Passes over a HumanEval ``check`` to discover calls that depend on earlier results.
MAX_ROUNDS = 4
#: Tasks whose own reference solution fails its tests under this verifier: none (measured over all
#: 1,138 with ``python -m toolgym.envs.code_exec``). MBPP/123 is reported as failing elsewhere; its
#: reference is correct but slow (amicable numbers below 10,000 by trial division, seconds per call),
#: so it passes with the default ``call_timeout`` and fails under timeouts of a second or two.
KNOWN_BAD_REFERENCES: frozenset[str] = frozenset()
#: A correct reference that needs seconds per call (see above).
SLOW_REFERENCES = frozenset({"MBPP/123"})

# --------------------------------------------------------------------------- value codec

# One source of truth for the plain-data codec, used inside the container (driver) and on the host.
_CODEC = r"""
def enc(v, depth=0):
    if depth > 200:
        raise ValueError("nested too deeply")
    d = depth + 1
    if v is None or v is True or v is False:
        return v
    if isinstance(v, bool):
        return bool.__bool__(v)
    if isinstance(v, int):
        return {"t": "int", "v": int.__repr__(v)}
    if isinstance(v, float):
        return {"t": "float", "v": float.__repr__(v)}
    if isinstance(v, complex):
        return {"t": "complex", "v": [float.__repr__(complex.__getattribute__(v, "real")), float.__repr__(complex.__getattribute__(v, "imag"))]}
    if isinstance(v, str):
        return {"t": "str", "v": str.__str__(v)}
    if isinstance(v, (bytes, bytearray)):
        return {"t": "bytes", "v": bytes(v).hex()}
    if isinstance(v, list):
        return {"t": "list", "v": [enc(x, d) for x in list.__iter__(v)]}
    if isinstance(v, tuple):
        return {"t": "tuple", "v": [enc(x, d) for x in tuple.__iter__(v)]}
    if isinstance(v, dict):
        return {"t": "dict", "v": [[enc(k, d), enc(x, d)] for k, x in dict.items(v)]}
    if isinstance(v, frozenset):
        return {"t": "frozenset", "v": [enc(x, d) for x in frozenset.__iter__(v)]}
    if isinstance(v, set):
        return {"t": "set", "v": [enc(x, d) for x in set.__iter__(v)]}
    raise TypeError("unsupported")

def enc_result(v):
    try:
        return enc(v)
    except Exception:
        return {"t": "opaque"}

def dec(e, opaque=None):
    if e is None or e is True or e is False:
        return e
    t, v = e["t"], e["v"] if "v" in e else None
    if t == "int":
        return int(v)
    if t == "float":
        return float(v)
    if t == "complex":
        return complex(float(v[0]), float(v[1]))
    if t == "str":
        return str(v)
    if t == "bytes":
        return bytes.fromhex(v)
    if t == "list":
        return [dec(x, opaque) for x in v]
    if t == "tuple":
        return tuple(dec(x, opaque) for x in v)
    if t == "dict":
        return {dec(k, opaque): dec(x, opaque) for k, x in v}
    if t == "set":
        return {dec(x, opaque) for x in v}
    if t == "frozenset":
        return frozenset(dec(x, opaque) for x in v)
    if t == "opaque" and opaque is not None:
        return opaque()
    raise ValueError("bad encoding")
"""

_codec: dict[str, Any] = {}
exec(compile(_CODEC, "<toolgym codec>", "exec"), _codec)


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
    return _codec["dec"](encoded, _Opaque)


# --------------------------------------------------------------------------- in-container programs

# One isolated interpreter per call: read the job, silence the candidate's output, load it, make the
# call, write "<nonce>\n<json>" to result.json in its own directory.
_DRIVER = (
    _CODEC
    + r"""
import json, os, sys
job = json.loads(sys.stdin.read())
nonce, where = job["nonce"], os.path.abspath("result.json")
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
try:
    ns = {"__name__": "candidate", "__builtins__": __builtins__}
    exec(compile(job["code"], "candidate.py", "exec"), ns)
    if "expr" in job:
        for name in job.get("modules", ()):
            ns.setdefault(name, __import__(name))
        exec(compile(job.get("setup", ""), "setup.py", "exec"), ns)
        value = eval(compile(job["expr"], "test.py", "eval"), ns)
    else:
        value = ns[job["entry"]](*dec(job["args"]), **dec(job["kwargs"]))
    out = {"ok": True, "value": enc_result(value)}
except BaseException as exc:
    out = {"ok": False, "error": type(exc).__name__}
text = json.dumps(out)
with open(where, "w") as f:
    f.write(nonce + "\n" + text)
"""
)

# The trusted runner: one subprocess per call, a kill of every leftover process after each.
_RUNNER = r"""
import ctypes, json, os, signal, subprocess, sys, traceback
try:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: children cannot read our memory or fds
except Exception:
    pass
job = json.loads(sys.stdin.read())
report = {}
try:
    stop = False
    for i, call in enumerate(job["calls"]):
        if stop:
            report[call["id"]] = {"status": "skipped"}
            continue
        d = "/work/call%d" % i
        try:
            os.mkdir(d, 0o700)
        except OSError:
            report[call["id"]] = {"status": "no_room"}
            continue
        payload = dict(call, code=job["code"])
        status = "ok"
        try:
            p = subprocess.Popen(["python3", "-I", "-c", job["driver"]], stdin=subprocess.PIPE,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=d,
                                 start_new_session=True, close_fds=True)
            try:
                p.communicate(json.dumps(payload).encode(), timeout=job["timeout"])
            except subprocess.TimeoutExpired:
                status = "timeout"
            except (BrokenPipeError, OSError):
                pass
        except OSError:
            status = "spawn_failed"
        try:
            os.kill(-1, signal.SIGKILL)  # every process of this user but us (and pid 1)
        except OSError:
            pass
        try:
            p.wait(5)
        except Exception:
            pass
        entry = {"status": status}
        if status == "ok":
            try:
                with open(os.path.join(d, "result.json")) as f:
                    text = f.read(1 << 22)
                tag, _, body = text.partition("\n")
                if tag != call["nonce"]:
                    entry = {"status": "bad_tag"}
                else:
                    entry["result"] = json.loads(body)
            except Exception:
                entry = {"status": "no_result"}
        report[call["id"]] = entry
        stop = status == "timeout"
    sys.stdout.write(job["nonce"] + " " + json.dumps({"calls": report}) + "\n")
except Exception:
    sys.stdout.write(job["nonce"] + " " + json.dumps({"harness_error": traceback.format_exc()}) + "\n")
"""


# --------------------------------------------------------------------------- data


@functools.cache
def _records(dataset: str) -> tuple[dict[str, Any], ...]:
    root = resources.files("toolgym.envs") / "data" / "code"
    name = {"humaneval": "HumanEval.jsonl.gz", "mbpp": "mbpp.jsonl.gz"}[dataset]
    with (root / name).open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as fh:
        return tuple(json.loads(line) for line in fh if line.strip())


_INSTRUCTIONS = (
    "Use the python tool to run code (state persists between calls). When you are done, call submit "
    "with the complete code: the function with its signature, plus any imports and helpers it needs."
)


def _humaneval_task(rec: dict[str, Any]) -> Task:
    prompt = f"Complete this Python function.\n\n```python\n{rec['prompt']}```\n\n{_INSTRUCTIONS}"
    reference = {
        "kind": "humaneval",
        "prompt": rec["prompt"],
        "test": rec["test"],
        "entry_point": rec["entry_point"],
    }
    meta = {"dataset": "humaneval", "entry_point": rec["entry_point"]}
    return Task(id=rec["task_id"], prompt=prompt, reference=reference, metadata=meta)


def _mbpp_task(rec: dict[str, Any]) -> Task:
    tests = list(rec["test_list"])
    # NOTE: as in the standard MBPP prompt, one test is shown (it names the function and its
    # signature); all tests, that one included, are run hidden.
    prompt = f"{rec['text'].strip()}\n\nFor example, this must hold:\n{tests[0].strip()}\n\n{_INSTRUCTIONS}"
    reference = {
        "kind": "mbpp",
        "tests": tests,
        "setup": rec.get("test_setup_code", "") or "",
        "code": rec["code"],
    }
    return Task(id=f"MBPP/{rec['task_id']}", prompt=prompt, reference=reference, metadata={"dataset": "mbpp"})


def load_tasks(dataset: str = "humaneval") -> list[Task]:
    """The tasks of ``dataset`` (``"humaneval"``, ``"mbpp"`` or ``"all"``), in file order."""
    if dataset == "all":
        return load_tasks("humaneval") + load_tasks("mbpp")
    if dataset not in DATASETS:
        raise ConfigError(
            f"unknown dataset {dataset!r}.{did_you_mean(dataset, DATASETS)} Choose humaneval, mbpp or all"
        )
    make = _humaneval_task if dataset == "humaneval" else _mbpp_task
    return [make(rec) for rec in _records(dataset)]


@functools.cache
def _task_index() -> dict[str, Task]:
    return {t.id: t for t in load_tasks("all")}


def _task(task_id: str) -> Task:
    index = _task_index()
    if task_id not in index:
        raise ConfigError(
            f"no code task {task_id!r}.{did_you_mean(task_id, index)} Ids look like HumanEval/0, MBPP/11"
        )
    return index[task_id]


def reference_code(task_id: str) -> str:
    """The data set's reference solution for ``task_id``, as a complete submission."""
    task = _task(task_id)
    if task.reference["kind"] == "mbpp":
        return str(task.reference["code"])
    rec = next(r for r in _records("humaneval") if r["task_id"] == task_id)
    return str(rec["prompt"] + rec["canonical_solution"])


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
                "args": _codec["enc"](list(args)),
                "kwargs": _codec["enc"](kwargs),
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


def _make_assert(tally: _Tally):  # type: ignore[no-untyped-def]
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
        code = _extract_code(answer) if isinstance(answer, str) else ""
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
        job = {"code": code, "calls": tagged, "nonce": nonce, "timeout": self.call_timeout, "driver": _DRIVER}
        budget = len(calls) * (self.call_timeout + 2.0) + 30.0
        run: ExecResult = self.sandbox.run(_RUNNER, timeout=budget, stdin=json.dumps(job))
        report = None
        for line in run.stdout.splitlines():
            if line.startswith(nonce + " "):
                report = json.loads(line[len(nonce) + 1 :])
        if report is None:
            if run.timed_out or run.oom_killed or run.output_truncated or run.exit_code in (137, -9):
                # The container was fresh: only the candidate's processes can have taken the runner down.
                log.info("harness lost (candidate's doing): %s", run)
                return [{"ok": False, "error": "harness_lost"} for _ in calls], 0
            raise VerifierError(
                f"the test harness returned no report (exit {run.exit_code}): {run.stderr[-2000:]}"
            )
        if "harness_error" in report:
            raise VerifierError(f"the test harness failed: {report['harness_error']}")
        results, timeouts = [], 0
        for call in tagged:
            entry = report["calls"].get(call["id"], {"status": "missing"})
            timeouts += entry.get("status") == "timeout"
            result = entry.get("result") if entry.get("status") == "ok" else None
            results.append(
                result if isinstance(result, dict) else {"ok": False, "error": entry.get("status")}
            )
        return results, timeouts


def _extract_code(answer: str) -> str:
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
    return HiddenTestVerifier().score(_task(task_id), code)


# --------------------------------------------------------------------------- environment


def _format(result: ExecResult) -> str:
    text = result.stdout
    if result.stderr:
        text += ("" if not text or text.endswith("\n") else "\n") + result.stderr
    notes = []
    if result.output_truncated:
        notes.append("output cut: too much output; the interpreter was restarted and its variables are lost")
    if result.oom_killed:
        notes.append("killed: out of memory; the interpreter was restarted and its variables are lost")
    elif result.exit_code not in (0, None):
        notes.append(f"exit status {result.exit_code}")
    text = text + "".join(f"\n[{n}]" for n in notes)
    return text if text.strip() else "(no output)"


class CodeExecEnv(ToolEnv):
    """Write a function for a HumanEval or MBPP task, test it with ``python``, ``submit`` it.

    Args:
        dataset: ``"humaneval"`` (default), ``"mbpp"`` or ``"all"``.
        sandbox: the :class:`DockerSandbox` to use; the shared default when ``None`` (created on
            first use, so constructing and resetting the environment needs no Docker engine).
        tool_timeout: seconds one ``python`` call may run.
        call_timeout: seconds one hidden-test call may run.
        max_turns: assistant turns before truncation.
        render_mode: ``"ansi"`` or ``None``.
    """

    description = "Write Python functions (HumanEval / MBPP); python(code) in a Docker sandbox, submit(code) to hidden tests."

    def __init__(
        self,
        dataset: str = "humaneval",
        *,
        sandbox: DockerSandbox | None = None,
        tool_timeout: float = 10.0,
        call_timeout: float = 10.0,
        max_turns: int = 8,
        render_mode: str | None = None,
    ) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        self.dataset = dataset
        self.tasks = load_tasks(dataset)
        self._sandbox = sandbox
        self.tool_timeout = tool_timeout
        self.verifier = HiddenTestVerifier(sandbox, call_timeout=call_timeout)
        self._session: SandboxSession | None = None

    async def episode_tools(self, task: Task) -> Sequence[Tool]:
        return [
            FunctionTool(
                name="python",
                description="Run Python code in a sandbox (no network). Variables persist between calls; "
                "the value of a final expression is printed.",
                parameters={
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "Python source to run"}},
                    "required": ["code"],
                },
                fn=self._python,
                timeout=self.tool_timeout + 30.0,
            ),
            FunctionTool(
                name="submit",
                description="Submit the complete solution code; this ends the episode.",
                parameters={
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "the complete solution"}},
                    "required": ["code"],
                },
                terminal=True,
            ),
        ]

    async def _python(self, code: str) -> str:
        if self._session is None:
            sandbox = self._sandbox if self._sandbox is not None else default_sandbox()
            self._session = sandbox.session()
        session = self._session
        result = await asyncio.to_thread(session.run, code, timeout=self.tool_timeout)
        if result.timed_out:
            partial = (
                _format(dataclasses.replace(result, timed_out=False))
                if result.stdout or result.stderr
                else ""
            )
            raise ToolTimeout(
                f"timed out after {self.tool_timeout:g} s; the interpreter was restarted and its variables are lost"
                + (f"\n{partial}" if partial else ""),
                tool="python",
            )
        return _format(result)

    async def close_episode(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            try:
                await asyncio.to_thread(session.close)
            except SandboxError as exc:  # pragma: no cover - removal is best effort, the reaper retries
                log.warning("closing the sandbox session failed: %s", exc)


def check_references(
    dataset: str = "all", *, workers: int = 2, limit: int | None = None
) -> tuple[dict[str, Score], dict[str, str]]:
    """Score every reference solution of ``dataset`` (a self-test of the verifier); show progress.

    Returns the scores by task id, and the verifier errors by task id (a sound verifier has none and
    gives reward 1 to every reference except :data:`KNOWN_BAD_REFERENCES`).
    """
    from concurrent.futures import ThreadPoolExecutor

    from rich.progress import Progress

    tasks = load_tasks(dataset)[:limit]
    scores: dict[str, Score] = {}
    errors: dict[str, str] = {}
    with (
        DockerSandbox(pool_size=2 * workers) as sandbox,
        Progress() as progress,
        ThreadPoolExecutor(workers) as pool,
    ):
        verifier = HiddenTestVerifier(sandbox)
        bar = progress.add_task(f"reference solutions ({dataset})", total=len(tasks))
        futures = {pool.submit(verifier.score, t, reference_code(t.id)): t.id for t in tasks}
        for future in futures:
            try:
                scores[futures[future]] = future.result()
            except VerifierError as exc:
                errors[futures[future]] = str(exc)
            progress.advance(bar)
    return scores, errors


if __name__ == "__main__":
    import argparse
    import time

    parser = argparse.ArgumentParser(description="Score the reference solutions (verifier self-test).")
    parser.add_argument("--dataset", default="all", choices=[*DATASETS, "all"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None)
    cli = parser.parse_args()
    started = time.monotonic()
    results, problems = check_references(cli.dataset, workers=cli.workers, limit=cli.limit)
    failing = sorted(tid for tid, s in results.items() if s.reward != 1.0)
    print(
        f"{len(results) - len(failing)}/{len(results)} reference solutions score 1 in {time.monotonic() - started:.0f} s"
    )
    for tid in failing:
        print(f"  {tid}: {dict(results[tid].metrics)}")
    for tid, problem in sorted(problems.items()):
        print(f"  {tid}: verifier error: {problem}")
