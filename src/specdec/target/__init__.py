"""The target model: loading, numerics, one-pass tree verification, capability probe."""

from specdec.target.early_exit import early_exit_model
from specdec.target.hf import HFTarget, Target
from specdec.target.loading import LoadedModel, default_gguf_path, load_model
from specdec.target.runner import ModelRunner

__all__ = [
    "HFTarget",
    "LoadedModel",
    "Target",
    "ModelRunner",
    "default_gguf_path",
    "early_exit_model",
    "load_model",
]
