"""Mixed precision for the trainers: matmuls in bfloat16 where the hardware has them natively.

A speculator head trains on cached features with the target frozen, so its steps are a few
GEMMs (the readout over the draft vocabulary dominates). Where bf16 matmuls are native (AMX or
AVX512-BF16 on a CPU, Ampere or later on a GPU) they run several times faster than fp32
(``docs/training.md``). Weights, optimiser state and the losses'
softmaxes stay float32 (standard mixed precision); ``fp32`` turns it off.
"""

from __future__ import annotations

from typing import Any

import torch

from specdec.errors import ConfigError

PRECISIONS = ("auto", "bf16-mixed", "fp32")


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown --precision {precision!r}; use one of {', '.join(PRECISIONS)}")


def bf16_matmuls(device: torch.device | str) -> bool:
    """Whether bfloat16 matmuls are native on ``device``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if dev.type == "cpu":
        return bool(
            torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
    return False


def uses_bf16(precision: str, device: torch.device | str) -> bool:
    return precision == "bf16-mixed" or (precision == "auto" and bf16_matmuls(device))


def autocast(precision: str, device: torch.device | str) -> Any:
    """The context a training (or evaluation) step runs in; a no-op for ``fp32``."""
    dev = torch.device(device)
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=uses_bf16(precision, dev))
