"""README's tour table stays true: every name it lists imports from where it says, lightly."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import toolgym

ROOT = Path(__file__).resolve().parents[1]
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
ENV_ID = re.compile(r"^toolgym/\w+-v\d+$")


def _table_rows() -> list[tuple[str, list[str], list[str]]]:
    """(piece, modules in 'where', backticked words in 'what') for each row of the tour table."""
    text = (ROOT / "README.md").read_text()
    table = text.split("| piece | where | what |", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in table.strip().splitlines()[1:]:  # skip the |---| line
        piece, where, what = (cell.strip() for cell in line.strip().strip("|").split("|", 2))
        modules = [m for m in re.findall(r"`([^`]+)`", where) if m.startswith("toolgym")]
        rows.append((piece, modules, re.findall(r"`([^`]+)`", what)))
    return rows


ROWS = _table_rows()


def test_the_table_is_found():
    assert {piece for piece, _, _ in ROWS} >= {"contracts", "environments", "tools", "agents", "training"}


@pytest.mark.parametrize(("piece", "modules", "words"), ROWS, ids=[r[0] for r in ROWS])
def test_every_name_in_the_table_imports_from_where_it_says(piece, modules, words):
    imported = [importlib.import_module(m) for m in modules]
    for word in words:
        if ENV_ID.match(word):
            assert word in toolgym.env_ids(), f"README row {piece!r} names {word}, which is not registered"
        elif IDENTIFIER.match(word):
            found = [m.__name__ for m in imported if hasattr(m, word)]
            assert found, f"README row {piece!r} lists `{word}`, but none of {modules} has it"


def test_lazy_packages_import_no_heavy_dependency():
    code = (
        "import sys, toolgym.tools, toolgym.agents, toolgym.envs\n"
        "from toolgym.tools import build_index, load_index, DockerSandbox\n"
        "from toolgym.agents import ScriptedPolicy, run_episode, get_harness\n"
        "heavy = sorted(m for m in ('docker', 'torch', 'transformers', 'vllm') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("package", ["toolgym.tools", "toolgym.agents"])
def test_lazy_names_do_not_shadow_submodules(package):
    module = importlib.import_module(package)
    folder = Path(module.__file__).parent
    submodules = {p.stem for p in folder.glob("*.py")}
    assert not set(module.__all__) & submodules
    for name in module.__all__:
        assert getattr(module, name) is not None
    with pytest.raises(ImportError, match="cannot import name 'no_such_name'"):
        exec(f"from {package} import no_such_name", {})
