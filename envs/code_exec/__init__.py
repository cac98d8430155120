"""``toolgym/CodeExec-v0``: write a Python function, try it in a sandbox, submit it to hidden tests.

1. Tasks come from HumanEval (164) and MBPP (974), shipped in ``toolgym/envs/data/code``, with
   splits by problem (:mod:`~toolgym.envs.code_exec.data`).
2. Tools: ``python(code)`` runs in the episode's sandbox container (interpreter state persists across
   calls); ``submit(code)`` ends the episode (:mod:`~toolgym.envs.code_exec.env`).
3. Reward 1 only if every hidden test passes; the pass fraction is a metric. The hidden tests are run
   by :class:`~toolgym.envs.code_exec.verifier.HiddenTestVerifier` (its module states the threat
   model): the tests stay on the host, only calls into the candidate run, in a fresh container, under
   a uid that cannot touch the trusted runner (``programs/``), and results cross back as plain data
   (:mod:`~toolgym.envs.code_exec.codec`).
4. ``audit`` holds the submissions that try to fool the hidden tests (``toolgym audit-env``);
   ``python -m toolgym.envs.code_exec`` scores every reference solution (the verifier's self-test).
"""

from __future__ import annotations

from toolgym.envs.code_exec.audit import audit_exploits
from toolgym.envs.code_exec.data import (
    DATASETS,
    KNOWN_BAD_REFERENCES,
    SLOW_REFERENCES,
    TEST_FRACTION,
    label_code_tasks,
    load_tasks,
    reference_code,
)
from toolgym.envs.code_exec.env import CodeExecEnv
from toolgym.envs.code_exec.verifier import MAX_ROUNDS, HiddenTestVerifier, default_sandbox, score_submission

__all__ = [
    "DATASETS",
    "KNOWN_BAD_REFERENCES",
    "MAX_ROUNDS",
    "SLOW_REFERENCES",
    "TEST_FRACTION",
    "CodeExecEnv",
    "HiddenTestVerifier",
    "audit_exploits",
    "default_sandbox",
    "label_code_tasks",
    "load_tasks",
    "reference_code",
    "score_submission",
]
