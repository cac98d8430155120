"""The sharded learner: FSDP2 (``fully_shard``) over the learners' process group, ``train.learners.shard = "fsdp2"``.

With ``train.learners.count = N`` and ``train.learners.shard = "fsdp2"`` every rank, rank 0 included, trains a
:class:`ShardedLearner`: the model's parameters, their gradients, the fp32 master copies and the
AdamW state are split across the N ranks (each holds 1/N of each tensor, ``Shard(0)`` on a 1-D
device mesh: CPU under gloo, CUDA under NCCL), instead of every rank holding all of them
(:mod:`toolgym.training.distributed.learners`' replicated learner). Rank 0 keeps, besides, the whole model it
samples from or pushes to the engine (``Trainer.model``); after every optimizer step the shards are
gathered into it.

One step, on every rank:

1. **Unshard** every FSDP unit (each decoder layer, then the root) in the same order: one all-gather
   each. The step's micro-batches differ in number between ranks (a rank may have none), and the
   shared-prefix path runs a second backward pass per group (:mod:`toolgym.training.learn.scoring`), while
   FSDP2's own per-layer collectives need every rank to run the same passes. So the accumulation
   runs with the parameters held whole and gradient sync off: no collective at all while a rank
   accumulates its share, with the whole step's denominators (as the replicated learner does).
2. **One synchronising pass**: every rank runs the same one-token forward with a zero loss and its
   backward with gradient sync on; FSDP2's post-backward reduce-scatters the accumulated gradients
   (plus zeros), then every unit is resharded. The reduce-scatter *averages* over ranks (measured,
   torch 2.13 on gloo; ``set_gradient_divide_factor`` needs ``PREMUL_SUM``, which gloo lacks), so the
   shards are multiplied by N: the ranks' gradients sum to the step's, as in one process.
3. **Step**: AdamW on the sharded fp32 masters; the gradient norm for clipping is the global one
   (DTensor reduces it over ranks). Then every parameter's shards are all-gathered and rank 0 copies
   them into its whole model; the other ranks drop them.

Memory: at rest a rank holds 1/N of the parameters, gradients, masters and AdamW state; during a
step's accumulation it holds the whole parameters and gradients (step 1), as a replicated learner
does. Rank 0 also holds the whole model it samples from. A checkpoint stays rank 0's whole state
(the optimizer state gathered, in the format one process writes): a run resumes at any world size,
sharded or not.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

from toolgym.training.config import TrainConfig
from toolgym.training.distributed.step import local_gradients, reduce_sums
from toolgym.training.learn.grpo import StepPlan, StepSettings
from toolgym.training.learn.loss import LossSums
from toolgym.training.learn.optim import LearnerOptimizer

__all__ = ["SHARD_MODES", "ShardedLearner", "fsdp_units"]

SHARD_MODES = ("none", "fsdp2")


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules each made one FSDP unit, inner first: a transformers causal LM's decoder layers
    (``model.model.layers``), then the model itself (embeddings, final norm, output head)."""
    inner = getattr(getattr(model, "model", None), "layers", None)
    layers = list(inner) if isinstance(inner, torch.nn.ModuleList) else []
    return [*layers, model]


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to every tensor inside its dicts, lists and tuples, in a fixed order
    (sorted keys): every rank walks the same tensors in the same order, so ``fn`` may be a collective."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(value[k], fn) for k in sorted(value, key=str)}
    if isinstance(value, list | tuple):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


