"""Reading trained heads' weights, shared by every head family (Medusa, EAGLE): files that
may be truncated or corrupt, and state dicts that may not fit the module their config implies.
Each failure is a :class:`CheckpointError` naming the file and the problem."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from specdec.errors import CheckpointError


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path} (truncated or corrupt?): {e}") from e


def read_torch_state(path: Path) -> dict[str, torch.Tensor]:
    """A ``.pt``/``.bin`` state dict, loaded without unpickling arbitrary objects."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle and zip readers raise many types on a broken file
        raise CheckpointError(f"cannot read {path} (truncated or corrupt?): {e}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} is not a state dict of tensors")
    return state


def load_checked(module: nn.Module, state: dict[str, torch.Tensor], where: Path) -> None:
    """Load ``state`` into ``module`` after checking it has exactly the module's keys and
    shapes; values are cast to the module's own dtypes (checkpoints come in fp16/bf16 too)."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: the weights do not match the config: missing {missing[:4]}, unexpected "
            f"{unexpected[:4]}"
        )
    for key, value in state.items():
        if value.shape != expected[key].shape:
            raise CheckpointError(
                f"{where}: {key} has shape {tuple(value.shape)}, the config implies "
                f"{tuple(expected[key].shape)}"
            )
    module.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})
