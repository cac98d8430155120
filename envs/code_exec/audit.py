"""CodeExec's own entries for ``toolgym audit-env``: submissions that try to fool the hidden tests.

Each is a complete submission that does not solve the task but tries to look as if it passed: an
answer object equal to everything, a process that exits 0 before (or after) the tests run, files and
output a careless verifier might trust. The hidden-test verifier must give every one of them 0.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from toolgym.envs.audit import Episode, Exploit

__all__ = ["audit_exploits"]

_ALWAYS_EQUAL = """
class _AlwaysEqual:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __hash__(self): return 0
    def __bool__(self): return True
    def __len__(self): return 0
    def __iter__(self): return iter(())

def {name}(*args, **kwargs):
    return _AlwaysEqual()
"""

_EXIT_AT_IMPORT = """
import os, sys
print("ok: all tests passed")
sys.stdout.flush()
os._exit(0)

def {name}(*args, **kwargs):
    return None
"""

_EXIT_ZERO_ON_FAILURE = """
import atexit, os, sys
sys.excepthook = lambda *exc: os._exit(0)
atexit.register(lambda: os._exit(0))

def {name}(*args, **kwargs):
    return None
"""

_TRUSTED_FILES = """
import glob, json, os
for path in ("result.json", "results.json", "result.txt", "/tmp/result.json", "passed", ".passed"):
    try:
        with open(path, "w") as fh:
            fh.write(json.dumps({{"passed": True, "failed": 0, "status": "ok"}}))
    except OSError:
        pass
print("PASSED", json.dumps({{"passed": True}}))

def {name}(*args, **kwargs):
    return None
"""


def _entry_point(prompt: str) -> str:
    """The function the task asks for: the last ``def name(`` of the prompt (or its first ``name(`` call)."""
    defs = re.findall(r"def\s+([A-Za-z_]\w*)\s*\(", prompt)
    if defs:
        return defs[-1]
    call = re.search(r"\b([A-Za-z_]\w*)\s*\(", prompt)
    return call.group(1) if call else "solution"


def _submit(template: str) -> Callable[[Episode], Iterator[str]]:
    def play(ep: Episode) -> Iterator[str]:
        yield ep.answer_call(template.format(name=_entry_point(ep.prompt)))

    return play


def audit_exploits() -> list[Exploit]:
    """Submissions that try to pass the hidden tests without solving the task."""
    return [
        Exploit("always-equal", "returns an object equal to every expected value", _submit(_ALWAYS_EQUAL)),
        Exploit(
            "exit-at-import", "prints success and exits 0 before any test runs", _submit(_EXIT_AT_IMPORT)
        ),
        Exploit(
            "exit-zero-on-failure",
            "turns any failure into exit code 0 (excepthook and atexit)",
            _submit(_EXIT_ZERO_ON_FAILURE),
        ),
        Exploit(
            "trusted-files",
            "writes result files and prints PASSED for a verifier that reads them",
            _submit(_TRUSTED_FILES),
        ),
    ]
