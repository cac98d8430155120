"""Learner processes as Ray actors: ``train.learners.count = N`` with ``train.rollouts.backend = "ray"``.

The data-parallel learner (:mod:`toolgym.training.distributed.learners`) needs ranks 1..N-1 to run
:func:`~toolgym.training.distributed.worker.worker_main`; with the Ray backend each runs inside a Ray actor
instead of a child process, so Ray places (and, on a GPU node, allocates) them next to the
environment actors. Nothing else changes: the ranks meet at rank 0's ``TCPStore`` and exchange every
step over the same ``torch.distributed`` process group (gloo, or NCCL on CUDA).

:class:`RayLearner` is an actor seen through the small interface the learner group uses on a child
process (``poll``, ``wait``, ``kill``, ``returncode``), plus ``how`` for the error message when it
ended otherwise than by returning.

Placement (``train.learners.nodes``): by default the actors are pinned to the trainer's own Ray node
and the ranks meet on ``127.0.0.1``. With ``"any"`` Ray places them wherever in the cluster the
resources they ask for are free (one GPU each when the learner device is CUDA, plus
``train.learners.resources``, e.g. a custom ``learner_slot`` that the nodes meant for learners were
started with), and the ranks meet at the trainer node's address (``ray.util.get_node_ip_address``).
A cluster that does not have those resources in all is refused before any actor starts (a Ray
actor would otherwise wait for them until the join times out). The gloo and NCCL interface settings
(``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``) travel to the actors when set.

A learner asks Ray for no CPU unless told (a local Ray instance is sized for the environment actors,
and the learner's threads are set by ``policy.threads``, as for a child process). Its output goes to
``RUN/learners/rank-K.log`` where that directory exists on its node (the trainer's node, or a shared
file system), else to a file in its node's temporary directory (:func:`learner_log_path`);
``RUN/learners/placement.json`` records where each rank ran (node, address, pid, log).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from toolgym.errors import ConfigError
from toolgym.run_files import write_atomic
from toolgym.training.distributed.ray_cluster import acquire_ray, adopt_sys_path, release_ray, user_sys_path
from toolgym.training.distributed.rendezvous import (
    INTERFACE_ENV,  # re-exported: the settings passed to actors
)
from toolgym.training.distributed.worker import worker_main

__all__ = [
    "INTERFACE_ENV",
    "LearnerActor",
    "RayLearner",
    "RayLearners",
    "actor_options",
    "check_cluster_resources",
    "learner_log_path",
]


def learner_log_path(requested: str | None) -> Path | None:
    """Where a learner actor writes its output: ``requested`` (``RUN/learners/rank-K.log``) when its
    directory exists on this node, else a file named after it in this node's temporary directory."""
    if requested is None:
        return None
    path = Path(requested)
    if path.parent.is_dir():
        return path
    digest = hashlib.sha256(str(path.parent).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / "toolgym-learners" / f"{digest}-{path.name}"


class LearnerActor:
    """A Ray actor that becomes one learner rank (:meth:`run` returns when rank 0 says stop)."""

    def __init__(self, sys_path: list[str]) -> None:
        adopt_sys_path(sys_path)

    def run(self, environ: Mapping[str, str], log_path: str | None) -> int:
        os.environ.update(environ)
        path = learner_log_path(log_path)
        if path is not None:  # the learner's own output, as a child process's would be
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)

        return worker_main()

    def pid(self) -> int:
        """The actor's process id (for diagnostics and failure tests)."""
        return os.getpid()

    def where(self, log_path: str | None) -> dict[str, Any]:
        """Where this actor runs: its Ray node, the node's address, its pid, its log's path there."""
        import ray

        path = learner_log_path(log_path)
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "address": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "log": None if path is None else str(path),
        }


