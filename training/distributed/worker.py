"""Ranks 1..N-1 of the data-parallel learner (:mod:`toolgym.training.distributed.learners` is rank 0's side).

A learner process joins the process group, takes rank 0's model (and optimizer state) and then each
step's plan, computing its share of the gradient and taking the same optimizer step, until rank 0
says stop. :class:`~toolgym.training.distributed.learners.LearnerGroup` starts it as
``python -m toolgym.training.distributed.worker`` (or in a Ray actor); under torchrun ``toolgym train``
calls :func:`worker_main` on ranks 1..N-1.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
from typing import Any, NoReturn

import torch

# NOTE: registers the grouped-query attention that rank 0's model may name (an HFPolicy's default);
# the model arrives pickled and looks its attention function up by name at its first forward pass.
import toolgym.agents.policies.hf_attention  # noqa: F401
from toolgym.training.distributed.fsdp import ShardedLearner
from toolgym.training.distributed.rendezvous import (
    CHALLENGE_KEY,
    HANDSHAKE_S,
    LOOPBACK_NAMES,
    authenticate,
    loopback_env,
    require_secret,
    store_proof,
    transport_env,
)
from toolgym.training.distributed.step import ReplicatedStep, agree, torch_dist
from toolgym.training.learn.optim import LearnerOptimizer

__all__ = ["FAULT_ENV", "exit_worker", "worker_main"]

#: Fault injection for tests: ``"RANK:STEP"`` makes learner ``RANK`` SIGKILL itself when the plan of
#: its ``STEP``-th learner step arrives (counted from 1 within the process).
FAULT_ENV = "TOOLGYM_LEARNER_FAULT"


def worker_main(backend: str | None = None, timeout_s: float | None = None) -> int:
    """A learner process: join the group, then take rank 0's model and each step's plan until told to stop.

    Started by :class:`~toolgym.training.distributed.learners.LearnerGroup` (the backend and timeout come in the environment, and the process
    checks in at rank 0's store first) or by torchrun (``toolgym train`` passes them from the config).
    """
    dist = torch_dist()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    spawned = "TOOLGYM_DIST_BACKEND" in os.environ
    backend = os.environ.get("TOOLGYM_DIST_BACKEND", backend or "gloo")
    seconds = float(os.environ.get("TOOLGYM_DIST_TIMEOUT", timeout_s or 1800.0))
    timeout = datetime.timedelta(seconds=seconds)
    secret = require_secret()  # a child: rank 0 put it in the environment; torchrun: the user did
    if spawned:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False
        )
        store.set(f"learner/{rank}", store_proof(secret, rank, world, bytes(store.get(CHALLENGE_KEY))))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        local = os.environ.get("MASTER_ADDR", "") in LOOPBACK_NAMES
        with transport_env(loopback_env() if local else {}):
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
    # NOTE (trust): nothing from another rank is unpickled before every rank has proved the secret
    authenticate(
        secret,
        rank,
        world,
        torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu",
        deadline_s=min(HANDSHAKE_S, seconds),
    )
    fault = os.environ.get(FAULT_ENV, "")
    fault_rank, _, fault_step = fault.partition(":")
    model: torch.nn.Module | None = None
    optimizer: Any = None
    sharded: Any = None  # a ShardedLearner when train.learners.shard = "fsdp2"
    max_grad_norm = 1.0
    steps = 0
    try:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            message = box[0]
            if message[0] == "stop":
                return 0
            if message[0] == "finish":
                if sharded is not None:
                    sharded.weights_differ(None)  # rank 0 compares
                elif model is not None:
                    agree(model, world)
                continue
            if message[0] == "state":  # rank 0 gathers the sharded optimizer state for a checkpoint
                sharded.full_state()
                continue
            if message[0] == "init":  # rank 0's model, whole; its optimizer state on a resume; the config
                model, state, config, shard = message[1:]
                torch.set_num_threads(config.policy.threads or torch.get_num_threads())
                sharded = None
                if shard == "fsdp2":
                    sharded = ShardedLearner(model, config.train, world, rank, state)
                    continue
                optimizer = LearnerOptimizer.from_config(
                    model.parameters(), config.train.optim, config.train.steps
                )
                if state is not None:
                    optimizer.load_state_dict(state)
                max_grad_norm = config.train.optim.max_grad_norm
                continue
            _, plan, settings = message
            steps += 1
            if fault and int(fault_rank) == rank and int(fault_step) == steps:
                os.kill(os.getpid(), signal.SIGKILL)
            if sharded is not None:  # rank 0 does the same three things
                sums, _ = sharded.accumulate(plan, settings)
                sharded.step(finite_loss=sums.finite())
                sharded.gather_into(None)
                continue
            if model is None or optimizer is None:
                raise RuntimeError("a learner step arrived before the model")
            optimizer.zero_grad()
            sums, _ = ReplicatedStep(model, world, rank).run(plan, settings)
            optimizer.step(max_grad_norm, finite_loss=sums.finite())  # the step's sums: rank 0 decides alike
            optimizer.zero_grad()
    finally:
        with contextlib.suppress(Exception):  # the group may be gone with rank 0
            dist.destroy_process_group()


def exit_worker(code: int) -> NoReturn:
    """End a learner process now, with ``code``, skipping the interpreter's teardown.

    The process group is gone by then, but the teardown still runs C++ destructors of the distributed
    and threading libraries a learner loaded; one of them can abort the process (SIGABRT, "terminate
    called without an active exception") after its work is done, which torchrun reports as a failed
    run. A learner holds nothing that needs the teardown: no open run files, no trackers.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_worker(worker_main())
