"""A draft made of the target's first N layers, sharing its embeddings, norm and LM head.

This is the draft Hugging Face's early-exit assistant uses. It shares the target's modules (no
weight copy, the target's config is not touched) and keeps its own KV cache in its runner.
Untrained it agrees with the full model rarely; it exercises the draft-model path until a
trained draft exists.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PreTrainedModel

from specdec.errors import ConfigError, UnsupportedModelError


def early_exit_model(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A causal LM over ``target``'s first ``num_layers`` decoder layers."""
    backbone = getattr(target, "model", None)
    layers = getattr(backbone, "layers", None)
    if backbone is None or not isinstance(layers, nn.ModuleList):
        raise UnsupportedModelError(
            f"layers:N drafts need a decoder with `.model.layers`; {type(target).__name__} has none"
        )
    total = len(layers)
    if not 1 <= num_layers < total:
        raise ConfigError(f"layers:N needs 1 <= N < {total} (the target's layer count)")
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = num_layers
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:num_layers]
    with torch.device("meta"):
        draft = type(target)(cfg)
    for name, module in backbone.named_children():
        if name == "layers":
            module = nn.ModuleList(list(layers[:num_layers]))
        setattr(draft.model, name, module)
    for name, module in target.named_children():
        if name != "model":
            setattr(draft, name, module)
    leftover = [n for n, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
    if leftover:
        raise UnsupportedModelError(
            f"cannot share {type(target).__name__}'s modules with an early-exit draft "
            f"(unassigned: {leftover[:3]})"
        )
    draft.generation_config = copy.deepcopy(target.generation_config)
    draft.eval()
    return draft
