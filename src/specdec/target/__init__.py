"""The target model: loading, numerics backends, one-pass tree verification, capability probe.

Layers, lowest first (no module imports one above it, inside functions either):
``files``, ``attention``, ``masks``, ``gguf_blocks``, ``ort_int4``, ``early_exit`` (no other
target module); the kernels ``lowbit`` < ``kquant`` < ``kquant_layers`` and ``numerics``;
``packs``, ``runner``, ``llamacpp``; ``base`` (LoadedModel, Target, Backend and the registry);
``checkpoints``, ``hf``; the backends (:mod:`specdec.target.backends`); ``loading``; ``drafts``.
"""

from specdec.target.base import Backend, backend_for, dtype_choices
from specdec.target.early_exit import early_exit_model
from specdec.target.hf import HFTarget, Target
from specdec.target.loading import LoadedModel, default_gguf_path, load_model, load_named
from specdec.target.runner import ModelRunner, TokenRunner

__all__ = [
    "Backend",
    "HFTarget",
    "LoadedModel",
    "Target",
    "ModelRunner",
    "TokenRunner",
    "backend_for",
    "default_gguf_path",
    "dtype_choices",
    "early_exit_model",
    "load_model",
    "load_named",
]
