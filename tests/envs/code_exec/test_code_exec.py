"""toolgym/CodeExec-v0: data, the hidden-test verifier (references pass, hacks score 0), the episode.

Docker tests skip only when TOOLGYM_SKIP_DOCKER=1 asks for it.
"""

from __future__ import annotations

import ast
import json
import os
import textwrap
import threading
import time
from importlib import resources

import pytest

import toolgym
from toolgym.core import Task
from toolgym.envs.code_exec import (
    KNOWN_BAD_REFERENCES,
    SLOW_REFERENCES,
    CodeExecEnv,
    HiddenTestVerifier,
    load_tasks,
    reference_code,
    score_submission,
)
from toolgym.envs.code_exec import codec as code_codec
from toolgym.envs.code_exec.verifier import _mbpp_tests
from toolgym.envs.code_exec.verifier import extract_code as _extract_code
from toolgym.errors import ConfigError, InfraError, SandboxError
from toolgym.tools.sandbox import DockerSandbox, ExecResult, leaked_containers

# --------------------------------------------------------------------------- pure logic


def test_data_is_complete_and_shipped_with_licences() -> None:
    from importlib import resources

    assert len(load_tasks("humaneval")) == 164 and len(load_tasks("mbpp")) == 974
    assert len(load_tasks("all")) == 164 + 974
    root = resources.files("toolgym.envs") / "data" / "code"
    assert "MIT" in (root / "LICENSE-human-eval-MIT.txt").read_text()
    assert "CC BY 4.0" in (root / "ATTRIBUTION-MBPP.md").read_text()


def test_tasks_round_trip_json_and_hide_expected_values() -> None:
    task = load_tasks("humaneval")[0]
    assert Task.from_json(task.to_json()) == task
    assert task.reference["test"] not in task.prompt and "has_close_elements" in task.prompt


def test_unknown_dataset_and_task_id_say_did_you_mean() -> None:
    with pytest.raises(ConfigError, match="Did you mean 'mbpp'"):
        load_tasks("mbp")
    with pytest.raises(ConfigError, match="HumanEval/1"):
        reference_code("HumanEval/1000")


def test_codec_round_trips_plain_data_and_reduces_subclasses() -> None:
    ns = vars(code_codec)
    value = [1, 2**80, -0.0, float("inf"), "s", b"\x00", (1, [2]), {"k": {3}}, frozenset({4}), None, True, 1j]
    assert ns["dec"](json.loads(json.dumps(ns["enc"](value)))) == value

    class Liar(str):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = str.__hash__

    decoded = ns["dec"](ns["enc"](Liar("abc")))
    assert type(decoded) is str and decoded == "abc" and decoded != "xyz"
    assert ns["enc_result"](object()) == {"t": "opaque"}


def test_mbpp_ships_only_the_operand_that_calls_the_candidate() -> None:
    reference = {
        "code": "def f(x):\n    return x",
        "setup": "",
        "tests": ["assert f([1, 2]) == [1, 2]", "assert math.isclose(f(2.0), 2.0)"],
    }
    first, second = _mbpp_tests(reference)
    assert first.shipped == ("f([1, 2])",) and second.shipped == ("f(2.0)",)
    # the expected value stays on the host: it is in the rewritten expression, never in what is shipped
    assert "[1, 2]" in ast.unparse(first.expr.body) and "__tg_r[0]" in ast.unparse(first.expr.body)


def test_in_container_programs_are_shipped_files() -> None:
    package = resources.files("toolgym.envs.code_exec")
    for name in ("programs/runner.py", "programs/driver.py", "codec.py"):
        text = (package / name).read_text()
        assert 'if __name__ == "__main__":' in text or name == "codec.py"
        compile(text, name, "exec")


def test_tool_output_names_the_limit_that_stopped_the_code() -> None:
    from toolgym.envs.code_exec.env import _format

    cpu = ExecResult(152, "", "", False, False, False, 1.0, cpu_time_exceeded=True, cpu_limit_s=10)
    assert _format(cpu) == "\n[killed: CPU time limit of 10 s exceeded]"
    big = ExecResult(
        153,
        "",
        "OSError: [Errno 27] File too large\n",
        False,
        False,
        False,
        1.0,
        file_size_exceeded=True,
        file_limit_mb=16,
    )
    assert _format(big).endswith("File too large\n\n[file size limit of 16 MB exceeded]")


