"""Learner processes as Ray actors: ``train.learners = N`` with ``train.backend = "ray"``.

The data-parallel learner (:mod:`toolgym.training.learners`) needs ranks 1..N-1 to run
:func:`~toolgym.training.learners.worker_main`; with the Ray backend each runs inside a Ray actor
instead of a child process, so Ray places (and, on a GPU node, allocates) them next to the
environment actors. Nothing else changes: the ranks meet at rank 0's ``TCPStore`` and exchange every
step over the same ``torch.distributed`` process group (gloo, or NCCL on CUDA), and a learner's
output goes to ``RUN/learners/rank-K.log``.

:class:`RayLearner` is an actor seen through the small interface the learner group uses on a child
process (``poll``, ``wait``, ``kill``, ``returncode``), plus ``how`` for the error message when it
ended otherwise than by returning.

Placement: the actors are pinned to the trainer's own Ray node (the ranks meet on ``127.0.0.1``);
a learner asks Ray for one GPU when the learner device is CUDA and for no CPU otherwise (a local Ray
instance is sized for the environment actors, and the learner's threads are set by
``policy.threads``, as for a child process).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from toolgym.training.ray_backend import acquire_ray, adopt_sys_path, release_ray, user_sys_path

__all__ = ["LearnerActor", "RayLearner", "start_ray_learner", "stop_ray_learners"]


class LearnerActor:
    """A Ray actor that becomes one learner rank (:meth:`run` returns when rank 0 says stop)."""

    def __init__(self, sys_path: list[str]) -> None:
        adopt_sys_path(sys_path)

    def run(self, environ: Mapping[str, str], log_path: str | None) -> int:
        os.environ.update(environ)
        if log_path is not None:  # the learner's own output, as a child process's would be
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
        from toolgym.training.learners import worker_main

        return worker_main()

    def pid(self) -> int:
        """The actor's process id (for diagnostics and failure tests)."""
        return os.getpid()


class RayLearner:
    """One learner actor and its running :meth:`LearnerActor.run` call, polled like a child process."""

    def __init__(self, ray: Any, actor: Any, ref: Any) -> None:
        self._ray, self._actor, self._ref = ray, actor, ref
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


def start_ray_learner(environ: Mapping[str, str], log_path: Path | None, *, cuda: bool) -> RayLearner:
    """Start a learner (its rank is in ``environ``) in a Ray actor on this node, starting or joining
    Ray; see the module."""
    ray = acquire_ray(1.0)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    remote = ray.remote(LearnerActor).options(
        num_cpus=0,
        num_gpus=1 if cuda else 0,
        max_restarts=0,
        scheduling_strategy=here,
    )
    actor = remote.remote(user_sys_path())
    ref = actor.run.remote(dict(environ), None if log_path is None else str(log_path))
    return RayLearner(ray, actor, ref)


def stop_ray_learners(learners: Mapping[int, Any]) -> None:
    """Kill the learner actors (their work is done or the run stopped) and release Ray."""
    for learner in learners.values():
        if isinstance(learner, RayLearner):
            learner.kill()
    if any(isinstance(learner, RayLearner) for learner in learners.values()):
        release_ray()
