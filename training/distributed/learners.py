"""The data-parallel learner: N processes share each GRPO step's gradient over ``torch.distributed``.

Rank 0 is the trainer (:class:`~toolgym.training.trainer.Trainer`): it samples, plans the step, writes
checkpoints and publishes weights, exactly as with one learner. Ranks 1..N-1 are learner processes
that hold a copy of the trained model and its optimizer and do nothing but compute gradients
(:func:`worker_main`). One step, with ``train.learners.count = N``:

1. rank 0 broadcasts the step's plan (the groups that carry signal, with their advantages);
2. every rank takes its share of the groups, balanced by token count (:func:`shard_groups`), and
   accumulates their gradient with the **whole step's** token and sequence counts as the loss's
   denominators, so the ranks' gradients *sum* to the step's gradient (a rank with no group this step
   contributes zeros and still joins the collectives);
3. the gradients are summed over ranks (``all_reduce``, in fp32 buckets) once, after the whole
   accumulation: a group's shared prompt prefix sends its gradient through a second backward pass
   (:mod:`toolgym.training.learn.scoring`), so DDP's per-backward hooks would fire twice; reducing by hand
   after both phases is exact;
4. every rank clips and steps the same optimizer (AdamW, fp32 master weights) on the same summed
   gradient, so every copy of the model stays identical; rank 0 then publishes its copy (the vLLM
   weight sync, or the in-process policy's version bump), and alone writes checkpoints.

Starting. ``toolgym train --learners N`` (``train.learners.count = N``) starts ranks 1..N-1 as child
processes (``python -m toolgym.training.distributed.worker``), which meet rank 0 through a ``TCPStore`` on
localhost; a child that exits before it joins stops the run with its log's last lines
(``RUN/learners/rank-K.log``); with ``train.rollouts.backend = "ray"`` they run in Ray actors instead, on
the trainer's Ray node (:mod:`toolgym.training.distributed.ray_actors`). Under ``torchrun --nproc-per-node N
-m toolgym train ...`` the ranks
are torchrun's (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``): rank 0 trains, the others
enter :func:`worker_main`. The process group is gloo on CPU and NCCL on CUDA (``train.learners.backend``).

State. The learners receive rank 0's model (and, on a resume, its optimizer state) before the first
step they take, after the warm start: a checkpoint is always rank 0's whole state and holds no
trace of the world size, so a run resumes at any number of learners (the trainer says so when it
differs from the checkpoint's). A learner that dies (a crash, SIGKILL) makes the next collective
fail: the run stops with :class:`~toolgym.errors.RunStopped` naming the rank and how it ended, and
the same command resumes from the last checkpoint.

Sharded. With ``train.learners.shard = "fsdp2"`` the ranks hold FSDP2 shards of the model and optimizer
instead of whole copies (:mod:`toolgym.training.distributed.fsdp`); the messages, failures and checkpoints are
the same, and rank 0 gathers the stepped weights into the whole model it samples from.

Limits (each refused at start with its reason): a KL reference model (``train.loss.kl_coef > 0``) and
more learners than groups per step (``train.tasks_per_step``).
"""

from __future__ import annotations

import datetime
import hmac
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from toolgym.errors import ConfigError, RunStopped
from toolgym.procs import log_tail
from toolgym.run_files import create_new, run_folder
from toolgym.training.config import RunConfig, TrainConfig
from toolgym.training.distributed.fsdp import ShardedLearner
from toolgym.training.distributed.ray_actors import RayLearners
from toolgym.training.distributed.rendezvous import (
    CHALLENGE_KEY,
    HANDSHAKE_S,
    LOOPBACK_NAMES,
    SECRET_ENV,
    RendezvousRefused,
    authenticate,
    listening_store,
    loopback_env,
    new_secret,
    require_secret,
    store_proof,
    transport_env,
)
from toolgym.training.distributed.step import (
    LearnersDiverged,
    ReplicatedStep,
    agree,
    check_learners,
    fingerprint,
    reduce_sums,
    shard_groups,
    shard_plan,
    torch_dist,
    torchrun_rank,
)
from toolgym.training.distributed.worker import FAULT_ENV, exit_worker, worker_main
from toolgym.training.learn.grpo import StepPlan, StepSettings, accumulate_gradients
from toolgym.training.learn.loss import LossSums

__all__ = [  # the step's pieces (learner_step, learner_worker) are re-exported: one place to import the learner from
    "FAULT_ENV",
    "LearnerGroup",
    "LearnersDiverged",
    "agree",
    "check_learners",
    "exit_worker",
    "fingerprint",
    "reduce_sums",
    "shard_groups",
    "shard_plan",
    "torchrun_rank",
    "worker_main",
]

log = logging.getLogger(__name__)


