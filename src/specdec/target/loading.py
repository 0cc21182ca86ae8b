"""Model loading: :func:`load_model` hands a ``--dtype`` to the backend that runs it
(:mod:`specdec.target.backends`), which reads the model files (:mod:`specdec.target.checkpoints`)
and applies its numerics.

The top of :mod:`specdec.target`: nothing in it imports this module. The names below the
imports are the ones callers have always found here; they live in the lower layers now.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from specdec.errors import ConfigError, ModelNotFoundError
from specdec.target import kquant
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
    resolve_gguf,
)
from specdec.target.files import cache_root

__all__ = [
    "AUTO",
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
    "choose_dtype",
    "load_model",
    "load_named",
]

AUTO = "auto"


def load_model(
    model: str | os.PathLike[str] | None = None,
    *,
    gguf: str | os.PathLike[str] | None = None,
    dtype: str = AUTO,
    cache_dir: Path | None = None,
    device: str | torch.device = "cpu",
    chat_template: str | os.PathLike[str] | None = None,
) -> LoadedModel:
    """Load a causal LM for the engine.

    Exactly one of ``model`` (a local HF directory, or a model pack's alias such as
    ``qwen2.5-coder-1.5b``: :mod:`specdec.target.packs`) or ``gguf`` may be given; with neither,
    the bundled SmolLM2-135M-Instruct is used. ``device`` is ``cpu`` (the default), ``cuda``,
    ``cuda:N`` or ``auto`` (CUDA when present); ``dtype`` ``auto`` (the default) picks the
    fastest numerics that keep the model's own weights (:func:`choose_dtype`), ``float32`` is
    the device's fastest exact fp32 (:func:`specdec.target.numerics.apply_numerics`). Both are
    checked before anything loads. ``chat_template`` (a file or the template text) replaces
    the tokenizer's own, for models, often GGUF files, that carry none.
    """
    if model is not None and gguf is not None:
        raise ModelNotFoundError("pass either a model directory or a GGUF file, not both")
    source = ModelSource(model, gguf, cache_dir, device, chat_template)
    note = None
    if dtype == AUTO:
        dtype, note = choose_dtype(source)
    loaded = backend_for(dtype).load(dtype, source)
    loaded.numerics_note = note
    return loaded


def load_named(spec: str, **kwargs: Any) -> LoadedModel:
    """:func:`load_model` for a model named by one string, as a draft or assistant spec names
    it: a ``.gguf`` file (converted, as ``gguf=`` is), a model directory or a pack alias."""
    if spec.lower().endswith(".gguf"):
        return load_model(gguf=spec, **kwargs)
    return load_model(spec, **kwargs)


def choose_dtype(source: ModelSource) -> tuple[str, str | None]:
    """What ``dtype='auto'`` runs ``source`` in, and a note where that is not the file's own
    numerics (why, and what it costs).

    A GGUF file (or a model pack, or the bundled model) on the CPU runs its own quantised
    blocks through specdec's small-row kernel (``kquant``): the weights the file holds, not
    rounded again, read at the file's size per token, and verification of k drafted rows at
    little more than one row's cost. Speculation is lossless with respect to those numerics, as
    it is with respect to any target's. A file the kernel does not cover, a model directory,
    and any other device run ``float32``, the exact fp32 of the weights as given."""
    device = str(source.device).strip().lower()
    if device not in ("cpu", "auto") or (device == "auto" and torch.cuda.is_available()):
        return "float32", None
    gguf_path, _ = resolve_gguf(source.model, source.gguf, source.cache_dir)
    if gguf_path is None:
        return "float32", None
    try:
        reason = kquant.coverage(gguf_path)
    except (ValueError, OSError, KeyError, IndexError):
        return "float32", None  # an unreadable file: the loader names what is wrong with it
    if reason is None:
        try:
            if kquant.extension().has_simd():
                return "kquant", None
            reason = "this CPU has neither AVX2 nor AVX-512 for its kernel"
        except ConfigError as error:
            reason = str(error)
    file_gb, fp32_gb = kquant.linear_bytes(gguf_path)
    return "float32", (
        f"chosen because the file's own blocks cannot run here: {reason}; the dequantised "
        f"copy reads {fp32_gb:.1f} GB a token where the file's blocks are {file_gb:.1f} GB"
    )
