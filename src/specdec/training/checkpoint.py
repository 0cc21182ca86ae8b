"""What every trainer shares: resumable state (module, optimiser, schedule, step, history),
the validation of common settings, and the learning-rate schedule.

Written atomically (temp file + rename), so an interrupted run leaves the previous state, and
read back with a clear error rather than a traceback when it is broken.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdec.errors import CheckpointError, ConfigError


def save_training_state(
    path: Path,
    module: nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    step: int,
    history: list[dict[str, float]] | None = None,
) -> None:
    tmp = path.with_suffix(".tmp")
    state = {
        "module": module.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "step": step,
        "history": history or [],
    }
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_training_state(
    path: Path, module: nn.Module, opt: torch.optim.Optimizer, sched: Any
) -> tuple[int, list[dict[str, float]]]:
    """Restore in place; returns (step, history)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        module.load_state_dict(state["module"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        return int(state["step"]), list(state["history"])
    except Exception as e:
        raise CheckpointError(
            f"cannot resume from {path} ({type(e).__name__}: {e}); delete it to start over"
        ) from e


def check_schedule(
    *, max_steps: int | None, epochs: float, lr: float, batch: int, held_out: float
) -> None:
    """The settings every trainer shares, validated with the CLI's option names."""
    if max_steps is not None and max_steps < 1:
        raise ConfigError(f"--max-steps must be >= 1, got {max_steps}")
    if epochs <= 0 or lr <= 0 or batch < 1:
        raise ConfigError("epochs, lr and batch size must be positive")
    if not 0.0 <= held_out < 1.0:
        raise ConfigError(f"held-out fraction must be in [0, 1), got {held_out}")


def warmup_then_linear(opt: torch.optim.Optimizer, total_steps: int, warmup: int = 20) -> Any:
    """20 warm-up steps, then a linear decay to 5% of the rate: the schedule every trainer
    here uses (their runs are short, so no cosine tail)."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.05, 1 - s / total_steps)
    )
