"""The kquant backend: a GGUF file's own Q4_K/Q6_K blocks in specdec's small-row CPU kernel,
inside the torch model (:mod:`specdec.target.kquant`)."""

from __future__ import annotations

from typing import ClassVar

from transformers import PreTrainedModel

from specdec.errors import ConfigError
from specdec.target.backends.dense import TorchBackend, load_torch
from specdec.target.base import LoadedModel, ModelSource
from specdec.target.kquant import attach_gguf_blocks


def _attach_blocks(model: PreTrainedModel, source: str, from_directory: bool) -> None:
    """The linears are built from the file's own blocks, not the dequantised copy, so the
    model must come from a GGUF file."""
    if from_directory:
        raise ConfigError(
            "dtype 'kquant' runs a GGUF file's own Q4_K/Q6_K blocks: pass --gguf FILE or a "
            f"model pack, not the model directory {source!r}"
        )
    attach_gguf_blocks(model, source)


class KQuantBackend(TorchBackend):
    """Q4_K/Q6_K linears over the GGUF's blocks; the CPU only, a GGUF file or pack only."""

    name: ClassVar[str] = "kquant"
    dtypes: ClassVar[tuple[str, ...]] = ("kquant",)
    devices: ClassVar[tuple[str, ...]] = ("cpu",)

    def load(self, dtype: str, source: ModelSource) -> LoadedModel:
        return load_torch(dtype, source, prepare=_attach_blocks)