class RayLearner:
    """One learner actor and its running :meth:`LearnerActor.run` call, polled like a child process."""

    def __init__(self, ray: Any, actor: Any, ref: Any, where: Any = None) -> None:
        self._ray, self._actor, self._ref, self._where = ray, actor, ref, where
        self.returncode: int | None = None
        self.how = ""  # how it ended, when not by returning an exit code

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        ray = self._ray
        ready, _ = ray.wait([self._ref], timeout=0)
        if not ready:
            return None
        try:
            self.returncode = int(ray.get(self._ref))
        except ray.exceptions.RayTaskError as exc:  # worker_main raised: its exception names the cause
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            first_line = (str(cause).splitlines() or [""])[0]
            self.returncode, self.how = 1, f"raised {type(cause).__name__}: {first_line}"
        except ray.exceptions.RayError as exc:  # the actor's process died (killed, out of memory)
            self.returncode, self.how = -9, f"its Ray actor died: {type(exc).__name__}"
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._ray.wait([self._ref], timeout=timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired("ray learner actor", timeout or 0.0)
        return code

    def kill(self) -> None:
        self._ray.kill(self._actor)

    def where(self, timeout: float = 30.0) -> dict[str, Any]:
        """Where the actor runs (:meth:`LearnerActor.where`, asked when it started)."""
        if self._where is None:
            return {}
        return dict(self._ray.get(self._where, timeout=timeout))


def actor_options(*, cuda: bool, nodes: str, resources: Mapping[str, float], node_id: str) -> dict[str, Any]:
    """The Ray options of one learner actor: pinned to ``node_id`` (``nodes = "trainer"``) or placed
    anywhere by its resources (``"any"``); one GPU on CUDA, no CPU, unless ``resources`` says."""
    custom = {k: float(v) for k, v in resources.items() if k not in ("CPU", "GPU")}
    options: dict[str, Any] = {
        "num_cpus": float(resources.get("CPU", 0)),
        "num_gpus": float(resources.get("GPU", 1 if cuda else 0)),
        "max_restarts": 0,
    }
    if custom:
        options["resources"] = custom
    if nodes == "trainer":
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    return options


def check_cluster_resources(
    total: Mapping[str, float], options: Mapping[str, Any], count: int, *, where: str = "the Ray cluster"
) -> None:
    """Refuse ``count`` learner actors with ``options`` that ``where`` (with resources ``total``: the
    cluster's, or the trainer node's when they are pinned there) could never hold: Ray would keep them
    pending until the join times out."""
    wanted = {"CPU": options.get("num_cpus", 0), "GPU": options.get("num_gpus", 0)}
    wanted.update(options.get("resources", {}))
    short = {k: v * count for k, v in wanted.items() if v > 0 and total.get(k, 0.0) < v * count}
    if short:
        asked = ", ".join(f"{k}={v:g}" for k, v in sorted(short.items()))
        has = ", ".join(f"{k}={total.get(k, 0.0):g}" for k in sorted(short))
        raise ConfigError(
            f"{count} learner actor(s) need {asked} in all, and {where} has {has}: start nodes that "
            "have them (e.g. `ray start --address ... --resources '{\"learner_slot\": 1}'`), or "
            "change train.learners.nodes / train.learners.resources / train.learners.count"
        )


class RayLearners:
    """The learner group's Ray side: one Ray connection held from :meth:`open` to :meth:`close`, the
    actors' options (checked once against the cluster), where the ranks meet, and where each ran."""

    def __init__(self, *, cuda: bool, nodes: str, resources: Mapping[str, float]) -> None:
        self.cuda, self.nodes, self.resources = cuda, nodes, dict(resources)
        self.ray: Any = None
        self.options: dict[str, Any] = {}
        self.trainer: dict[str, str] = {}  # rank 0's Ray node and its address
        self.placed: dict[int, dict[str, Any]] = {}  # where each rank ran (placement.json)

    def open(self, count: int) -> str:
        """Connect (starting or joining Ray), refuse ``count`` actors the cluster could never hold, and
        return the address the ranks meet rank 0's store at (it listens on every interface)."""
        ray = acquire_ray(1.0)
        try:
            node_id = str(ray.get_runtime_context().get_node_id())
            self.trainer = {"node_id": node_id, "address": str(ray.util.get_node_ip_address())}
            self.options = actor_options(
                cuda=self.cuda, nodes=self.nodes, resources=self.resources, node_id=node_id
            )
            if self.nodes == "trainer":
                own = [n.get("Resources", {}) for n in ray.nodes() if n.get("NodeID") == node_id]
                check_cluster_resources(
                    own[0] if own else {}, self.options, count, where="the trainer's Ray node"
                )
            else:
                check_cluster_resources(ray.cluster_resources(), self.options, count)
        except BaseException:
            release_ray()
            raise
        self.ray = ray
        return "127.0.0.1" if self.nodes == "trainer" else self.trainer["address"]

    def start(self, environ: Mapping[str, str], log_path: Path | None) -> RayLearner:
        """Start one learner (its rank is in ``environ``) in a Ray actor."""
        passed = {k: os.environ[k] for k in INTERFACE_ENV if k in os.environ}
        actor = self.ray.remote(LearnerActor).options(**self.options).remote(user_sys_path())
        log = None if log_path is None else str(log_path)
        where = actor.where.remote(log)  # answered before run: the actor takes one call at a time
        ref = actor.run.remote({**passed, **environ}, log)
        return RayLearner(self.ray, actor, ref, where)

    def record(self, learners: Mapping[int, RayLearner], master_addr: str, log_dir: Path | None) -> None:
        """Ask each started actor where it runs; write ``LOG_DIR/placement.json``."""
        for rank, learner in learners.items():
            try:
                self.placed[rank] = learner.where()
            except Exception as exc:  # noqa: BLE001 (a record for the user; the next collective tells)
                self.placed[rank] = {"unknown": f"{type(exc).__name__}: {exc}"}
        if log_dir is not None:
            record = {"master_addr": master_addr, "trainer": self.trainer, "ranks": self.placed}
            write_atomic(log_dir / "placement.json", json.dumps(record, indent=2))

    def log_elsewhere(self, rank: int) -> str:
        """Where rank's log is when it is not in the run's directory here (``""`` when unknown)."""
        where = self.placed.get(rank)
        return f"; its log is {where.get('log')} on {where.get('address')}" if where else ""

    def close(self, learners: Mapping[int, Any]) -> None:
        """Kill the actors (their work is done or the run stopped) and release Ray. Idempotent."""
        for learner in learners.values():
            if isinstance(learner, RayLearner):
                learner.kill()
        if self.ray is not None:
            self.ray = None
            release_ray()
