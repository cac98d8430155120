"""The learner's optimizer: AdamW on fp32 master weights, with a learning-rate schedule.

Why master weights. A model held in bf16 (``policy.dtype = "bfloat16"``, the policy sampling from the
module the learner trains) cannot take small steps: bf16 keeps 8 bits of mantissa, so a weight of
0.05 moves only in steps of about 2e-4, and AdamW's update of ``lr = 1e-5`` rounds away entirely.
:class:`LearnerOptimizer` keeps an fp32 copy of every trainable low-precision parameter, steps AdamW
on the copies (gradients cast up), and writes the rounded result back into the model after each
step, so updates accumulate in fp32 as they would in an fp32 model. fp32 parameters are stepped in
place, with no copy.

Schedules (``train.optim.schedule``): ``constant``, ``linear`` (decay to ``min_lr_ratio * lr`` at the last
step) and ``cosine`` (the same end point along a half cosine), each after ``warmup_steps`` of linear
warm-up from ``lr / warmup_steps``. The schedule advances once per optimizer step actually taken (a
step without an informative group leaves it where it is).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from toolgym.errors import ConfigError, check_choice
from toolgym.training.config.train import SCHEDULES, OptimConfig

if TYPE_CHECKING:
    import torch

__all__ = ["SCHEDULES", "LearnerOptimizer", "ScheduleConfig", "lr_factor"]


@dataclass(frozen=True)
class ScheduleConfig:
    """The learning rate over the run: ``lr`` scaled by :func:`lr_factor` at each optimizer step."""

    name: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        check_choice("train.optim.schedule", self.name, SCHEDULES)
        if self.warmup_steps < 0:
            raise ConfigError(f"train.optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.optim.min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")


def lr_factor(config: ScheduleConfig, step: int) -> float:
    """The multiplier of ``lr`` for optimizer step ``step`` (0-based): warm-up, then the schedule."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.name == "constant":
        return 1.0
    span = max(config.total_steps - config.warmup_steps - 1, 1)
    progress = min((step - config.warmup_steps) / span, 1.0)
    shape = 1.0 - progress if config.name == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * shape


class LearnerOptimizer:
    """AdamW over a model's trainable parameters, fp32 master copies for low-precision ones, a schedule.

    Use: ``zero_grad()``, backward passes on the model, then ``step(max_grad_norm)`` (returns the
    gradient norm before clipping) under the policy's weights lock. ``state_dict`` holds the AdamW
    state, the master copies and the schedule's position, so a resume continues bit for bit.

    NOTE (non-finite steps): a step whose gradient norm is NaN or infinite, or whose loss was
    (``finite_loss=False``), is skipped: the gradient is dropped and the weights, the AdamW moments
    and the schedule stay as they were (``last_skipped`` says so). One NaN in a gradient would
    otherwise reach every weight through AdamW's update. Every data-parallel rank sees the same
    summed gradient and the same summed loss, so every rank makes the same decision.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.99),
        schedule: ScheduleConfig | None = None,
    ) -> None:
        import torch

        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ConfigError("the model has no trainable parameters (requires_grad is False everywhere)")
        # NOTE (precision): fp32 parameters are their own master; others get an fp32 copy.
        self.masters = [
            p if p.dtype == torch.float32 else p.detach().to(torch.float32).clone().requires_grad_(True)
            for p in self.params
        ]
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay, betas=betas)
        self.base_lr = lr
        self.schedule = schedule or ScheduleConfig()
        self.steps = 0
        self.last_skipped = False
        self._apply_lr()

    @classmethod
    def from_config(
        cls, params: Iterable[torch.nn.Parameter], optim: OptimConfig, steps: int
    ) -> LearnerOptimizer:
        """The optimizer ``[train.optim]`` describes over a run of ``steps`` optimizer steps: the
        trainer's, and every data-parallel learner's copy of it."""
        schedule = ScheduleConfig(optim.schedule, optim.warmup_steps, steps, optim.min_lr_ratio)
        return cls(params, lr=optim.lr, weight_decay=optim.weight_decay, betas=optim.betas, schedule=schedule)

    @property
    def lr(self) -> float:
        """The learning rate of the next step."""
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def has_masters(self) -> bool:
        return any(m is not p for m, p in zip(self.masters, self.params, strict=True))

    def _apply_lr(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.base_lr * lr_factor(self.schedule, self.steps)

    def reload_masters(self) -> None:
        """Copy the model's current weights into the fp32 master copies.

        Call it after anything but :meth:`step` changed the weights (the warm start's fine-tune, a
        reused warm start loaded in place): otherwise the next step would write back the masters'
        older values and undo that change. A no-op for fp32 parameters (their own masters).
        """
        import torch

        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                if m is not p:
                    m.copy_(p.detach().to(torch.float32))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for m in self.masters:
            m.grad = None

    def step(self, max_grad_norm: float, *, finite_loss: bool = True) -> float:
        """Clip the gradient norm, take one AdamW step, write low-precision weights back; the norm.

        A non-finite norm, or ``finite_loss=False``, skips the step (see the class note).
        """
        import torch

        for p, m in zip(self.params, self.masters, strict=True):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.detach().to(torch.float32)
        norm = float(torch.nn.utils.clip_grad_norm_(self.masters, max_grad_norm))
        self.last_skipped = not (finite_loss and math.isfinite(norm))
        if self.last_skipped:
            self.zero_grad()
            return norm
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                if m is not p:
                    p.copy_(m)
        self.steps += 1
        self._apply_lr()
        return norm

    def advance(self, *, skipped: bool = False) -> None:
        """Count a step taken elsewhere (a sharded learner stepped the weights: :mod:`toolgym.training.distributed.fsdp`):
        the schedule moves on as if :meth:`step` had run, unless that step was ``skipped``."""
        self.last_skipped = skipped
        if skipped:
            return
        self.steps += 1
        self._apply_lr()

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
            "masters": [
                m.detach().clone() if m is not p else None
                for m, p in zip(self.masters, self.params, strict=True)
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "param_groups" in state:  # a checkpoint of a plain AdamW (fp32 model, constant lr)
            self.optimizer.load_state_dict(state)
            return
        import torch

        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        with torch.no_grad():
            for m, saved in zip(self.masters, state["masters"], strict=True):
                if saved is not None:
                    m.copy_(saved)
        self._apply_lr()
