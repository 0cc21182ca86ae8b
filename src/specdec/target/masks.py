"""The attention masks of one forward pass over the cache: causal or tree, full or windowed.

Every layer keeps its keys and values for the whole context (:mod:`specdec.cache.layout`), so a
sliding-window layer's window lives in its mask: a query at position p sees a key at position j
only when ``p - j < window`` (transformers' ``sliding_window_overlay``). For a tree, positions are
the prefix length plus the node's depth, so a node sees its ancestors and the committed prefix
within the window, exactly what the same path decoded as a chain would see.

Models with one kind of attention layer take a single 4D mask; models that interleave local and
global layers (Gemma 2/3, Qwen2 with ``max_window_layers``, gpt-oss) take transformers' public
per-layer-type form, a dict ``{"full_attention": m, "sliding_attention": m2}``, which their
forward passes through unchanged (``if not isinstance(attention_mask, dict)``). Prepared 4D masks
are returned as-is by transformers' mask builders, so no model code is patched.
"""

from __future__ import annotations

import torch

from specdec.cache.layout import FULL, SLIDING, AttentionLayout

Masks = torch.Tensor | dict[str, torch.Tensor]


def attention_masks(
    layout: AttentionLayout,
    start: int,
    positions: torch.Tensor,  # [T] absolute positions of the new tokens, on the model's device
    tree_mask: torch.Tensor | None = None,  # [T, T] bool: ancestors (and self) of each token
) -> Masks | None:
    """The ``attention_mask`` argument for ``T`` new tokens after ``start`` cached ones.

    ``None`` (the model's own causal mask, its fast path) for a chain whose every key lies
    within the window; otherwise bool masks ``[1, 1, T, start + T]`` on ``positions``' device.

    >>> layout = AttentionLayout(("sliding_attention",), (2,))
    >>> attention_masks(layout, 1, torch.arange(1, 3))[0, 0].int().tolist()
    [[1, 1, 0], [0, 1, 1]]
    """
    window = layout.window
    n = int(positions.shape[0])
    if tree_mask is None and (window is None or start + n <= window):
        return None
    device = positions.device
    full = torch.ones(n, start + n, dtype=torch.bool, device=device)  # [T, P+T]
    if tree_mask is None:
        full[:, start:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    else:
        full[:, start:] = tree_mask.to(device, non_blocking=True)
    masks: dict[str, torch.Tensor] = {}
    if FULL in layout.mask_types:
        masks[FULL] = full[None, None]
    if SLIDING in layout.mask_types:
        assert window is not None
        key_pos = torch.cat([torch.arange(start, device=device), positions])  # [P+T]
        near = (positions[:, None] - key_pos[None, :]) < window  # [T, P+T]
        masks[SLIDING] = (full & near)[None, None]
    if not layout.mixed:
        return next(iter(masks.values()))
    return masks
