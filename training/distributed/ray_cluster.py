"""The one Ray connection a run shares: its environment actors, its learner actors and its arms.

A run joins a running Ray (``ray.init`` already called, or ``RAY_ADDRESS`` naming a cluster) and never
shuts it down, or starts a local instance and keeps it until its last user releases it
(:func:`acquire_ray` / :func:`release_ray`). Actors import what the learner imported: the user's own
import-path entries travel with them (:func:`user_sys_path`, :func:`adopt_sys_path`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

from toolgym.errors import MissingDependencyError

__all__ = ["acquire_ray", "adopt_sys_path", "release_ray", "require_ray", "user_sys_path"]

#: Object store of a local instance: only chat messages travel through it.
LOCAL_OBJECT_STORE_BYTES = 256 * 1024**2


def require_ray() -> ModuleType:
    """The ``ray`` module, or a fix-it error naming the extra that installs it."""
    try:
        import ray
    except ImportError as exc:
        raise MissingDependencyError("ray", "ray", "train.rollouts.backend = 'ray'") from exc
    return ray


#: How many users (environment pools, learner groups) hold the Ray connection this process opened.
_OPENED = {"users": 0}


def acquire_ray(num_cpus: float) -> ModuleType:
    """The ``ray`` module, connected: a running Ray (``ray.init`` already called) is joined and never
    shut down here; otherwise this process connects (``RAY_ADDRESS``) or starts a local instance with
    ``num_cpus`` CPUs, and keeps it until the last :func:`release_ray`."""
    ray = require_ray()
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(include_dashboard=False)
        else:
            ray.init(
                address="local",  # a new instance, even beside a cluster another `ray start` left running
                num_cpus=max(1, round(num_cpus)),
                include_dashboard=False,
                object_store_memory=LOCAL_OBJECT_STORE_BYTES,
            )
        _OPENED["users"] = 0
        _OPENED["opened"] = 1
    if _OPENED.get("opened"):
        _OPENED["users"] += 1
    return ray


def release_ray() -> None:
    """One user of :func:`acquire_ray` is done; the last one shuts down a connection this process opened."""
    if not _OPENED.get("opened"):
        return
    _OPENED["users"] -= 1
    if _OPENED["users"] <= 0:
        _OPENED["opened"] = 0
        ray = require_ray()
        if ray.is_initialized():
            ray.shutdown()


def user_sys_path() -> list[str]:
    """Import-path entries added by the user (not the interpreter's own), for the actors.

    Gymnasium's ``module:id`` form imports ``module`` before making the environment; the actors must be
    able to import it too, wherever the learner found it.
    """
    prefixes = {str(Path(p).resolve()) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    out = []
    for entry in sys.path:
        if not entry or not Path(entry).is_dir():
            continue
        resolved = str(Path(entry).resolve())
        if not any(resolved == p or resolved.startswith(p + os.sep) for p in prefixes):
            out.append(resolved)
    return out


def adopt_sys_path(entries: list[str]) -> None:
    """In an actor: put the learner's :func:`user_sys_path` entries first on the import path."""
    for entry in reversed(entries):
        if entry not in sys.path:
            sys.path.insert(0, entry)
