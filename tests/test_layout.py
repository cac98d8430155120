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
#: module paths of earlier releases, removed (CHANGELOG.md lists where each moved): nothing may import them
REMOVED = (
    "toolgym.manifest",
    "toolgym.trackers",
    "toolgym.audit",
    "toolgym.remote",
    "toolgym.agents.exports",
    "toolgym.agents.chat_formats",
    "toolgym.agents.hf_policy",
    "toolgym.agents.specs",
    "toolgym.agents.evaluate",
    "toolgym.training.grpo",
    "toolgym.training.learners",
    "toolgym.training.rollouts",
    "toolgym.training.ray_backend",
    "toolgym.training.prefix",
    "toolgym.training.policies",
    "toolgym.training.arms",
    "toolgym.training.heldout_run",
    "toolgym.training.warm_start_phase",
)
#: inside toolgym.training and toolgym.agents, each sub-package's rank: a module imports only modules of
#: its own sub-package or of a lower rank ("top" is the package's own top-level modules)
RANKS = {
    "toolgym.training": {
        "config": -1,
        "learn": 0,
        "distributed": 1,
        "sampling": 2,
        "heldout": 2,
        "warm_start": 3,
        "top": 4,
        "experiments": 5,
    },
    "toolgym.agents": {"chat": 0, "policies": 1, "top": 2, "eval": 3},
}
#: function-level imports of toolgym modules in agents/ and training/, each lazy for a reason: the policy
#: kind's module (and its heavy or optional stack: transformers, vLLM) loads only for the kind built
LAZY = {
    ("training/policy_build.py", "toolgym.agents.policies.hf"),
    ("training/policy_build.py", "toolgym.agents.policies.vllm"),
    ("training/policy_build.py", "toolgym.agents.policies.vllm_server"),
    ("training/policy_build.py", "toolgym.training.tiny_policy"),
    ("agents/policies/factory.py", "toolgym.agents.policies.http"),
    ("agents/policies/factory.py", "toolgym.agents.policies.hf"),
    ("agents/policies/factory.py", "toolgym.agents.policies.vllm"),
    ("agents/policies/vllm_weights.py", "toolgym.errors"),  # runs inside vLLM's worker processes
}
#: ``python -m toolgym``: the command's entry point, beside the core but part of the composition root
#: (it only calls toolgym.cli's main; nothing imports it)
ENTRY_POINTS = {"src/toolgym/__main__.py": "toolgym.cli"}
# heavy third-party module -> the only places (relative paths, prefixes) allowed to import it
HEAVY = {
    "torch": ("agents/", "training/", "tools/search/encoder.py"),
    "transformers": ("agents/", "training/", "tools/search/encoder.py"),
    "faiss": ("tools/search/dense.py",),
    "vllm": ("agents/policies/vllm.py", "training/weight_sync.py"),
    "docker": ("tools/sandbox/",),
    "ray": (
        "training/sampling/ray_envs.py",
        "training/distributed/ray_actors.py",
        "training/distributed/ray_cluster.py",
    ),
    "peft": ("training/learn/lora.py",),
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


def _imports(path: Path, *, names: bool = False):
    """The modules ``path`` imports anywhere; ``names``: also ``module.name`` for each ``from module
    import name`` (the name may be a module of its own)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            if names:
                yield from (f"{node.module}.{alias.name}" for alias in node.names)


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
        if layer in apps:
            continue
        for module in _imports(path):
            assert _subpackage(module) not in apps, f"{path.relative_to(ROOT)} imports {module}"


def test_removed_module_paths_are_gone_and_imported_nowhere():
    problems = [m for m in REMOVED if _module_file(m) is not None]
    for _, path in _python_files():
        for module in _imports(path):
            if module in REMOVED or any(module.startswith(m + ".") for m in REMOVED):
                problems.append(f"{path.relative_to(ROOT)} imports {module}, a removed path (CHANGELOG.md)")
    assert not problems, "\n".join(problems)


def _module_file(module: str) -> Path | None:
    parts = module.split(".")
    for package, folder in sorted(FOLDERS.items(), key=lambda kv: -len(kv[0])):
        if module == package or module.startswith(package + "."):
            rest = parts[len(package.split(".")) :]
            for candidate in (
                folder.joinpath(*rest).with_suffix(".py"),
                folder.joinpath(*rest, "__init__.py"),
            ):
                if rest and candidate.is_file():
                    return candidate
    return None


def _sub_of(package: str, module: str) -> str | None:
    """The sub-package of ``package`` a module belongs to (``top`` for its top-level modules)."""
    if not module.startswith(package + "."):
        return None
    rest = module[len(package) + 1 :].split(".")
    return rest[0] if rest[0] in RANKS[package] else "top"


def _module_of(path: Path) -> str:
    for package, folder in FOLDERS.items():
        if folder in path.parents and (
            package != "toolgym" or f"toolgym.{path.relative_to(folder).parts[0]}" not in FOLDERS
        ):
            parts = path.relative_to(folder).with_suffix("").parts
            return ".".join([package, *parts]).removesuffix(".__init__")
    raise AssertionError(path)


def test_sub_packages_import_one_way():
    """training: experiments -> the top -> sampling, heldout -> distributed -> learn -> config; agents: eval -> the
    top (rollout, harness, compaction) -> policies -> chat."""
    problems = []
    for package, ranks in RANKS.items():
        for path in FOLDERS[package].rglob("*.py"):
            here = _sub_of(package, _module_of(path))
            if here is None:
                continue
            for module in _imports(path):
                there = _sub_of(package, module)
                if there is not None and there != here and ranks[there] >= ranks[here]:
                    problems.append(f"{path.relative_to(ROOT)} ({here}) imports {module} ({there})")
    assert not problems, "\n".join(problems)


def test_the_config_package_imports_no_runtime_code():
    """training/config is read by every layer that runs (and by the help and the arms planner before any
    model loads): it imports the core and itself, never agents, envs, tools or the rest of training."""
    problems = []
    for path in (ROOT / "training" / "config").rglob("*.py"):
        for module in _imports(path):
            layer = _subpackage(module)
            if layer in ("toolgym.agents", "toolgym.envs", "toolgym.tools") or (
                layer == "toolgym.training" and not module.startswith("toolgym.training.config")
            ):
                problems.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not problems, "\n".join(problems)


def test_toolgym_imports_sit_at_module_level_unless_listed_lazy():
    problems = []
    for package in RANKS:
        for path in FOLDERS[package].rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            tree = ast.parse(path.read_text(encoding="utf-8"))
            top = {id(n) for n in tree.body}
            for node in ast.walk(tree):
                lazy = isinstance(node, ast.ImportFrom) and id(node) not in top
                if lazy and (node.module or "").startswith("toolgym") and (rel, node.module) not in LAZY:
                    problems.append(f"{rel}:{node.lineno} imports {node.module} inside a function")
    assert not problems, "\n".join(problems)


def _module_imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """For each module, the toolgym modules it imports anywhere (at module level, inside a function or
    under ``TYPE_CHECKING``), a package importing its own child modules or a module its own package
    not counted."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = {
            m
            for m in _imports(path, names=True)
            if m in modules and m != name and not name.startswith(m + ".") and not m.startswith(name + ".")
        }
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or around a longer loop (Tarjan)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return found


