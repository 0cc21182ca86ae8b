"""Model loading: :func:`load_model` hands a ``--dtype`` to the backend that runs it
(:mod:`specdec.target.backends`), which reads the model files (:mod:`specdec.target.checkpoints`)
and applies its numerics.

The top of :mod:`specdec.target`: nothing in it imports this module. The names below the
imports are the ones callers have always found here; they live in the lower layers now.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from specdec.errors import ModelNotFoundError
from specdec.target.backends import backend_for
from specdec.target.base import LoadedModel, ModelSource, identity_mismatch
from specdec.target.checkpoints import (
    DEFAULT_GGUF_NAME,
    DEFAULT_MODEL_HUB_ID,
    DEFAULT_MODEL_PACKAGE,
    INSTALL_HINT,
    calibration_file,
    convert_gguf,
    converted_dir,
    default_gguf_path,
    gguf_tokenizer,
    is_converted,
)
from specdec.target.files import cache_root

__all__ = [
    "DEFAULT_GGUF_NAME",
    "DEFAULT_MODEL_HUB_ID",
    "DEFAULT_MODEL_PACKAGE",
    "INSTALL_HINT",
    "LoadedModel",
    "cache_root",
    "calibration_file",
    "convert_gguf",
    "converted_dir",
    "default_gguf_path",
    "gguf_tokenizer",
    "identity_mismatch",
    "is_converted",
    "load_model",
]


def load_model(
    model: str | os.PathLike[str] | None = None,
    *,
    gguf: str | os.PathLike[str] | None = None,
    dtype: str = "float32",
    cache_dir: Path | None = None,
    device: str | torch.device = "cpu",
    chat_template: str | os.PathLike[str] | None = None,
) -> LoadedModel:
    """Load a causal LM for the engine.

    Exactly one of ``model`` (a local HF directory, or a model pack's alias such as
    ``qwen2.5-coder-1.5b``: :mod:`specdec.target.packs`) or ``gguf`` may be given; with neither,
    the bundled SmolLM2-135M-Instruct is used. ``device`` is ``cpu`` (the default), ``cuda``,
    ``cuda:N`` or ``auto`` (CUDA when present); ``dtype`` ``float32`` is the device's fastest
    exact numerics (:func:`specdec.target.numerics.apply_numerics`). Both are checked before
    anything loads. ``chat_template`` (a file or the template text) replaces the tokenizer's
    own, for models, often GGUF files, that carry none.
    """
    if model is not None and gguf is not None:
        raise ModelNotFoundError("pass either a model directory or a GGUF file, not both")
    source = ModelSource(model, gguf, cache_dir, device, chat_template)
    return backend_for(dtype).load(dtype, source)
