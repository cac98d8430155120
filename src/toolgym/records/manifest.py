"""Run manifests: what a run's numbers depend on, written as ``manifest.json`` next to them.

``toolgym eval`` and ``toolgym train`` write one per run directory. It records the toolgym version and
git commit, the environment (id, constructor arguments, split, turn budget, a hash of its task data,
a hash of the first observation of its first task, which holds the rendered tool schemas and the
worked example, and the environment's own :meth:`provenance`: index keys and corpus hashes, the
sandbox image), the run's tracks, task ids, seeds, token budget and sampling, the policy spec with a
hash of its weights, and the machine (CPU, GPU, library versions).

Two runs are comparable when everything that decides *which task is posed and how it is scored*
agrees: :data:`TASK_FIELDS`. The policy, sampling, budgets and machine may differ (that is usually
the point of a comparison) and are only shown. :func:`manifest_differences` lists the task fields that
differ, as dotted keys (``env.data_sha256``); a caller may ``allow`` some explicitly (a prefix allows
everything under it).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from toolgym.errors import ConfigError
from toolgym.registry import explicit_kwargs
from toolgym.run_files import write_atomic

__all__ = [
    "RUN_MANIFEST",
    "TASK_FIELDS",
    "env_fingerprint",
    "flatten",
    "machine_facts",
    "manifest_differences",
    "public_name",
    "read_run_manifest",
    "run_manifest",
    "weights_sha256",
    "write_run_manifest",
]

RUN_MANIFEST = "manifest.json"
FORMAT = 1
#: Dotted prefixes of the fields that decide the task and its scoring (compared strictly).
TASK_FIELDS = (
    "format",
    "toolgym.version",
    "env",
    "run.harnesses",
    "run.task_ids_sha256",
    "run.seeds_sha256",
)
_LIBRARIES = ("gymnasium", "numpy", "torch", "transformers", "vllm", "docker", "pyserini")


def _sha256(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def _git_commit() -> str | None:
    """The commit of the toolgym checkout this module runs from, or ``None`` (an installed wheel)."""
    root = Path(__file__).resolve().parents[3]  # src/toolgym/records/manifest.py -> the checkout
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + ("+dirty" if dirty else "")


def machine_facts() -> dict[str, Any]:
    """CPU, GPU (when torch is already loaded and sees one) and the versions of the libraries that matter."""
    versions = {}
    for name in _LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "libraries": versions,
    }
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        facts["gpu"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return facts


@functools.lru_cache(maxsize=16)
def _weights_sha256(directory: str, stamp: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for name, _, _ in stamp:
        digest.update(name.encode())
        with (Path(directory) / name).open("rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def weights_sha256(model_dir: str | Path) -> str | None:
    """sha256 over a model directory's ``*.safetensors`` files (name and bytes), or ``None`` if none."""
    directory = Path(model_dir)
    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file()) if directory.is_dir() else []
    if not files:
        return None
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _weights_sha256(str(directory.resolve()), stamp)


def public_name(cls: type) -> str:
    """A class's name by the package that exports it: ``toolgym.envs.search_qa.SearchQAEnv``, not the
    module inside the package that defines it, so manifests do not change when a package's files do."""
    import sys

    module = cls.__module__
    parent = module.rpartition(".")[0]
    if parent and getattr(sys.modules.get(parent), cls.__qualname__, None) is cls:
        module = parent
    return f"{module}.{cls.__qualname__}"