class ShardedLearner:
    """One rank's FSDP2-sharded copy of the trained model and its optimizer (see the module).

    Args:
        model: the whole model (this object is sharded in place: rank 0 passes a copy of its own).
        config: the run's config (its ``[train]`` optimizer settings).
        world, rank: the learners' process group.
        state: a whole optimizer state (:meth:`LearnerOptimizer.state_dict` of one process) to start
            from, or ``None``.
    """

    def __init__(
        self, model: torch.nn.Module, train: TrainConfig, world: int, rank: int, state: dict[str, Any] | None
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.world, self.rank = world, rank
        device = next(model.parameters()).device
        self.mesh = init_device_mesh(device.type, (world,))
        self.units: list[Any] = fsdp_units(model)  # FSDPModule after fully_shard
        for unit in self.units:
            fully_shard(unit, mesh=self.mesh)
        self.model = model
        #: the share of the parameters' elements this rank holds (1/world, up to uneven splits)
        self.held = sum(cast(Any, p).to_local().numel() for p in model.parameters()) / max(
            sum(p.numel() for p in model.parameters()), 1
        )
        self.optimizer = LearnerOptimizer.from_config(model.parameters(), train.optim, train.steps)
        if state is not None:
            self.optimizer.load_state_dict(self._shard_state(state))
        self.max_grad_norm = train.optim.max_grad_norm
        self.device = device

    @classmethod
    def copy_of(
        cls, model: torch.nn.Module, train: TrainConfig, world: int, state: dict[str, Any] | None
    ) -> ShardedLearner:
        """Rank 0's: a sharded copy of its own whole model (which stays whole, for sampling)."""
        return cls(copy.deepcopy(model), train, world, 0, state)

    # ------------------------------------------------------------------ one step
    def accumulate(self, plan: StepPlan, settings: StepSettings) -> tuple[LossSums, float]:
        """This rank's share of the step's gradient, reduce-scattered into the sharded ``.grad``
        (summed over ranks); returns the step's loss sums (summed over ranks) and the seconds spent
        in the synchronising pass and the sums' reduction."""

        self.optimizer.zero_grad()
        for unit in self.units:  # step 1: whole parameters, no collective while accumulating
            unit.unshard()
        for unit in self.units:
            unit.set_requires_gradient_sync(False, recurse=False)
            unit.set_reshard_after_forward(False, recurse=False)
            unit.set_reshard_after_backward(False, recurse=False)
        sums = local_gradients(self.model, plan, self.rank, self.world, settings)
        t0 = time.perf_counter()
        for unit in self.units:  # step 2: one pass every rank runs, with gradient sync on
            unit.set_requires_gradient_sync(True, recurse=False)
            unit.set_reshard_after_backward(True, recurse=False)
        token = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        (self.model(input_ids=token, use_cache=False).logits.sum() * 0.0).backward()
        for unit in self.units:
            unit.reshard()
            unit.set_reshard_after_forward(True, recurse=False)
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.world)  # the reduce-scatter averaged; the step's gradient is the sum
        reduced = reduce_sums(sums, self.device)
        return reduced, time.perf_counter() - t0

    def step(self, *, finite_loss: bool = True) -> float:
        """Clip (by the global norm) and take the AdamW step on every rank's shards; the norm. A
        non-finite norm or loss skips it on every rank alike (``LearnerOptimizer``'s note)."""
        norm = self.optimizer.step(self.max_grad_norm, finite_loss=finite_loss)
        self.optimizer.zero_grad()
        return norm

    @property
    def last_skipped(self) -> bool:
        return bool(self.optimizer.last_skipped)

    def _gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, whole, by name: one all-gather each (every rank walks them in order)."""
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                yield name, cast(Any, p).full_tensor()  # a DTensor

    def gather_into(self, target: torch.nn.Module | None) -> None:
        """All-gather every parameter (every rank calls this); rank 0 copies them into ``target``."""
        mine = dict(target.named_parameters()) if target is not None else {}
        for name, full in self._gathered():
            if target is not None:
                with torch.no_grad():
                    mine[name].copy_(full.to(mine[name].device))

    def weights_differ(self, target: torch.nn.Module | None) -> str:
        """Gather the weights (every rank calls this); on rank 0, the first of ``target``'s parameters
        that differs from them (its name), else ``""``."""
        mine = dict(target.named_parameters()) if target is not None else {}
        differs = ""
        for name, full in self._gathered():
            if target is not None and not differs and not torch.equal(full.cpu(), mine[name].detach().cpu()):
                differs = name
        return differs

    # ------------------------------------------------------------------ optimizer state
    def full_state(self) -> dict[str, Any]:
        """The optimizer state, whole, in the format one process writes (every rank calls this: each
        sharded tensor is all-gathered)."""
        return dict(
            _map_tensors(
                self.optimizer.state_dict(), lambda t: cast(Any, t).full_tensor() if _is_dtensor(t) else t
            )
        )

    def _shard_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A whole optimizer state cut into this rank's shards: every tensor shaped like its parameter
        takes the parameter's placement (no communication: each rank holds the whole state)."""
        from torch.distributed.tensor import distribute_tensor

        params = self.optimizer.params

        def like(i: int, value: Any) -> Any:
            p = cast(Any, params[i])  # a DTensor
            if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(p.shape) and value.dim() > 0:
                return distribute_tensor(value.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
            return value

        plain = "param_groups" in state  # a plain AdamW's state (an old checkpoint)
        inner = state if plain else state["optimizer"]
        per_param = {int(k): {n: like(int(k), v) for n, v in s.items()} for k, s in inner["state"].items()}
        shaped = {**inner, "state": per_param}
        if plain:
            return shaped
        masters = [None if m is None else like(i, m) for i, m in enumerate(state["masters"])]
        return {**state, "optimizer": shaped, "masters": masters}
