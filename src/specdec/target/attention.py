"""A grouped-query SDPA attention function, registered through transformers' public interface.

Stock ``sdpa`` attention repeats the key/value heads (``repeat_kv``) whenever a mask is needed,
which is every multi-token verification pass over a cache, and that copy is a noticeable share
of the pass (experiments/verification-cost/2026-11-29-numerics.md).
``scaled_dot_product_attention(enable_gqa=True)`` attends to the shared heads directly and
gives identical results. Registering it under a new name
(``AttentionInterface.register``) is the documented extension point: no model code is patched.

The row-wise form (:func:`rowwise_sdpa_attention`) is what the low-bit numerics and the kquant
layers run: it computes each query row alone, which keeps their forward row-invariant.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specdec.errors import ConfigError

ATTN_IMPLEMENTATION = "specdec_gqa_sdpa"


def gqa_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, heads, T, head_dim]
    key: torch.Tensor,  # [B, kv_heads, T_kv, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    q_len = query.shape[2]
    # transformers only drops the mask when no cache precedes the queries, where the
    # top-left-aligned causal flag is right.
    causal = attention_mask is None and q_len > 1
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(query.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Idempotent; returns the name to pass as ``attn_implementation``."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, gqa_sdpa_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


ROWWISE_ATTENTION = "specdec_rowwise_sdpa"
ROWWISE_MAX_ROWS = 64  # larger passes are a prompt's prefill, the same in plain and speculative


def rowwise_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,  # [B, heads, T, head_dim]
    key: torch.Tensor,  # [B, kv_heads, T_kv, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # [B or 1, 1, T, T_kv] bool (or additive), or None
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention that computes each query row alone, over exactly the keys it may see, copied
    contiguous and in cache order: so a row among the k rows of a verification pass gets the
    same bits as the one-row pass of plain decoding at that position. With the low-bit linears
    (row-invariant too) the whole forward is then row-invariant, which quantised activations
    need: they round, and a 1e-7 difference from another blocking of a batched attention
    (what fp32 tolerates) can move a value across a rounding boundary, change the logits by
    ~1e-2 and flip a near-tied argmax, so that speculative output would leave plain output.
    Each row is two small matmuls and a softmax (cheaper here than a fused SDPA call per row);
    passes of more than ``ROWWISE_MAX_ROWS`` rows (prefill) use one batched SDPA call. A module
    with a ``row_attention`` method (kquant's) computes every row with it instead, so a batched
    or padded pass gives each row what the module's single-sequence passes give it."""
    own = getattr(module, "row_attention", None)
    if own is not None:  # the module's own row kernel: the bits of its one-sequence passes
        return own(query, key, value, attention_mask, scaling), None
    b, heads, t, _ = query.shape
    if t > ROWWISE_MAX_ROWS:
        return gqa_sdpa_attention(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    kv_heads, n_keys, dim = key.shape[1], key.shape[2], key.shape[3]
    group = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    allowed = attention_mask
    if allowed is not None and allowed.dtype != torch.bool:
        allowed = allowed > torch.finfo(allowed.dtype).min / 2
    out = query.new_empty(b, t, heads, value.shape[-1])  # [B, T, heads, head_dim]
    for bi in range(b):
        q_b = query[bi].reshape(kv_heads, group, t, dim)  # query heads grouped by their kv head
        for i in range(t):
            row = None if allowed is None else allowed[min(bi, allowed.shape[0] - 1), 0, i]
            n = n_keys - t + i + 1  # causal: the queries are the last t positions
            if row is not None:
                n = int(row.sum())
                if not bool(row[:n].all()):  # not a prefix (a tree, a window): gather
                    idx = row.nonzero().squeeze(1)
                    k_i, v_i = key[bi].index_select(1, idx), value[bi].index_select(1, idx)
                else:
                    k_i, v_i = key[bi, :, :n], value[bi, :, :n]
            else:
                k_i, v_i = key[bi, :, :n], value[bi, :, :n]  # [kv_heads, n, head_dim]
            scores = torch.bmm(q_b[:, :, i], k_i.transpose(1, 2)).mul_(scale)  # [kvh, g, n]
            o = torch.bmm(torch.softmax(scores, -1), v_i)  # [kv_heads, group, head_dim]
            out[bi, i] = o.reshape(heads, -1)
    return out, None


def register_rowwise_attention() -> str:
    """Register :func:`rowwise_sdpa_attention` (idempotent); returns its name."""
    AttentionInterface.register(ROWWISE_ATTENTION, rowwise_sdpa_attention)
    AttentionMaskInterface.register(ROWWISE_ATTENTION, sdpa_mask)
    return ROWWISE_ATTENTION


def use_rowwise_attention(model: nn.Module) -> None:
    """Switch a transformers model to :func:`rowwise_sdpa_attention` (public API:
    ``set_attn_implementation``; no model code is patched)."""
    if not isinstance(model, PreTrainedModel):
        raise ConfigError(
            "low-bit numerics need a transformers model: they switch its attention to the "
            "row-wise form that keeps speculation identical to plain decoding"
        )
    model.set_attn_implementation(register_rowwise_attention())