def env_fingerprint(env: Any, env_id: str, env_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """What decides an environment's tasks and scoring: data, prompts, tools and its own provenance.

    ``env`` is a fresh environment of ``env_id`` (wrapped or not); it is reset once, on its first
    task with seed 0, to hash the first observation.
    """
    base = env.unwrapped
    tasks = list(getattr(base, "tasks", ()))
    fingerprint: dict[str, Any] = {
        "id": env_id,
        "kwargs": json.loads(json.dumps(dict(env_kwargs), default=str)),
        "class": public_name(type(base)),
        "split": getattr(base, "split", None),
        "max_turns": getattr(base, "max_turns", None),
        "n_tasks": len(tasks),
        "data_sha256": _sha256([[t.id, t.prompt, t.reference] for t in tasks]),
    }
    if tasks:
        obs, _ = env.reset(seed=0, options={"task_id": tasks[0].id})
        fingerprint["first_observation_sha256"] = _sha256(obs)
    provenance = getattr(base, "provenance", None)
    fingerprint["provenance"] = provenance() if callable(provenance) else {}
    return fingerprint


def run_manifest(
    *,
    env: Mapping[str, Any],
    run: Mapping[str, Any],
    policy: Mapping[str, Any],
    kind: str,
) -> dict[str, Any]:
    """A manifest (see the module docstring); ``run`` may carry ``task_ids`` and ``seeds`` lists, which
    are stored with their hashes (the hashes are what comparisons look at)."""
    import toolgym

    run = dict(run)
    for key in ("task_ids", "seeds"):
        if key in run:
            run[f"{key}_sha256"] = _sha256(list(run[key]))
    policy = dict(policy)
    model_dir = policy.get("model_dir")
    if model_dir and "weights_sha256" not in policy:
        policy["weights_sha256"] = weights_sha256(model_dir)
    return {
        "format": FORMAT,
        "kind": kind,
        "toolgym": {"version": toolgym.__version__, "git_commit": _git_commit()},
        "env": dict(env),
        "run": run,
        "policy": policy,
        "machine": machine_facts(),
    }


def write_run_manifest(out_dir: str | Path, manifest: Mapping[str, Any]) -> Path:
    path = Path(out_dir) / RUN_MANIFEST
    write_atomic(path, json.dumps(manifest, indent=2, default=str) + "\n")  # never through a planted link
    return path


def read_run_manifest(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's manifest, or ``None`` when it has none (a run from before manifests).

    Raises:
        ConfigError: an unreadable manifest, or one written by a newer toolgym (its format is unknown).
    """
    path = Path(run_dir) / RUN_MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"{path} is not readable JSON ({exc}); re-run the evaluation to rewrite it"
        ) from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("format"), int):
        raise ConfigError(f"{path} is not a toolgym run manifest (no integer 'format')")
    if manifest["format"] > FORMAT:
        written = manifest.get("toolgym", {}).get("version", "?")
        import toolgym

        raise ConfigError(
            f"{path} was written by a newer toolgym ({written}, manifest format {manifest['format']}); this is "
            f"toolgym {toolgym.__version__} (format {FORMAT}). Fix: upgrade toolgym to read it"
        )
    return manifest


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``{"a.b.c": leaf}`` (lists are leaves)."""
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def _under(key: str, prefixes: Sequence[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def manifest_differences(
    a: Mapping[str, Any], b: Mapping[str, Any], *, allow: Sequence[str] = ()
) -> list[str]:
    """``"field: A vs B"`` for every task field (:data:`TASK_FIELDS`) that differs and is not allowed
    (an environment argument given at the environment's default equals one left out:
    :func:`~toolgym.registry.explicit_kwargs`)."""
    fa, fb = flatten(_defaults_dropped(a)), flatten(_defaults_dropped(b))
    out = []
    for key in sorted(set(fa) | set(fb)):
        if not _under(key, TASK_FIELDS) or _under(key, allow):
            continue
        if fa.get(key) != fb.get(key):
            out.append(f"{key}: {_short(fa.get(key, '(absent)'))} vs {_short(fb.get(key, '(absent)'))}")
    return out


def _defaults_dropped(manifest: Mapping[str, Any]) -> Mapping[str, Any]:
    env = manifest.get("env")
    if not isinstance(env, Mapping) or not isinstance(env.get("kwargs"), Mapping) or "id" not in env:
        return manifest
    return {**manifest, "env": {**env, "kwargs": explicit_kwargs(str(env["id"]), env["kwargs"])}}


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."