def test_extract_code_takes_the_last_fenced_block() -> None:
    assert _extract_code("text\n```python\na = 1\n```\nmore\n```python\nb = 2\n```") == "b = 2\n"
    assert _extract_code("def f(): pass") == "def f(): pass"


def test_env_is_registered_and_resets_without_docker() -> None:
    env = toolgym.make("toolgym/CodeExec-v0", dataset="mbpp")
    obs, info = env.reset(seed=0)
    assert info["allowed_tools"] == ["python", "submit"] and obs[1]["content"]
    assert info["task_id"].startswith("MBPP/")
    env.close()


# --------------------------------------------------------------------------- docker


@pytest.fixture(scope="module")
def verifier():
    if os.environ.get("TOOLGYM_SKIP_DOCKER") == "1":
        pytest.skip("TOOLGYM_SKIP_DOCKER=1")
    box = DockerSandbox(pool_size=2)
    yield HiddenTestVerifier(box, call_timeout=2.0)
    box.close()
    assert leaked_containers(box.client, instance=box.instance) == []


def _score(verifier: HiddenTestVerifier, task_id: str, code: str):
    task = next(t for t in load_tasks("all") if t.id == task_id)
    score = verifier.score(task, textwrap.dedent(code))
    verifier.sandbox.wait_removals()
    # one-shot containers are gone after scoring; only the warm pool (never used) may remain
    assert (
        len(leaked_containers(verifier.sandbox.client, instance=verifier.sandbox.instance))
        <= verifier.sandbox.pool_size
    )
    return score


# A deterministic sample: spread over both data sets, with the tasks that stress the harness
# (100 random inputs, helpers from the prompt, test_setup_code objects, float tolerance).
SAMPLE = ["HumanEval/0", "HumanEval/32", "HumanEval/33", "HumanEval/38", "HumanEval/53", "HumanEval/81", "HumanEval/163",
          "MBPP/1", "MBPP/17", "MBPP/367", "MBPP/500", "MBPP/927", "MBPP/974"]  # fmt: skip


@pytest.mark.docker
@pytest.mark.parametrize("task_id", SAMPLE)
def test_reference_solutions_score_one(verifier: HiddenTestVerifier, task_id: str) -> None:
    score = _score(verifier, task_id, reference_code(task_id))
    assert score.reward == 1.0 and score.metrics["reward/pass_fraction"] == 1.0


@pytest.mark.docker
def test_slow_reference_passes_with_default_timeout_and_times_out_under_a_short_one(
    verifier: HiddenTestVerifier,
) -> None:
    assert frozenset() == KNOWN_BAD_REFERENCES
    (task_id,) = SLOW_REFERENCES
    task = next(t for t in load_tasks("mbpp") if t.id == task_id)
    hurried = HiddenTestVerifier(verifier.sandbox, call_timeout=0.5).score(task, reference_code(task_id))
    assert hurried.reward == 0.0 and hurried.metrics["reward/timeouts"] == 1.0
    assert HiddenTestVerifier(verifier.sandbox).score(task, reference_code(task_id)).reward == 1.0


@pytest.mark.docker
def test_wrong_solution_gets_partial_fraction_and_zero_reward(verifier: HiddenTestVerifier) -> None:
    score = _score(verifier, "HumanEval/0", "def has_close_elements(numbers, threshold):\n    return True\n")
    assert score.reward == 0.0 and 0.0 < score.metrics["reward/pass_fraction"] < 1.0


@pytest.mark.docker
def test_score_submission_public_api() -> None:
    if os.environ.get("TOOLGYM_SKIP_DOCKER") == "1":
        pytest.skip("TOOLGYM_SKIP_DOCKER=1")
    assert score_submission("MBPP/2", reference_code("MBPP/2")).reward == 1.0


# --------------------------------------------------------------------------- hacks: each must score 0

HE0 = "def has_close_elements(numbers, threshold):\n"

