"""The training loop every offline trainer runs (Medusa, EAGLE, self-exit, distillation).

A trainer supplies a :class:`TrainTask` (its module, the loss of one batch, its evaluation), a
sampler of batches and its optimiser; the loop owns what they used to repeat: the schedule (one
:class:`~specdec.heads.optim.Schedule` family, shared with the online learner), the optimiser
step, progress and log lines (through the ``progress`` bar only: library code never prints), the
evaluation and checkpoint cadence, and exact resumption. Exact means the sampler's and the torch
RNG's state travel in the checkpoint, so a run interrupted and resumed sees the same batches, in
the same order, and ends with the same weights, bit for bit, as one that was never interrupted.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from specdec.errors import ConfigError, TrainingDivergedError
from specdec.heads.optim import Schedule, optimizer_step
from specdec.training.checkpoint import CheckpointStore, LoopState
from specdec.training.progress import NullBar, ProgressFactory

Log = Callable[[str], None]


class Sampler(Protocol):
    """Batches of example indices; its state is saved with each checkpoint."""

    def next_batch(self) -> list[int]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ShuffledSampler:
    """``batch`` indices at a time from back-to-back random permutations of ``range(n)`` (a
    batch may span two permutations), seeded by ``seed``."""

    def __init__(self, n: int, batch: int, seed: int) -> None:
        if n < 1 or batch < 1:
            raise ConfigError(f"nothing to sample: {n} examples, batches of {batch}")
        self.n, self.batch = n, batch
        self.rng = random.Random(seed * 7919)
        self.order: list[int] = []

    def next_batch(self) -> list[int]:
        if len(self.order) < self.batch:
            fresh = list(range(self.n))
            self.rng.shuffle(fresh)
            self.order += fresh
        idx = self.order[: self.batch]
        del self.order[: self.batch]
        return idx

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate(), "order": list(self.order)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.order = list(state["order"])


class EpochSampler:
    """The batches of ``plan(epoch)`` in order, epoch after epoch: for trainers whose epochs
    are planned whole (distillation packs records of similar length into a batch)."""

    def __init__(self, plan: Callable[[int], Sequence[list[int]]]) -> None:
        self.plan = plan
        self.epoch, self.index = 0, 0
        self._cached: tuple[int, Sequence[list[int]]] | None = None

    def _batches(self) -> Sequence[list[int]]:
        if self._cached is None or self._cached[0] != self.epoch:
            self._cached = (self.epoch, self.plan(self.epoch))
        return self._cached[1]

    def next_batch(self) -> list[int]:
        while self.index >= len(self._batches()):
            self.epoch, self.index = self.epoch + 1, 0
        self.index += 1
        return list(self._batches()[self.index - 1])

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


@dataclass(frozen=True)
class StepOutput:
    """One batch's loss, the figures shown on the progress bar, and its training tokens."""

    loss: torch.Tensor
    figures: dict[str, float]
    tokens: int = 0


@dataclass(frozen=True)
class Evaluation:
    """Held-out figures (recorded in the history with the step) and the line that reports
    them."""

    figures: dict[str, float]
    message: str


class TrainTask:
    """What a trainer supplies: the module whose weights the checkpoint holds, the loss of a
    batch and the evaluation; ``begin`` and ``saved`` are optional hooks."""

    module: nn.Module

    def begin(self, state: LoopState, log: Log) -> None:
        """Called once the run's state is known (fresh or resumed), before the first step."""

    def loss(self, batch: list[int]) -> StepOutput:
        raise NotImplementedError

    def evaluate(self, step: int, last: dict[str, float]) -> Evaluation:
        """``last``: the figures of the latest training step (empty before the first)."""
        raise NotImplementedError

    def saved(self, state: LoopState, finished: bool) -> None:
        """Called after each checkpoint (e.g. to export the model written so far)."""


@dataclass(frozen=True)
class LoopSettings:
    """``keep_checkpoint``: also checkpoint the final step and leave the checkpoint in place,
    so the run can later be resumed to a longer one; ``initial_eval``: evaluate before the
    first step too (the untrained figures, for comparison)."""

    total_steps: int
    lr: float
    schedule: Schedule = field(default_factory=Schedule)
    eval_every: int = 100
    checkpoint_every: int = 100
    grad_clip: float | None = None
    initial_eval: bool = False
    keep_checkpoint: bool = False
    desc: str = "training"

    def __post_init__(self) -> None:
        if self.total_steps < 1 or not self.lr > 0:
            raise ConfigError(f"a run needs >= 1 step and lr > 0, got {self}")
        if self.eval_every < 1 or self.checkpoint_every < 1:
            raise ConfigError("eval and checkpoint intervals must be >= 1 step")


