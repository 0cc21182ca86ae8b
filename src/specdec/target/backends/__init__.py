"""The backend registry: one line per numerics family. A new backend is a module here with a
:class:`~specdec.target.base.Backend` subclass, and one line below.

The order is the order ``--dtype`` lists its choices in (the torch default ``float32`` first).
"""

from __future__ import annotations

from specdec.target.backends.dense import TorchBackend
from specdec.target.backends.kquant import KQuantBackend
from specdec.target.backends.llamacpp import LlamaCppBackend
from specdec.target.backends.lowbit import LowBitBackend
from specdec.target.backends.ort import OrtBackend
from specdec.target.base import (
    Backend,
    backend_for,
    dtype_choices,
    register_backend,
    registered_backends,
)

TORCH = register_backend(TorchBackend())
LOWBIT = register_backend(LowBitBackend())
ORT = register_backend(OrtBackend())
KQUANT = register_backend(KQuantBackend())
LLAMACPP = register_backend(LlamaCppBackend())

__all__ = [
    "KQUANT",
    "LLAMACPP",
    "LOWBIT",
    "ORT",
    "TORCH",
    "Backend",
    "KQuantBackend",
    "LlamaCppBackend",
    "LowBitBackend",
    "OrtBackend",
    "TorchBackend",
    "backend_for",
    "dtype_choices",
    "registered_backends",
]