HACKS = {
    "sys_exit_at_import": "import sys\nsys.exit(0)\n" + HE0 + "    return True\n",
    "sys_exit_in_call": HE0 + "    import sys; sys.exit(0)\n",
    "os_exit_in_call": HE0 + "    import os; os._exit(0)\n",
    "atexit_forges_success": HE0
    + "    import atexit, os\n    atexit.register(lambda: print('{\"ok\": true}'))\n    os._exit(0)\n",
    "eq_always_true": HE0
    + "    class A:\n        def __eq__(self, o): return True\n        def __bool__(self): return True\n    return A()\n",
    "ne_and_hash_variants": HE0
    + "    class A(int):\n        def __eq__(self, o): return True\n        def __ne__(self, o): return False\n"
    "        def __hash__(self): return hash(True)\n    return A(7)\n",
    "str_subclass_eq": HE0
    + "    class S(str):\n        __eq__ = lambda s, o: True\n        __hash__ = str.__hash__\n    return S('x')\n",
    "monkeypatch_builtins_and_unittest": "import builtins, unittest\n"
    "builtins.AssertionError = type('N', (Exception,), {})\nbuiltins.bool = lambda *a: True\n"
    "unittest.TestCase.assertEqual = lambda *a, **k: None\n" + HE0 + "    return None\n",
    "raise_skiptest": HE0 + "    import unittest\n    raise unittest.SkipTest('skip me')\n",
    "read_caller_frame": HE0
    + "    import sys\n    f = sys._getframe(1)\n    found = []\n    while f:\n        found += [v for v in f.f_locals.values() if isinstance(v, bool)]\n"
    "        f = f.f_back\n    return found[-1] if found else 'x'\n",
    "read_test_file": HE0 + "    import glob, os\n    for p in glob.glob('/**/*.py', recursive=True):\n"
    "        if 'check(candidate)' in open(p, errors='ignore').read():\n            return open(p).read()\n    return 'x'\n",
    "plant_sitecustomize_and_conftest": "import os\nfor d in ('.', '..', '/tmp', os.path.expanduser('~')):\n"
    "    for n in ('sitecustomize.py', 'usercustomize.py', 'conftest.py'):\n        try: open(os.path.join(d, n), 'w').write('import os; os._exit(0)')\n"
    "        except OSError: pass\n" + HE0 + "    return 'x'\n",
    "print_success_line": "print('PASSED 7/7 tests', '{\"ok\": true, \"value\": true}')\n"
    + HE0
    + "    print('{\"ok\": true, \"value\": true}')\n    return 'x'\n",
    "infinite_loop": HE0 + "    while True: pass\n",
    "fork_child_outlives_parent": HE0
    + "    import os, time, glob, json\n    if os.fork() == 0:\n        os.setsid()\n        for _ in range(200):\n"
    "            for p in glob.glob('/work/*/result.json'):\n                try: open(p, 'a').write('{\"ok\": true}')\n"
    "                except OSError: pass\n            time.sleep(0.01)\n        os._exit(0)\n    return 'x'\n",
}


@pytest.mark.docker
@pytest.mark.parametrize("name", sorted(HACKS))
def test_hack_scores_zero(verifier: HiddenTestVerifier, name: str) -> None:
    score = _score(verifier, "HumanEval/0", HACKS[name])
    assert score.reward == 0.0, name
    if name == "infinite_loop":
        assert score.metrics["reward/timeouts"] >= 1.0


@pytest.mark.docker
def test_files_planted_during_the_episode_do_not_reach_the_tests(verifier: HiddenTestVerifier) -> None:
    env = CodeExecEnv("humaneval", sandbox=verifier.sandbox, tool_timeout=10)
    env.reset(options={"task_id": "HumanEval/0"})
    plant = "for n in ('sitecustomize.py', 'conftest.py'):\n    open(n, 'w').write('import os; os._exit(0)')\nprint('planted')"
    obs, *_ = env.step(_call("python", plant))
    assert obs[0]["content"].strip() == "planted"
    _, reward, terminated, _, _ = env.step(_call("submit", HE0 + "    return 'x'\n"))
    assert terminated and reward == 0.0
    env.close()


def _call(name: str, code: str) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": {"code": code}}) + "</tool_call>"


@pytest.mark.docker
def test_episode_python_keeps_state_then_submit_scores(verifier: HiddenTestVerifier) -> None:
    env = CodeExecEnv("mbpp", sandbox=verifier.sandbox, tool_timeout=5)
    obs, info = env.reset(options={"task_id": "MBPP/2"})
    obs, reward, terminated, truncated, _ = env.step(_call("python", "x = 21"))
    assert obs[0]["content"] == "(no output)" and reward == 0.0 and not terminated
    obs, *_ = env.step(_call("python", "x * 2"))
    assert obs[0]["content"].strip() == "42"
    obs, *_ = env.step(_call("python", "while True: pass"))
    assert obs[0]["content"].startswith("Error: python: timed out after 5 s")
    obs, reward, terminated, truncated, info = env.step(_call("submit", reference_code("MBPP/2")))
    assert terminated and not truncated and reward == 1.0
    assert info["metrics"]["reward/pass_fraction"] == 1.0 and info["metrics"]["tool/python/calls"] == 3.0
    env.close()
    verifier.sandbox.wait_removals()
    # the episode's session container is gone; only untouched warm-pool containers remain
    assert (
        len(leaked_containers(verifier.sandbox.client, instance=verifier.sandbox.instance))
        <= verifier.sandbox.pool_size
    )


