"""The torch backend: float weights through torch's own kernels (``float32``, the default, with
oneDNN-prepacked linears on the CPU; ``float32-stock``, ``fp16-weights``, ``bfloat16``,
``float64``), on the CPU or CUDA.

The other torch families (low-bit, kquant, onnxruntime int4) load and verify the same way and
subclass :class:`TorchBackend`: only their dtypes, devices and what the load adds differ.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch
from transformers import PreTrainedModel

from specdec.request import read_chat_template
from specdec.target.base import Backend, LoadedModel, ModelSource, Target
from specdec.target.checkpoints import convert_gguf, load_dir, load_tokenizer, resolve_gguf
from specdec.target.hf import HFTarget
from specdec.target.numerics import (
    apply_numerics,
    check_numerics_device,
    get_numerics,
    resolve_device,
)
from specdec.target.runner import ModelRunner, TokenRunner
from specdec.tree import DraftTree

# Called with the loaded model, the file it came from and whether that was a model directory,
# before its numerics are applied (kquant attaches the GGUF file's own blocks there).
Prepare = Callable[[PreTrainedModel, str, bool], None]


def load_torch(dtype: str, source: ModelSource, prepare: Prepare | None = None) -> LoadedModel:
    """``source`` as a transformers model in the numerics ``dtype``: a model directory as it
    is, a GGUF file (or pack, or the bundled model) through its dequantised copy. The dtype and
    device are checked before anything loads."""
    numerics = get_numerics(dtype)
    target_device = resolve_device(source.device)
    check_numerics_device(numerics, target_device)
    chat_template = source.chat_template
    template = None if chat_template is None else read_chat_template(chat_template)
    gguf_path, model = resolve_gguf(source.model, source.gguf, source.cache_dir)
    if gguf_path is not None:
        path = convert_gguf(gguf_path, source.cache_dir)
        origin = str(gguf_path)
    else:
        path = Path(str(model))
        origin = str(path)
    hf_model, _ = load_dir(path, numerics.storage_dtype)
    tokenizer = load_tokenizer(path)
    if template is not None:
        tokenizer.chat_template = template
    hf_model.eval()
    hf_model.requires_grad_(False)
    if prepare is not None:
        prepare(hf_model, origin, gguf_path is None)
    description = apply_numerics(hf_model, numerics, target_device)
    return LoadedModel(
        model=hf_model,
        tokenizer=tokenizer,
        source=origin,
        numerics=description,
        dtype_name=numerics.name,
    )


class TorchBackend(Backend):
    """A transformers model in torch: verified by :class:`HFTarget` in one pass per tree, with
    hidden states for feature speculators, batchable."""

    name: ClassVar[str] = "torch"
    dtypes: ClassVar[tuple[str, ...]] = (
        "float32",
        "float32-stock",
        "fp16-weights",
        "bfloat16",
        "float64",
    )
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")

    def load(self, dtype: str, source: ModelSource) -> LoadedModel:
        return load_torch(dtype, source)

    def verifier(self, loaded: LoadedModel, threads: int | None = None) -> Target:
        return HFTarget(loaded)

    def verification_runner(
        self, loaded: LoadedModel, threads: int | None = None
    ) -> tuple[TokenRunner, Callable[[DraftTree], torch.Tensor]]:
        runner = ModelRunner(loaded.model)
        return runner, runner.forward_tree

    def is_reference(self, dtype: str) -> bool:
        return get_numerics(dtype).reference