def test_no_two_modules_import_each_other():
    """No import circle between toolgym's modules, counting every import (a function-level or
    ``TYPE_CHECKING`` import that closes a loop is still a circle: the two modules are one idea split in
    two, or one of them holds something of the other's)."""
    modules = {_module_of(path): path for _, path in _python_files()}
    assert {"toolgym.core", "toolgym.cli.main", "toolgym.tools.search.index"} <= set(modules)
    circles = _circles(_module_imports(modules))
    assert not circles, "\n".join(" <-> ".join(group) for group in circles)


def test_dependency_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from toolgym.envs.search_qa import SearchQAEnv\nimport torch\n")
    assert list(_imports(bad)) == ["toolgym.envs.search_qa", "torch"]
    assert _subpackage("toolgym.envs.search_qa") == "toolgym.envs"
    assert "toolgym.envs" not in ALLOWED["toolgym.agents"]
    assert _layer_of(CORE / "serving" / "client.py") == "toolgym.serving"
    assert _subpackage("toolgym.serving.client") not in ALLOWED["toolgym"]
    assert _sub_of("toolgym.training", "toolgym.training.learn.loss") == "learn"
    assert _sub_of("toolgym.training", "toolgym.training.trainer") == "top"
    assert RANKS["toolgym.training"]["learn"] < RANKS["toolgym.training"]["top"]
    assert (
        _module_file("toolgym.training.trainer") is not None and _module_file("toolgym.training.grpo") is None
    )
    # the circle check: a loop through a function-level import and a loop of three are both found
    (tmp_path / "a.py").write_text("from toolgym.b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from toolgym import a\n")
    (tmp_path / "c.py").write_text("import toolgym.a\n")
    modules = {f"toolgym.{n}": tmp_path / f"{n}.py" for n in "abc"}
    assert _circles(_module_imports(modules)) == [["toolgym.a", "toolgym.b"]]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# ----------------------------------------------------------------------------- markers of the tests