# --------------------------------------------------------------------------- attacks on the runner

HE0_REF = reference_code("HumanEval/0")
RUNNER_ATTACKS = {
    "sigterm_parent": "os.kill(os.getppid(), signal.SIGTERM)",
    "sigint_parent": "os.kill(os.getppid(), signal.SIGINT)",
    "sigkill_parent": "os.kill(os.getppid(), signal.SIGKILL)",
    "sigstop_parent": "os.kill(os.getppid(), signal.SIGSTOP)",
    "kill_everything": "os.kill(-1, signal.SIGKILL)",
    "stop_everything": "os.kill(-1, signal.SIGSTOP)",
    "killpg_parent": "os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)",
    "kill_pid1": "os.kill(1, signal.SIGKILL)",
}


@pytest.mark.docker
@pytest.mark.parametrize("name", sorted(RUNNER_ATTACKS))
def test_runner_attack_fails_and_the_attacker_scores_zero(verifier: HiddenTestVerifier, name: str) -> None:
    # Unguarded, before a wrong solution: scored, never raised. Signals aimed at the runner or PID 1
    # fail with EPERM at import, so every call fails; kill(-1) only reaches the candidate's own uid.
    code = f"import os, signal\n{RUNNER_ATTACKS[name]}\n" + HE0 + "    return True\n"
    score = _score(verifier, "HumanEval/0", code)
    assert score.reward == 0.0 and score.metrics["reward/tests_total"] == 7.0
    if "everything" not in name:
        assert score.metrics["reward/tests_passed"] == 0.0


@pytest.mark.docker
@pytest.mark.parametrize("name", sorted(RUNNER_ATTACKS))
def test_runner_attack_inside_every_call_leaves_scoring_intact(
    verifier: HiddenTestVerifier, name: str
) -> None:
    # A correct solution that attacks the runner in every call: the runner survives, the score is 1.
    attack = f"import os, signal\ntry:\n    {RUNNER_ATTACKS[name]}\nexcept OSError:\n    pass\n"
    code = HE0_REF.replace('    """ Check if', "    " + attack.replace("\n", "\n    ") + '""" Check if', 1)
    assert attack.splitlines()[1].strip() in code
    score = _score(verifier, "HumanEval/0", code)
    assert score.reward == 1.0 and score.metrics["reward/timeouts"] == 0.0


@pytest.mark.docker
def test_submit_that_signals_the_runner_is_scored_by_the_env(verifier: HiddenTestVerifier) -> None:
    env = CodeExecEnv("humaneval", sandbox=verifier.sandbox)
    env.reset(options={"task_id": "HumanEval/0"})
    code = "import os, signal\n" + HE0 + "    os.kill(os.getppid(), signal.SIGTERM)\n    return True\n"
    _, reward, terminated, _, info = env.step(_call("submit", code))
    assert terminated and reward == 0.0 and info["metrics"]["reward/tests_total"] > 0
    env.close()


@pytest.mark.docker
def test_verifier_container_killed_from_outside_is_an_infra_error() -> None:
    if os.environ.get("TOOLGYM_SKIP_DOCKER") == "1":
        pytest.skip("TOOLGYM_SKIP_DOCKER=1")
    box = DockerSandbox(pool_size=0)
    verifier = HiddenTestVerifier(box, call_timeout=30.0)
    task = next(t for t in load_tasks("humaneval") if t.id == "HumanEval/0")
    outcome: list[object] = []

    def score() -> None:
        try:
            outcome.append(
                verifier.score(task, HE0 + "    import time\n    time.sleep(20)\n    return True\n")
            )
        except SandboxError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=score)
    try:
        worker.start()
        for _ in range(400):
            running = leaked_containers(box.client, instance=box.instance)
            if running:
                break
            time.sleep(0.05)
        time.sleep(2.0)  # inside the first call's sleep (a kill before the exec fails it: same error)
        box.client.api.kill(running[0])
        worker.join(120)
        assert len(outcome) == 1 and isinstance(outcome[0], InfraError), outcome
    finally:
        box.close()
