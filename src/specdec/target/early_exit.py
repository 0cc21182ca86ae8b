"""Drafts made of a subset of the target's own decoder layers, sharing its modules.

``layer_subset_model(target, layers)`` runs the listed layers (ascending) then the target's final
norm and LM head: early exit is the prefix ``range(N)`` (Hugging Face's early-exit assistant),
layer skipping (Draft & Verify, SWIFT) drops a set of middle layers. Every module is the
target's own (no weight copy) and the target's config is not touched.

KV slots: each shared attention module writes the cache slot of its *original* layer index
(Hugging Face's ``layer_idx``), which we must not change on a shared module. The draft's config
copy therefore declares ``max(layers) + 1`` layers, so its runner's cache has a slot for every
index up to the last kept layer; the slots of skipped layers stay empty (they cost no memory and
cropping skips them). Layer 0 must be kept: the cache's length is read from slot 0.

Never run such a draft with ``output_hidden_states=True``: transformers then installs
output-capturing hooks on the (shared) layers, which would also fire inside the target and
duplicate its hidden states. Feature extraction runs the target and slices its hidden states.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from specdec.errors import ConfigError, UnsupportedModelError


def decoder_layers(target: PreTrainedModel) -> nn.ModuleList:
    """The target's decoder layers (``.model.layers``), or a clear error."""
    backbone = getattr(target, "model", None)
    layers = getattr(backbone, "layers", None)
    if backbone is None or not isinstance(layers, nn.ModuleList):
        raise UnsupportedModelError(
            f"drafts made of the target's layers need a decoder with `.model.layers`; "
            f"{type(target).__name__} has none"
        )
    return layers


def layer_subset_model(
    target: PreTrainedModel,
    layers: Sequence[int],
    final_norm: nn.Module | None = None,
    lm_head: nn.Module | None = None,
) -> PreTrainedModel:
    """A causal LM over ``target``'s decoder layers ``layers`` (strictly ascending, 0 first,
    not all of them), then ``final_norm`` and ``lm_head`` (default: the target's own; a trained
    exit passes its adapter followed by the target's norm, and a head over fewer rows)."""
    all_layers = decoder_layers(target)
    total = len(all_layers)
    keep = list(layers)
    if not keep or keep[0] != 0:
        raise ConfigError("a layer subset must keep layer 0 (the cache reads its length there)")
    if any(b <= a for a, b in zip(keep, keep[1:], strict=False)):
        raise ConfigError(f"layer subset {keep} must be strictly ascending")
    if keep[-1] >= total:
        raise ConfigError(f"layer {keep[-1]} does not exist: the target has layers 0..{total - 1}")
    if len(keep) == total:
        raise ConfigError("a layer subset must leave out at least one layer of the target")
    for i in keep:
        idx = getattr(getattr(all_layers[i], "self_attn", None), "layer_idx", i)
        if idx != i:
            raise UnsupportedModelError(
                f"layer {i} of {type(target).__name__} writes KV slot {idx}; cannot share it"
            )
    slots = keep[-1] + 1
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = slots
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:slots]
    with torch.device("meta"):
        draft = type(target)(cfg)
    backbone = target.model
    for name, module in backbone.named_children():
        if name == "layers":
            module = nn.ModuleList([all_layers[i] for i in keep])
        elif name == "norm" and final_norm is not None:
            module = final_norm
        setattr(draft.model, name, module)
    for name, module in target.named_children():
        if name == "lm_head" and lm_head is not None:
            module = lm_head
        if name != "model":
            setattr(draft, name, module)
    leftover = [n for n, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
    if leftover:
        raise UnsupportedModelError(
            f"cannot share {type(target).__name__}'s modules with a layer-subset draft "
            f"(unassigned: {leftover[:3]})"
        )
    draft.generation_config = copy.deepcopy(target.generation_config)
    draft.eval()
    return draft


def early_exit_model(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A causal LM over ``target``'s first ``num_layers`` decoder layers."""
    total = len(decoder_layers(target))
    if not 1 <= num_layers < total:
        raise ConfigError(f"layers:N needs 1 <= N < {total} (the target's layer count)")
    return layer_subset_model(target, range(num_layers))