class LearnerGroup:
    """Rank 0's side of the data-parallel learner (one learner: a pass-through to
    :func:`~toolgym.training.learn.grpo.accumulate_gradients`)."""

    def __init__(
        self,
        learners: int,
        *,
        backend: str = "gloo",
        device: str = "cpu",
        timeout_s: float = 1800.0,
        log_dir: str | Path | None = None,
        placement: str = "process",
        shard: str = "none",
        nodes: str = "trainer",
        resources: Mapping[str, float] | None = None,
    ) -> None:
        env_world = torchrun_rank()
        self.external = env_world is not None  # torchrun started the ranks
        self.world = env_world[1] if env_world is not None else learners
        self.backend, self.device, self.timeout_s = backend, device, timeout_s
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.placement = placement  # "process" (child processes) or "ray" (Ray actors)
        self.nodes, self.resources = nodes, dict(resources or {})  # where Ray actors may run
        self.ray: Any = None  # learner_actors.RayLearners, while Ray actors are the learners
        self.children: dict[int, Any] = {}  # subprocess.Popen, or learner_actors.RayLearner
        self.started = False
        self.synced = False
        self.shard = shard
        self.sharded: Any = (
            None  # rank 0's ShardedLearner (train.learners.shard = "fsdp2"), after the first sync
        )
        self.step_number = 0  # the learner step under way, for messages
        self.secret = ""  # the run's learner secret, once the group starts
        self.transport: dict[str, str] = {}  # the interface pin of a one-machine group
        check_learners(self.world, backend, device)
        if shard == "fsdp2" and self.world < 2:
            where = "torchrun's world size" if self.external else "train.learners.count"
            raise ConfigError(
                f"train.learners.shard = 'fsdp2' with {self.world} learner ({where}): sharding splits the model "
                "over several learners; set train.learners.count >= 2 (or start several torchrun ranks)"
            )

    @classmethod
    def for_run(cls, config: RunConfig, run_dir: Path) -> LearnerGroup:
        """The group a training config asks for (logs in ``RUN/learners``), checked against it."""
        tc = config.train
        group = cls(
            tc.learners.count,
            backend=tc.learners.backend,
            device=config.policy.learner_device,
            timeout_s=tc.learners.timeout,
            log_dir=run_dir / "learners",
            placement="ray" if tc.rollouts.backend == "ray" else "process",
            shard=tc.learners.shard,
            nodes=tc.learners.nodes,
            resources=tc.learners.resources,
        )
        group.check_config(config.train)
        return group

    def check_config(self, train: TrainConfig) -> None:
        """The config's limits on several learners, for a world size the config did not set (torchrun)."""
        train.check_learner_count(
            self.world, f"{self.world} learner processes (torchrun's world size)", "several learners"
        )

    @property
    def distributed(self) -> bool:
        return self.world > 1

    # ------------------------------------------------------------------ start and stop
    def start(self) -> None:
        """Start (or join) the process group; idempotent."""
        if self.started or not self.distributed:
            return
        dist = torch_dist()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if self.external:  # torchrun's ranks: the secret comes from the user, on every node
            self.secret = require_secret()
            local = os.environ.get("MASTER_ADDR", "") in LOOPBACK_NAMES  # one machine: keep it there
            with transport_env(loopback_env() if local else {}):
                dist.init_process_group(self.backend, init_method="env://", timeout=timeout)
        else:
            # NOTE (trust): see toolgym.training.distributed.rendezvous: loopback on one machine, a secret always
            self.secret = new_secret()
            master_addr = "127.0.0.1"
            if self.placement == "ray":
                self.ray = RayLearners(
                    cuda=self.device.startswith("cuda"), nodes=self.nodes, resources=self.resources
                )
                master_addr = self.ray.open(self.world - 1)
            self.transport = loopback_env() if master_addr == "127.0.0.1" else {}
            store = listening_store(master_addr, self.world, min(self.timeout_s, 600.0))
            store.set(CHALLENGE_KEY, secrets.token_hex(32))  # each rank it starts answers it (store_proof)
            try:
                for rank in range(1, self.world):
                    self.children[rank] = self._spawn(rank, store.port, master_addr)
            except BaseException:
                self._release()  # the learners already started
                raise
            self._wait_for_children(store)
            if self.ray is not None:
                self.ray.record(self.children, master_addr, self.log_dir)
            with transport_env(self.transport):
                dist.init_process_group(
                    self.backend, store=store, rank=0, world_size=self.world, timeout=timeout
                )
        self.started = True
        try:
            authenticate(
                self.secret, 0, self.world, self._device(), deadline_s=min(HANDSHAKE_S, self.timeout_s)
            )
        except BaseException:
            self.close(say_stop=False)  # nothing more is said to a group that did not prove itself
            raise

    def _device(self) -> str:
        return self.device if self.backend == "nccl" else "cpu"

    def _spawn(self, rank: int, port: int, master_addr: str) -> Any:
        ours = {
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world),
            "TOOLGYM_DIST_BACKEND": self.backend,
            "TOOLGYM_DIST_TIMEOUT": str(self.timeout_s),
            SECRET_ENV: self.secret,
            **self.transport,  # one machine: the same loopback pin as rank 0's
        }
        if self.log_dir is not None:
            self.log_dir.parent.mkdir(parents=True, exist_ok=True)
            run_folder(self.log_dir.parent, self.log_dir.name)  # never a planted link
        if self.ray is not None:  # an actor keeps Ray's environment (its GPU) and takes only these
            passed = {k: os.environ[k] for k in (FAULT_ENV, "OMP_NUM_THREADS") if k in os.environ}
            log_path = None if self.log_dir is None else self.log_dir / f"rank-{rank}.log"
            return self.ray.start({**passed, **ours}, log_path)
        env = dict(os.environ, **ours)
        out: Any = subprocess.DEVNULL
        if self.log_dir is not None:
            out = create_new(self.log_dir / f"rank-{rank}.log")  # the child writes to it; never via a link
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "toolgym.training.distributed.worker"], env=env, stdout=out, stderr=out
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()

    def _wait_for_children(self, store: Any) -> None:
        """Until every child has checked in at the store; one that exits first stops the run."""
        deadline = time.monotonic() + min(self.timeout_s, 600.0)
        challenge = store.get(CHALLENGE_KEY)
        while True:
            ready = [r for r in range(1, self.world) if store.check([f"learner/{r}"])]
            if len(ready) >= self.world - 1:
                wrong = [
                    r
                    for r in ready
                    if not hmac.compare_digest(
                        bytes(store.get(f"learner/{r}")),
                        store_proof(self.secret, r, self.world, challenge).encode(),
                    )
                ]
                if wrong:
                    self.close(say_stop=False)
                    who = ", ".join(f"rank {r}" for r in wrong)
                    raise RendezvousRefused(
                        f"a process checked in at the learner store as {who} without the run's secret (its "
                        "proof is wrong): a process this run did not start reached the store. It was refused "
                        "before the learner group formed; nothing was sent to it"
                    )
                return
            for rank, child in self.children.items():
                if child.poll() is not None:
                    self.close()
                    raise ConfigError(
                        f"learner process rank {rank} exited ({_how(child)}) before it joined the "
                        f"process group{self._log_tail(rank)}"
                    )
            if time.monotonic() > deadline:
                self.close()
                raise ConfigError(
                    f"{self.world - 1 - len(ready)} learner process(es) did not join within "
                    f"{min(self.timeout_s, 600.0):.0f} s{self._log_tail(1)}"
                )
            time.sleep(0.05)

    def _log_tail(self, rank: int) -> str:
        path = None if self.log_dir is None else self.log_dir / f"rank-{rank}.log"
        if self.ray is not None and path is not None and not path.exists():  # on another node
            return self.ray.log_elsewhere(rank)
        return log_tail(path, 8)

    def close(self, *, say_stop: bool = True) -> None:
        """Tell the learners to stop (unless ``say_stop`` is False: a group whose ranks did not all prove
        the secret hears nothing more, and its processes are stopped at once), wait for them (killing any
        that do not), leave the group."""
        if self.started:
            dist = torch_dist()
            if say_stop and all(c.poll() is None for c in self.children.values()):
                try:
                    dist.broadcast_object_list([("stop",)], src=0)
                except Exception:  # noqa: BLE001 (a dead learner: nothing more to say to it)
                    log.debug("could not tell the learners to stop", exc_info=True)
            dist.destroy_process_group()
            self.started = False
        for child in self.children.values():
            try:  # a group that failed the handshake was told nothing: its processes are stopped at once
                child.wait(timeout=30 if say_stop else 1)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        self._release()

    def _release(self) -> None:
        if self.ray is not None:  # the actors outlive their work: kill them, release Ray
            self.ray.close(self.children)
            self.ray = None
        self.children = {}

    # ------------------------------------------------------------------ one step
    def accumulate(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        plan: StepPlan,
        *,
        config: RunConfig,
        step: int,
        settings: StepSettings,
    ) -> tuple[LossSums, dict[str, float]]:
        """The step's gradient in ``model``'s ``.grad`` (summed over learners) and its loss sums; the
        other learners get ``plan`` and ``settings`` as they are."""
        if not self.distributed or not plan.samples:
            return accumulate_gradients(model, plan, settings), {}
        self.step_number = step
        try:
            if not self.synced:
                self.sync(model, optimizer, config, step=step)
            self._check_children(step)
            torch_dist().broadcast_object_list([("step", plan, settings)], src=0)
            if self.sharded is not None:
                sums, seconds = self.sharded.accumulate(plan, settings)
            else:
                sums, seconds = ReplicatedStep(model, self.world, 0).run(plan, settings)
        except RunStopped:  # LearnersDiverged included
            raise
        except Exception as exc:  # a collective failed: which learner, and how
            raise self._stopped(step, exc) from exc
        held = {} if self.sharded is None else {"learners/held_share": self.sharded.held}
        return sums, {"time/grad_allreduce": seconds, "learners": float(self.world), **held}

    def optimizer_step(
        self, model: torch.nn.Module, optimizer: Any, max_grad_norm: float, *, finite_loss: bool = True
    ) -> float:
        """The optimizer step after :meth:`accumulate`; the gradient norm before clipping. Sharded
        (``train.learners.shard = "fsdp2"``): every rank steps its shards and rank 0 gathers the new weights
        into ``model``; ``optimizer`` (rank 0's, over the whole model) only counts the step. A
        non-finite norm or loss (the step's sums, the same on every rank) skips it everywhere:
        ``optimizer.last_skipped``."""
        if self.sharded is None:
            return float(optimizer.step(max_grad_norm, finite_loss=finite_loss))
        try:
            norm = self.sharded.step(finite_loss=finite_loss)
            self.sharded.gather_into(model)
        except RunStopped:
            raise
        except Exception as exc:
            raise self._stopped(self.step_number, exc) from exc
        optimizer.advance(skipped=self.sharded.last_skipped)
        return norm

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's whole state for a checkpoint (sharded: gathered from every rank, in the
        format one process writes, so the run resumes at any world size)."""
        if self.sharded is None:
            return dict(optimizer.state_dict())
        try:
            self._check_children(self.step_number)
            torch_dist().broadcast_object_list([("state",)], src=0)
            return self.sharded.full_state()
        except RunStopped:
            raise
        except Exception as exc:
            raise self._stopped(self.step_number, exc) from exc

    def sync(self, model: torch.nn.Module, optimizer: Any, config: RunConfig, *, step: int = 0) -> None:
        """Start the group if needed and give every learner ``model`` and ``optimizer``'s state (none
        before its first step): the first learner step does this; call it again after changing the
        weights other than by a learner step (the learners' copies are replaced)."""
        self.start()
        try:
            self._check_children(step)
            state = self.optimizer_state(optimizer) if optimizer.steps else None
            torch_dist().broadcast_object_list([("init", model, state, config, self.shard)], src=0)
            self.sharded = None
            if self.shard == "fsdp2":  # rank 0 trains a sharded copy; its own model stays whole
                self.sharded = ShardedLearner.copy_of(model, config.train, self.world, state)
        except RunStopped:
            raise
        except Exception as exc:
            raise self._stopped(step, exc) from exc
        self.synced = True

    def finish(self, model: torch.nn.Module, step: int) -> None:
        """At the end of training: check that every learner holds rank 0's final weights."""
        if not (self.started and self.synced):
            return
        try:
            self._check_children(step)
            torch_dist().broadcast_object_list([("finish",)], src=0)
            if self.sharded is not None:
                differs = self.sharded.weights_differ(model)
                if differs:
                    raise LearnersDiverged(
                        f"rank 0's weights differ from the learners' shards ({differs}): the gathered "
                        "update did not reach the model rank 0 samples from"
                    )
            else:
                agree(model, self.world)
        except RunStopped:  # LearnersDiverged included
            raise
        except Exception as exc:
            raise self._stopped(step, exc) from exc

    def _check_children(self, step: int) -> None:
        if any(child.poll() is not None for child in self.children.values()):
            raise self._stopped(step, None)

    def _stopped(self, step: int, exc: BaseException | None) -> RunStopped:
        time.sleep(0.2)  # let a dying learner's exit status arrive
        dead = {r: _how(c) for r, c in self.children.items() if c.poll() is not None}
        for child in self.children.values():
            if child.poll() is None:
                child.kill()
        self._release()
        if self.started:
            try:
                torch_dist().destroy_process_group()
            except Exception:  # noqa: BLE001
                log.debug("destroy_process_group after a failure", exc_info=True)
            self.started = False
        who = (
            ", ".join(f"learner rank {r} exited ({how})" for r, how in sorted(dead.items()))
            if dead
            else f"a collective failed ({type(exc).__name__}: {str(exc).splitlines()[0] if exc else ''})"
        )
        return RunStopped(
            f"{who} during learner step {step}: the run stopped; rerun the same command to resume from its "
            "last checkpoint"
        )


def _how(child: Any) -> str:
    """How a learner (a child process or a Ray actor) ended: its signal, exit code or cause."""
    code = child.returncode
    if getattr(child, "how", ""):
        return str(child.how)
    if code is None:
        return "still running"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