def _marks(decorators: list[ast.expr]) -> set[str]:
    """The ``pytest.mark.NAME`` names among ``decorators`` (a module's ``pytestmark`` too)."""
    return {
        sub.attr
        for node in decorators
        for sub in ast.walk(node)
        if isinstance(sub, ast.Attribute)
        and isinstance(sub.value, ast.Attribute)
        and sub.value.attr == "mark"
    }


def _calls(node: ast.AST) -> set[str]:
    return {
        n.func.id if isinstance(n.func, ast.Name) else n.func.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name | ast.Attribute)
    }


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def _uses(function: ast.AST, local: dict[str, ast.AST], needle: str, seen: set[str]) -> bool:
    """Whether ``function`` calls ``needle``, itself or through a fixture or helper it names."""
    names = _calls(function)
    if needle in names:
        return True
    if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
        names |= {a.arg for a in function.args.args}
    return any(
        name in local and name not in seen and _uses(local[name], local, needle, seen | {name})
        for name in names
    )


def test_every_test_that_uses_docker_carries_the_docker_marker():
    """A Docker test runs in the Docker lane of the suite's workers (tests/conftest.py), where the test
    that stops the engine runs last: one without the marker could meet the engine stopped. Any test
    reaching ``need_docker()`` (its fixtures, the conftest's fixtures, its helpers) is marked."""
    unmarked = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        local: dict[str, ast.AST] = {}
        for conftest in [*reversed(path.parents), path]:
            if conftest == path or (conftest / "conftest.py").is_file():
                source = path if conftest == path else conftest / "conftest.py"
                if ROOT / "tests" in source.parents or source == path:
                    local.update(_functions(ast.parse(source.read_text(encoding="utf-8"))))
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module = next(
            (
                _marks([n.value])
                for n in tree.body
                if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
            ),
            set(),
        )
        for name, function in _functions(tree).items():
            if not name.startswith("test") or {"docker", "stops_docker"} & (
                module | _marks(function.decorator_list)
            ):
                continue
            if _uses(function, {k: v for k, v in local.items() if k != name}, "need_docker", {name}):
                unmarked.append(f"{path.relative_to(ROOT)}::{name}")
    assert not unmarked, "mark these @pytest.mark.docker:\n" + "\n".join(unmarked)


def test_the_docker_marker_check_follows_fixtures_and_helpers():
    tree = ast.parse(
        "@pytest.fixture\ndef box():\n    need_docker()\n    return 1\n"
        "def helper():\n    return box_maker()\n"
        "def box_maker():\n    need_docker()\n"
        "def test_fixture(box):\n    pass\n"
        "def test_helper():\n    helper()\n"
        "def test_neither(tmp_path):\n    pass\n"
        "@pytest.mark.docker\ndef test_marked(box):\n    pass\n"
    )
    local = _functions(tree)
    used = {name for name in local if _uses(local[name], local, "need_docker", {name})}
    assert used >= {"test_fixture", "test_helper", "test_marked"} and "test_neither" not in used
    assert _marks(local["test_marked"].decorator_list) == {"docker"}
