"""Layout and dependency-direction checks (ARCHITECTURE.md, "Dependency rule"), on the source tree."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "src" / "toolgym"
#: the mounted folders (pyproject's package-dir)
FOLDERS = {
    "toolgym": CORE,
    **{f"toolgym.{d}": ROOT / d for d in ("envs", "tools", "agents", "training")},
}
#: the applications and adapters inside src/toolgym: sub-packages of their own, outside the core
APPLICATIONS = ("cli", "records", "serving", "interop")
LAYERS = ("envs", "tools", "agents", "training", *APPLICATIONS)

# layer -> the toolgym layers it may import (the core "toolgym" is always allowed, and imports none)
ALLOWED = {
    "toolgym": set(),
    "toolgym.records": set(),
    "toolgym.tools": {"toolgym.tools"},
    "toolgym.envs": {"toolgym.envs", "toolgym.tools"},
    "toolgym.agents": {"toolgym.agents", "toolgym.records"},
    "toolgym.training": {"toolgym.training", "toolgym.agents", "toolgym.records"},
    "toolgym.interop": {"toolgym.interop"},
    "toolgym.serving": {"toolgym.serving", "toolgym.records", "toolgym.interop"},
    "toolgym.cli": {f"toolgym.{name}" for name in LAYERS},  # the composition root
}
#: old import paths kept in the core: each module is only an alias of its new home (toolgym.lazy)
ALIASES = {
    "src/toolgym/manifest.py": "toolgym.records.manifest",
    "src/toolgym/trackers.py": "toolgym.records.trackers",
    "src/toolgym/audit.py": "toolgym.envs.audit",
    "src/toolgym/remote.py": "toolgym.serving.client",
    "agents/exports.py": "toolgym.agents.run_exports",
}
#: ``python -m toolgym``: the command's entry point, beside the core but part of the composition root
#: (it only calls toolgym.cli's main; nothing imports it)
ENTRY_POINTS = {"src/toolgym/__main__.py": "toolgym.cli"}
# heavy third-party module -> the only places (relative paths, prefixes) allowed to import it
HEAVY = {
    "torch": ("agents/", "training/", "tools/search/encoder.py"),
    "transformers": ("agents/", "training/", "tools/search/encoder.py"),
    "faiss": ("tools/search/dense.py",),
    "vllm": ("agents/vllm_policy.py", "training/weight_sync.py"),
    "docker": ("tools/sandbox/",),
    "ray": ("training/ray_backend.py", "training/learner_actors.py", "agents/ray_"),
    "peft": ("training/lora.py",),
}


def _layer_of(path: Path) -> str:
    """The layer a source file belongs to: its mounted folder, or an application sub-package of the core."""
    if str(path.relative_to(ROOT)) in ENTRY_POINTS:
        return ENTRY_POINTS[str(path.relative_to(ROOT))]
    for package, folder in FOLDERS.items():
        if folder in path.parents:
            if package == "toolgym":
                first = path.relative_to(folder).parts[0]
                if first in APPLICATIONS:
                    return f"toolgym.{first}"
            return package
    raise AssertionError(path)


def _python_files():
    for folder in FOLDERS.values():
        for path in folder.rglob("*.py"):
            yield _layer_of(path), path


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
    if len(parts) > 1 and parts[1] in LAYERS:
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
    """Each layer imports only what ALLOWED says; in particular the core imports no other layer."""
    problems = []
    for layer, path in _python_files():
        rel = str(path.relative_to(ROOT))
        if rel in ALIASES:
            continue
        for module in _imports(path):
            target = _subpackage(module)
            if target is not None and target != "toolgym" and target not in ALLOWED[layer]:
                problems.append(f"{rel} imports {module} ({layer} may not depend on {target})")
            top = module.split(".")[0]
            if top in HEAVY and not rel.startswith(HEAVY[top]):
                problems.append(f"{rel} imports {top}, allowed only in {', '.join(HEAVY[top])}")
    assert not problems, "\n".join(problems)


def test_applications_are_imported_only_by_applications():
    """The one-way rule of the core and the applications: no lower layer reaches up into them."""
    apps = {f"toolgym.{name}" for name in ("cli", "serving", "interop")}
    for layer, path in _python_files():
        if layer in apps or str(path.relative_to(ROOT)) in ALIASES:
            continue
        for module in _imports(path):
            assert _subpackage(module) not in apps, f"{path.relative_to(ROOT)} imports {module}"


def test_old_import_paths_are_only_aliases():
    """A kept old path holds nothing but its alias: one star import for type checkers, one alias call."""
    for rel, target in ALIASES.items():
        tree = ast.parse((ROOT / rel).read_text(encoding="utf-8"))
        body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        imported = [n.module for n in body if isinstance(n, ast.ImportFrom)]
        assert sorted(imported) == sorted(["__future__", "toolgym.lazy", target]), (rel, imported)
        (call,) = [n for n in body if isinstance(n, ast.Expr)]
        assert isinstance(call.value, ast.Call) and ast.literal_eval(call.value.args[1]) == target, rel


def test_dependency_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from toolgym.envs.search_qa import SearchQAEnv\nimport torch\n")
    assert list(_imports(bad)) == ["toolgym.envs.search_qa", "torch"]
    assert _subpackage("toolgym.envs.search_qa") == "toolgym.envs"
    assert "toolgym.envs" not in ALLOWED["toolgym.agents"]
    assert _layer_of(CORE / "serving" / "client.py") == "toolgym.serving"
    assert _subpackage("toolgym.serving.client") not in ALLOWED["toolgym"]
