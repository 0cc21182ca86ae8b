"""The student: the target's architecture with fewer layers (and optionally a narrower hidden
size), started as the target's own early-exit draft when the width allows it."""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from specdec.errors import ConfigError, UnsupportedModelError
from specdec.target.loading import LoadedModel


def student_config(target: PretrainedConfig, layers: int, hidden: int | None) -> PretrainedConfig:
    """A deep copy of the target's config with ``layers`` layers (and hidden size ``hidden``).

    A narrower student keeps the head count and the MLP expansion ratio; the vocabulary, RoPE and
    every other setting are the target's. The target's config is not modified.
    """
    total = int(target.num_hidden_layers)
    if not 1 <= layers < total:
        raise ConfigError(
            f"--layers must be between 1 and {total - 1} (the target has {total} layers); "
            f"got {layers}"
        )
    cfg = copy.deepcopy(target)
    cfg.num_hidden_layers = layers
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:layers]
    width = int(target.hidden_size)
    if hidden is not None and hidden != width:
        heads = int(target.num_attention_heads)
        if hidden < 1 or hidden % heads:
            example = max(heads, (hidden // heads) * heads)
            raise ConfigError(
                f"--hidden {hidden} is not divisible by the target's {heads} attention heads; "
                f"use a multiple of {heads} (e.g. {example})"
            )
        head_dim = hidden // heads
        if head_dim % 2:
            raise ConfigError(
                f"--hidden {hidden} gives {head_dim}-wide attention heads, but rotary position "
                f"embeddings need an even head width; use a multiple of {2 * heads}"
            )
        cfg.hidden_size = hidden
        if getattr(cfg, "head_dim", None) is not None:
            cfg.head_dim = head_dim
        if getattr(cfg, "intermediate_size", None):
            cfg.intermediate_size = max(1, round(target.intermediate_size * hidden / width))
    cfg.architectures = list(getattr(target, "architectures", None) or []) or None
    cfg.dtype = torch.float32
    cfg._name_or_path = ""
    cfg.use_cache = True
    return cfg


def build_student(
    loaded: LoadedModel, layers: int, hidden: int | None, seed: int
) -> tuple[PreTrainedModel, str]:
    """A float32 student and a sentence saying how it was initialised.

    Tensors are copied from the target (never shared), so training leaves the target as it was.
    """
    target = loaded.model
    cfg = student_config(target.config, layers, hidden)
    if not cfg.architectures:
        cfg.architectures = [type(target).__name__]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        student = AutoModelForCausalLM.from_config(
            cfg, attn_implementation="sdpa", dtype=torch.float32
        )
    student.generation_config = copy.deepcopy(target.generation_config)
    if cfg.hidden_size != target.config.hidden_size:
        note = (
            f"random initialisation (seed {seed}): hidden size {cfg.hidden_size} differs from the "
            f"target's {target.config.hidden_size}, so no target weights fit"
        )
        return student, note
    _copy_from_target(student, target)
    note = (
        f"initialised from the target's embeddings, first {layers} of "
        f"{target.config.num_hidden_layers} layers, final norm and LM head"
    )
    return student, note


def _copy_from_target(student: PreTrainedModel, target: PreTrainedModel) -> None:
    weight = target.get_input_embeddings().weight
    dtype = weight.dtype if isinstance(weight, torch.Tensor) else torch.float32  # storage dtype
    with torch.no_grad():
        for name, param in student.named_parameters():
            module_name, _, attr = name.rpartition(".")
            try:
                module = target.get_submodule(module_name)
            except AttributeError:
                raise UnsupportedModelError(
                    f"cannot initialise the student from {type(target).__name__}: the target has "
                    f"no module {module_name!r}; pass --hidden to train from random weights"
                ) from None
            source = _dense_tensor(module, attr, dtype)
            if source is None or source.shape != param.shape:
                raise UnsupportedModelError(
                    f"cannot initialise the student's {name} from the target (shape "
                    f"{None if source is None else tuple(source.shape)} vs "
                    f"{tuple(param.shape)}); pass --hidden to train from random weights"
                )
            param.copy_(source.to(torch.float32))


def _dense_tensor(module: nn.Module, attr: str, dtype: torch.dtype) -> torch.Tensor | None:
    """A module's weight or bias as a plain tensor, also for the linears that the target's
    numerics swapped in (prepacked oneDNN, fp16 fbgemm), read back through their forward:
    ``m(I) - m(0)`` is ``W^T`` exactly, since each entry is one product by 1."""
    value = getattr(module, attr, None)
    if isinstance(value, torch.Tensor) and value.layout == torch.strided:
        return value.detach()
    n_in, n_out = getattr(module, "in_features", None), getattr(module, "out_features", None)
    if attr not in ("weight", "bias") or not (isinstance(n_in, int) and isinstance(n_out, int)):
        return None
    with torch.no_grad():
        zero = module(torch.zeros(1, n_in, dtype=dtype))  # [1, out] = bias
        if attr == "bias":
            return zero[0]
        return (module(torch.eye(n_in, dtype=dtype)) - zero).T.contiguous()  # [out, in]


def freeze_embeddings(student: PreTrainedModel) -> None:
    """Keep the target's vocabulary matrices: with a tied LM head, Adam would otherwise move
    every one of the V rows every step, and the head is most of a small student's weights."""
    for module in (student.get_input_embeddings(), student.get_output_embeddings()):
        if module is not None:
            module.requires_grad_(False)
