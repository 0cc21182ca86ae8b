"""The onnxruntime backend: ``int4-ort``, onnxruntime's MLAS int4 kernels inside the torch
model (:mod:`specdec.target.ort_int4`; the ``ort`` extra)."""

from __future__ import annotations

from typing import ClassVar

from specdec.target.backends.dense import TorchBackend


class OrtBackend(TorchBackend):
    """MatMulNBits linears swapped into the torch model; the CPU only."""

    name: ClassVar[str] = "onnxruntime"
    dtypes: ClassVar[tuple[str, ...]] = ("int4-ort",)
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