@dataclass(frozen=True)
class LoopResult:
    state: LoopState
    resumed_from: int | None  # the checkpoint's step, when the run resumed one


def train_loop(
    task: TrainTask,
    optimizer: torch.optim.Optimizer,
    sampler: Sampler,
    settings: LoopSettings,
    store: CheckpointStore,
    *,
    resume: bool = False,
    progress: ProgressFactory = NullBar,
    accelerator: Any = None,
) -> LoopResult:
    """Train ``task.module`` for ``settings.total_steps`` optimiser steps (from the checkpoint
    in ``store`` when ``resume``), evaluating every ``eval_every`` steps and at the end.

    With an ``accelerator`` (data-parallel EAGLE) it runs the backward pass and clipping, and
    only its main process writes checkpoints."""
    store.check_start(resume)
    state, resumed_from = LoopState(), None
    if resume:
        state, sampler_state = store.load(task.module, optimizer)
        sampler.load_state_dict(sampler_state)
        resumed_from = state.step
    total = settings.total_steps
    main = accelerator is None or accelerator.is_main_process
    started, base_wall = time.perf_counter(), state.wall_seconds
    last: dict[str, float] = {}
    bar = progress(total=total, initial=min(state.step, total), desc=settings.desc, unit="step")

    def evaluate() -> None:
        result = task.evaluate(state.step, last)
        state.history.append({"step": state.step, **result.figures})
        bar.write(result.message)

    def save() -> None:
        state.wall_seconds = base_wall + time.perf_counter() - started
        if main:
            store.save(task.module, optimizer, sampler.state_dict(), state)
            task.saved(state, finished=state.step >= total)

    task.module.train()
    try:
        task.begin(state, bar.write)
        if settings.initial_eval and not state.history:
            evaluate()
        while state.step < total:
            batch = sampler.next_batch()
            out = task.loss(batch)
            lr = settings.lr * settings.schedule.factor(state.step, total)
            loss = float(out.loss.detach())
            if not math.isfinite(loss):
                # every later step would be NaN too: stop now, not after the whole schedule
                raise TrainingDivergedError(
                    f"the training loss became {loss} at step {state.step + 1} (learning rate "
                    f"{lr:.2g}): the run diverged. Train again with a lower --lr (or with "
                    "--precision fp32 if it ran in bf16)"
                )
            optimizer_step(
                optimizer, out.loss, lr, clip=settings.grad_clip, accelerator=accelerator
            )
            state.step += 1
            state.tokens += out.tokens
            last = out.figures
            bar.update(1)
            bar.set_postfix({k: f"{v:.3f}" for k, v in last.items()}, refresh=False)
            if state.step % settings.eval_every == 0 or state.step == total:
                evaluate()
            at_end = state.step == total and settings.keep_checkpoint
            if state.step % settings.checkpoint_every == 0 and state.step < total or at_end:
                save()
        if not state.history or state.history[-1]["step"] != state.step:
            evaluate()  # resumed a run that had nothing left to do
            if settings.keep_checkpoint:
                save()
    finally:
        bar.close()
    state.wall_seconds = base_wall + time.perf_counter() - started
    return LoopResult(state, resumed_from)


class RunLength(Protocol):
    """The settings of a trainer whose run is counted in passes over shuffled examples."""

    @property
    def epochs(self) -> float: ...

    @property
    def max_steps(self) -> int | None: ...

    @property
    def lr(self) -> float: ...

    @property
    def seed(self) -> int: ...

    @property
    def checkpoint_every(self) -> int: ...


def train_epochs(
    task: TrainTask,
    optimizer: torch.optim.Optimizer,
    store: CheckpointStore,
    config: RunLength,
    *,
    examples: int,
    batch: int,
    desc: str,
    eval_every: int | None = None,
    grad_clip: float | None = None,
    resume: bool = False,
    progress: ProgressFactory = NullBar,
    accelerator: Any = None,
    initial_eval: bool = False,
) -> LoopResult:
    """:func:`train_loop` over ``config.epochs`` passes of ``examples`` examples in shuffled
    batches of ``batch`` (``config.max_steps`` steps when set), with the heads' schedule:
    the run of the Medusa, EAGLE and self-exit trainers. ``eval_every`` None: at the end."""
    total = config.max_steps or max(1, round(config.epochs * max(1, examples // batch)))
    settings = LoopSettings(
        total_steps=total,
        lr=config.lr,
        eval_every=eval_every or total,
        checkpoint_every=config.checkpoint_every,
        grad_clip=grad_clip,
        initial_eval=initial_eval,
        desc=desc,
    )
    sampler = ShuffledSampler(examples, batch, config.seed)
    return train_loop(
        task, optimizer, sampler, settings, store,
        resume=resume, progress=progress, accelerator=accelerator,
    )  # fmt: skip
