"""Resumable training state (module, optimiser, schedule, step, history) for every trainer.

Written atomically (temp file + rename), so an interrupted run leaves the previous state, and
read back with a clear error rather than a traceback when it is broken.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdec.errors import CheckpointError


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
