"""Layout and dependency-direction checks (ARCHITECTURE.md, "Dependency rule"), on the source tree."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "toolgym": ROOT / "src" / "toolgym",
    **{f"toolgym.{d}": ROOT / d for d in ("envs", "tools", "agents", "training")},
}

# subpackage -> toolgym subpackages it may import (the core "toolgym" is always allowed)
ALLOWED = {
    "toolgym": set(),
    "toolgym.tools": {"toolgym.tools"},
    "toolgym.envs": {"toolgym.envs", "toolgym.tools"},
    "toolgym.agents": {"toolgym.agents"},
    "toolgym.training": {"toolgym.training", "toolgym.agents"},
}
# heavy third-party module -> the only places (relative paths, prefixes) allowed to import it
HEAVY = {
    "torch": ("agents/", "training/"),
    "transformers": ("agents/", "training/"),
    "vllm": ("agents/vllm_policy.py", "training/weight_sync.py"),
    "docker": ("tools/sandbox/",),
    "ray": ("training/ray_backend.py", "agents/ray_"),
    "peft": ("training/lora.py",),
}
COMPOSITION_ROOTS = {"src/toolgym/cli.py", "src/toolgym/cli_eval.py"}


def _python_files():
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            yield package, path


def _imports(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "toolgym":
        return None
    if len(parts) > 1 and parts[1] in ("envs", "tools", "agents", "training"):
        return f"toolgym.{parts[1]}"
    return "toolgym"


def test_every_subpackage_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, dirs = set(config["packages"]), config["package-dir"]
    for package, folder in FOLDERS.items():
        for init in folder.rglob("__init__.py"):
            if "templates" in init.parts:
                continue
            sub = ".".join([package, *init.parent.relative_to(folder).parts])
            assert sub in listed, (
                f"{sub} ({init.parent}) is missing from [tool.setuptools] packages in pyproject.toml"
            )
        assert (ROOT / dirs[package]).resolve() == folder.resolve()


def test_no_bare_imports_of_mounted_folders():
    for _, path in _python_files():
        for module in _imports(path):
            assert module.split(".")[0] not in ("envs", "tools", "agents", "training"), (
                f"{path.relative_to(ROOT)} imports {module!r}; use 'toolgym.{module}'"
            )


def test_dependency_direction():
    problems = []
    for package, path in _python_files():
        rel = str(path.relative_to(ROOT))
        if rel in COMPOSITION_ROOTS:
            continue
        for module in _imports(path):
            target = _subpackage(module)
            if target is not None and target != "toolgym" and target not in ALLOWED[package]:
                problems.append(f"{rel} imports {module} ({package} may not depend on {target})")
            top = module.split(".")[0]
            if top in HEAVY and not rel.startswith(HEAVY[top]):
                problems.append(f"{rel} imports {top}, allowed only in {', '.join(HEAVY[top])}")
    assert not problems, "\n".join(problems)


def test_dependency_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from toolgym.envs.search_qa import SearchQAEnv\nimport torch\n")
    assert list(_imports(bad)) == ["toolgym.envs.search_qa", "torch"]
    assert _subpackage("toolgym.envs.search_qa") == "toolgym.envs"
    assert "toolgym.envs" not in ALLOWED["toolgym.agents"]
