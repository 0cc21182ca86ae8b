"""The learning-rate schedule and the optimiser step every trainer of heads shares.

It lives with the trainable modules, not in ``specdec.training``, because the online learner
(:mod:`specdec.speculators.osd`) is part of the core, which must not import the training
package; the offline training loop (``specdec.training.loop``) builds on the same two pieces, so
an online and an offline step of the same heads are the same computation.

The rate is set on the optimiser before each step, from the step index alone (no scheduler
object): a resumed run then needs nothing but the step to continue the schedule exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from specdec.errors import ConfigError

Decay = Literal["linear", "cosine", "constant"]


@dataclass(frozen=True)
class Schedule:
    """A linear warm-up over ``warmup`` steps times a decay to ``floor`` of the peak rate.

    ``linear`` decays from the first step (the heads' trainers: their runs are short, so no
    cosine tail), ``cosine`` from the end of the warm-up (distillation, whose runs are long),
    ``constant`` not at all (the online learner, whose run has no end).

    >>> [round(Schedule(2, "cosine", 0.1).factor(s, 10), 3) for s in (0, 1, 2, 6, 9)]
    [0.5, 1.0, 1.0, 0.55, 0.134]
    >>> [round(Schedule(4, "constant").factor(s), 2) for s in (0, 3, 9)]
    [0.25, 1.0, 1.0]
    """

    warmup: int = 20
    decay: Decay = "linear"
    floor: float = 0.05

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ConfigError(f"the warm-up must be >= 0 steps, got {self.warmup}")
        if self.decay not in ("linear", "cosine", "constant"):
            raise ConfigError(f"unknown decay {self.decay!r}; use linear, cosine or constant")
        if not 0.0 <= self.floor <= 1.0:
            raise ConfigError(f"the schedule's floor must be in [0, 1], got {self.floor}")

    def factor(self, step: int, total: int | None = None) -> float:
        """The share of the peak rate at (0-based) ``step`` of ``total``."""
        warm = min(1.0, (step + 1) / self.warmup) if self.warmup else 1.0
        if self.decay == "constant":
            return warm
        if total is None:
            raise ConfigError(f"a {self.decay} schedule needs the run's total steps")
        if self.decay == "linear":
            return warm * max(self.floor, 1 - step / total)
        done = min(1.0, max(0, step - self.warmup) / max(1, total - self.warmup))
        return warm * (self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * done)))


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors ``optimizer`` updates, in its order (what gradient clipping must see)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    loss: torch.Tensor,
    lr: float,
    *,
    clip: float | None = None,
    accelerator: Any = None,
) -> None:
    """Set the rate, back-propagate ``loss``, clip the gradient norm to ``clip`` and step.

    ``accelerator`` (an ``accelerate.Accelerator``, duck-typed so the core never imports it)
    takes over the backward pass and the clipping, as data-parallel training needs."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    if accelerator is None:
        loss.backward()
    else:
        accelerator.backward(loss)
    if clip is not None:
        params: Iterable[torch.Tensor] = optimizer_params(optimizer)
        if accelerator is None:
            nn.utils.clip_grad_norm_(params, clip)
        else:
            accelerator.clip_grad_norm_(params, clip)
    optimizer.step()
