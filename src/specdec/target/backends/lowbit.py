"""The low-bit torch backend: torch's own quantised CPU kernels (``int8-dynamic``, ``int8``,
``int4``, ``int4-g128``; :mod:`specdec.target.lowbit`)."""

from __future__ import annotations

from typing import ClassVar

from specdec.target.backends.dense import TorchBackend

INT4 = "int4"  # group 32: the fastest torch draft measured (specdec.target.drafts)
ANY_SHAPE = "int8-dynamic"  # the one that takes a linear of any shape


class LowBitBackend(TorchBackend):
    """Low-bit linears swapped into the torch model; the CPU only."""

    name: ClassVar[str] = "lowbit"
    dtypes: ClassVar[tuple[str, ...]] = (ANY_SHAPE, "int8", INT4, "int4-g128")
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
