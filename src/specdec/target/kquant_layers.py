"""Lean attention, MLP and RMSNorm modules for ``--dtype kquant`` models of the Qwen2/Llama
family, swapped in for Hugging Face's, and a lean decoder-layer forward over them.

Why: at one to eight rows HF's modules around a decode step's linears cost a large share of
what the linears themselves cost, mostly per-operator dispatch and Python (about 40 torch
operators a layer: RMSNorm's pow/mean/rsqrt chain, RoPE's ``rotate_half`` with its ``cat``, 8
per row and head group in row-wise attention, six module calls; the split:
experiments/kquant/2026-12-05-kquant.md). Here:

- q/k/v (and gate/up) whose GGUF blocks are of one kind run as one kernel call over their
  concatenated rows (the layers keep views of the fused rows, so nothing is stored twice):
  one activation rounding instead of three. The kernel computes each output channel from its
  own rows, so the fused call gives every channel the bits the separate calls gave it.
- RMSNorm, RoPE and attention are one call each into the extension (``csrc/layer.cpp``);
  RMSNorm and RoPE give HF's bits (tested), so a prefill's logits are what they were.
- The decoder layer's forward calls them directly (:class:`LeanDecoderLayer`), without a
  module call per norm, attention and MLP; and once the sequence's cache has room in place (every
  pass after its first), the whole layer is one extension call (``lean_layer``: the same kernels
  in the same order, so the same bits, tested), which writes the new keys and values into the
  cache's buffers itself. On a small model the Python and dispatch around the kernels were a
  fifth of a decoding step. A batch's pass over a single sequence (a server with one client)
  takes the same call on that sequence's row of the batch's cache (:func:`in_place`).

Attention sums in another order than torch's ``bmm`` (AVX-512, scores of a kv head's query
heads together), so verification and decoding logits differ from before by float rounding;
decoding bench/lowbit.py's fixed text in 8-token passes moved perplexity and argmax about as
much as one RMSNorm summation order against another does (experiments/kquant/kquant_rest.py
--quality; the figures: experiments/kquant/2026-12-05-kquant.md): int8 activation rounding
amplifies any rounding difference.

Losslessness is unchanged: every one of these computes a row from that row alone, in the same
order whatever the number of rows (attention over the keys the row may see, in cache order), so
a k-row verification pass still gives each row the logits of a one-row step (tested bit for
bit). A prompt's prefill takes the same kernels, so a row's bits do not depend on the pass it
came in either (Hugging Face ``generate`` over the same model, which prefills the whole prompt,
then picks the tokens specdec picks after prefilling all but the last). Batches of several
sequences take the row-wise attention path of :mod:`specdec.target.attention`, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specdec.target import kquant
from specdec.target.attention import (
    ROWWISE_ATTENTION,
    rowwise_sdpa_attention,
)
from specdec.target.kquant import KQuantLinear

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


class FusedRows:
    """One or more :class:`KQuantLinear` of one kind as one kernel call over their stacked rows.

    Not a module: the original layers stay in the model (the same paths, the same weight
    bytes), their tensors turned into views of the stacked ones."""

    def __init__(self, linears: Sequence[KQuantLinear]) -> None:
        kinds = {lin.kind_id for lin in linears}
        if len(kinds) != 1 or len({lin.in_features for lin in linears}) != 1:
            raise ValueError("fused linears need one kind and one input width")
        self.widths = [lin.out_features for lin in linears]
        if len(linears) == 1:
            self.linear = linears[0]
            return
        biases = [lin.bias for lin in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [
                    torch.zeros(w) if b is None else b
                    for b, w in zip(biases, self.widths, strict=True)
                ]
            )
        # kinds without per-block d/dmin (Q6_K's dmin, the lane-scaled kinds' both) hold empty
        # tensors, kept as they are
        names = tuple(n for n in ("codes", "meta", "d", "dmin") if getattr(linears[0], n).numel())
        parts = {name: torch.cat([getattr(lin, name) for lin in linears]) for name in names}
        for name in ("d", "dmin"):
            parts.setdefault(name, getattr(linears[0], name))
        self.linear = KQuantLinear(linears[0].kind, parts, linears[0].in_features, bias)
        offset = 0
        for lin, width in zip(linears, self.widths, strict=True):
            for name in names:
                setattr(lin, name, getattr(self.linear, name)[offset : offset + width])
            if lin.bias is not None:
                assert self.linear.bias is not None
                lin.bias = self.linear.bias[offset : offset + width]
            offset += width

    def __call__(self, x: torch.Tensor) -> Sequence[torch.Tensor]:
        """The outputs of each fused layer for float32 rows ``x`` ``[rows, K]``, as column
        views."""
        y = self.linear.mm(x)
        return (y,) if len(self.widths) == 1 else y.split_with_sizes(self.widths, 1)


def fuse_runs(linears: Sequence[KQuantLinear]) -> list[FusedRows]:
    """Consecutive layers of one kind fused (q/k are Q4_K and v is Q4_K or Q6_K depending on
    the layer in a Q4_K_M file)."""
    groups: list[list[KQuantLinear]] = []
    for lin in linears:
        if groups and groups[-1][0].kind_id == lin.kind_id:
            groups[-1].append(lin)
        else:
            groups.append([lin])
    return [FusedRows(g) for g in groups]


def _apply(groups: Sequence[FusedRows], x: torch.Tensor) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for g in groups:
        out.extend(g(x))
    return out


def allowed_keys(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """One sequence's ``[T, N]`` bool mask (the keys each row may see) from the model's
    ``[1, 1, T, N]`` mask, bool or additive; ``None`` (causal) stays ``None``."""
    if attention_mask is None:
        return None
    allowed = attention_mask[0, 0]
    if allowed.dtype != torch.bool:
        allowed = allowed > torch.finfo(allowed.dtype).min / 2
    return allowed


class KQuantRMSNorm(nn.Module):
    """HF's Qwen2/Llama RMSNorm (fp32) as one extension call."""

    weight: torch.Tensor
    variance_epsilon: float

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = cast(torch.Tensor, norm.weight)
        self.variance_epsilon = float(cast(float, norm.variance_epsilon))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return kquant.extension().rms_norm(hidden_states, self.weight, self.variance_epsilon)


class KQuantAttention(nn.Module):
    """Qwen2/Llama self-attention over kquant projections; the call signature and outputs of
    HF's attention module, so the decoder layer that calls it is unchanged."""

    q_proj: KQuantLinear
    k_proj: KQuantLinear
    v_proj: KQuantLinear
    o_proj: KQuantLinear
    layer_idx: int
    head_dim: int
    scaling: float

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        # HF's attributes read through nn.Module (typed Tensor | Module): _leanable checked them
        hf = cast(Any, attn)
        self.config = hf.config
        self.layer_idx = hf.layer_idx
        self.head_dim = hf.head_dim
        self.scaling = hf.scaling
        self.is_causal = True
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            hf.q_proj,
            hf.k_proj,
            hf.v_proj,
            hf.o_proj,
        )
        self._qkv = fuse_runs([self.q_proj, self.k_proj, self.v_proj])

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated) and v of one sequence's rows ``x`` ``[T, hidden]`` (float32), as
        ``[T, heads, D]`` views of the fused outputs; cos/sin ``[T, D]``."""
        d = self.head_dim
        q, k, v = _apply(self._qkv, x)
        # head counts from the widths, not -1: a pass of no rows (Hugging Face's universal
        # assisted generation feeds its assistant one) has nothing to infer them from
        q, k, v = (y.view(y.shape[0], y.shape[1] // d, d) for y in (q, k, v))
        ext = kquant.extension()
        ext.rope_(q, cos, sin)
        ext.rope_(k, cos, sin)
        return q, k, v

    def attend(
        self,
        q: torch.Tensor,  # [T, heads, D]
        k: torch.Tensor,  # [T, kv_heads, D]
        v: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: object | None,
    ) -> torch.Tensor:
        """Store one sequence's k/v in the cache and attend over it, row by row; returns the
        o_proj input ``[T, heads * D]``."""
        keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, kv_heads, T, D]
        if cache is not None:
            keys, values = cache.update(keys, values, self.layer_idx)  # type: ignore[attr-defined]
        return kquant.extension().attention(
            q, keys[0], values[0], allowed_keys(attention_mask), self.scaling, False
        )

    def forward(
        self,
        hidden_states: torch.Tensor,  # [B, T, hidden]
        position_embeddings: tuple[torch.Tensor, torch.Tensor],  # cos, sin [B, T, head_dim]
        attention_mask: torch.Tensor | None,  # [B or 1, 1, T, T_kv] bool, or None (causal)
        cache: object | None = None,
        **kwargs: object,
    ) -> tuple[torch.Tensor, None]:
        b, t, _ = hidden_states.shape
        cos, sin = position_embeddings
        x = hidden_states.reshape(b * t, -1).float()
        if self.owns_attention and b == 1:
            q, k, v = self.project(x, cos[0], sin[0])
            out = self.attend(q, k, v, attention_mask, cache)
        else:  # a prefill or a batch: HF's layout and the model's attention function
            # every sequence's rows in one projection (each row is computed alone, so its bits
            # do not depend on its batch mates), each row rotated by its own position
            width = cos.shape[-1]
            q, k, v = self.project(
                x,
                cos.expand(b, t, width).reshape(b * t, width),
                sin.expand(b, t, width).reshape(b * t, width),
            )
            q, k, v = (y.view(b, t, y.shape[1], y.shape[2]).transpose(1, 2) for y in (q, k, v))
            if cache is not None:
                k, v = cache.update(k, v, self.layer_idx)  # type: ignore[attr-defined]
            attend = (
                rowwise_sdpa_attention
                if self.owns_attention
                else ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
            )
            out, _ = attend(self, q, k, v, attention_mask, scaling=self.scaling, dropout=0.0)
        return self.o_proj.mm(out.reshape(b * t, -1)).view(b, t, -1), None

    def row_attention(
        self,
        query: torch.Tensor,  # [B, heads, T, D]
        key: torch.Tensor,  # [B, kv_heads, N, D]
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,  # [B or 1, 1, T, N] bool or additive, or None
        scaling: float | None = None,
    ) -> torch.Tensor:
        """Each sequence's rows through the kernel of :meth:`attend` (over the keys its mask
        allows, in cache order), for passes of several sequences: a batch mate then changes
        no bit of a row. Returns ``[B, T, heads, D]``, the layout attention functions return."""
        b, heads, t, d = query.shape
        scale = self.scaling if scaling is None else scaling
        ext = kquant.extension()
        out = query.new_empty(b, t, heads, value.shape[-1])
        for bi in range(b):
            allowed = None
            if attention_mask is not None:
                allowed = attention_mask[min(bi, attention_mask.shape[0] - 1), 0]
                if allowed.dtype != torch.bool:
                    allowed = allowed > torch.finfo(allowed.dtype).min / 2
            rows = ext.attention(
                query[bi].transpose(0, 1), key[bi], value[bi], allowed, scale, False
            )
            out[bi] = rows.view(t, heads, -1)
        return out

    @property
    def owns_attention(self) -> bool:
        """Whether the model runs its own (row-wise) attention, which this module's kernel
        computes; a batched pass switches the model to another function (the batch's packed
        attention, over each row's own cache and mask), which is then called instead."""
        return bool(self.config._attn_implementation == ROWWISE_ATTENTION)


class KQuantMLP(nn.Module):
    """The SiLU-gated MLP with gate/up as one kernel call where their kinds match."""

    gate_proj: KQuantLinear
    up_proj: KQuantLinear
    down_proj: KQuantLinear

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        hf = cast(Any, mlp)  # HF's MLP: its projections are KQuantLinear (_leanable checked)
        self.gate_proj, self.up_proj, self.down_proj = hf.gate_proj, hf.up_proj, hf.down_proj
        self._gate_up = fuse_runs([self.gate_proj, self.up_proj])

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP of float32 rows ``[T, hidden]``."""
        gate, up = _apply(self._gate_up, x)
        return self.down_proj.mm(F.silu(gate).mul_(up))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows(x.reshape(-1, x.shape[-1]).float()).view(*x.shape[:-1], -1)


def in_place(layer: object, tokens: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """Where a cache layer lets the one-call decoder layer write ``tokens`` entries itself:
    its key and value buffers ``[1, heads, slots, dim]`` and the first slot, or ``None`` (a
    cache layer that must be updated through ``update``). A single sequence's cache
    (:class:`~specdec.cache.buffer.BufferLayer`) and a batch's cache during a pass of one row
    (:class:`~specdec.batch.cache.SlotLayer`) answer ``room``; other layers have none."""
    room = getattr(layer, "room", None)
    return None if room is None else room(tokens)


class LeanDecoderLayer:
    """The decoder-layer forward for one sequence's pass (a prefill, a verification, a decoding
    step): HF's order of operations (norm, attention, residual, norm, MLP, residual) as direct
    calls, without the six module calls and the reshaping around each. A batch of several
    sequences takes HF's own forward over the lean modules.

    Mixed into the model's own decoder-layer class (see :func:`use_lean_layers`), so the layer
    is still an instance of it: transformers finds the layers whose outputs it records as
    hidden states (EAGLE, Medusa read them) by that class."""

    self_attn: KQuantAttention
    mlp: KQuantMLP
    input_layernorm: KQuantRMSNorm
    post_attention_layernorm: KQuantRMSNorm

    def forward(
        self,
        hidden_states: torch.Tensor,  # [B, T, hidden]
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: object | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        b, t, hidden = hidden_states.shape
        if cache is None:  # the name transformers is deprecating, still accepted by HF's layer
            cache = kwargs.pop("past_key_values", None)
        if t == 0:  # a pass of no new tokens (transformers' universal assisted generation)
            return hidden_states
        lean = b == 1 and self.self_attn.owns_attention
        if not lean or position_embeddings is None:
            return super().forward(  # type: ignore[misc]
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        ext = kquant.extension()
        parts = self.__dict__.get("_lean_parts")
        if parts is None:
            parts = self._bind_lean_parts()
        attn, w1, eps1, o_mm, mlp_rows, w2, eps2, fused = parts
        x = hidden_states.view(t, hidden)
        layers = getattr(cache, "layers", None)
        layer = layers[attn.layer_idx] if layers is not None else None
        slot = in_place(layer, t)
        if slot is not None and layer is not None:  # the layer in one call, writing the cache
            kb, vb, n = slot
            cos, sin = position_embeddings
            allowed = allowed_keys(attention_mask)
            x = ext.lean_layer(fused, x, cos[0], sin[0], kb[0], vb[0], n, allowed)
            layer.extend_to(n + t)
            return x.view(1, t, hidden)
        q, k, v = attn.project(
            ext.rms_norm(x, w1, eps1), position_embeddings[0][0], position_embeddings[1][0]
        )
        x = x + o_mm(attn.attend(q, k, v, attention_mask, cache))
        x = x + mlp_rows(ext.rms_norm(x, w2, eps2))
        return x.view(1, t, hidden)

    def _bind_lean_parts(self) -> tuple[Any, ...]:
        """What :meth:`forward` calls, bound once and kept as a plain attribute: reaching
        submodules and parameters through ``nn.Module.__getattr__`` costs a few hundred lookups
        a decoding step on a small model."""
        attn, n1, n2 = self.self_attn, self.input_layernorm, self.post_attention_layernorm
        ext = kquant.extension()
        fused = ext.LeanLayer(
            n1.weight,
            n1.variance_epsilon,
            n2.weight,
            n2.variance_epsilon,
            [_lin(ext, g.linear) for g in attn._qkv],
            [g.widths for g in attn._qkv],
            attn.head_dim,
            attn.scaling,
            _lin(ext, attn.o_proj),
            [_lin(ext, g.linear) for g in self.mlp._gate_up],
            [g.widths for g in self.mlp._gate_up],
            _lin(ext, self.mlp.down_proj),
        )
        parts = (
            attn,
            n1.weight,
            n1.variance_epsilon,
            attn.o_proj.mm,
            self.mlp.rows,
            n2.weight,
            n2.variance_epsilon,
            fused,
        )
        object.__setattr__(self, "_lean_parts", parts)
        return parts


def _lin(ext: Any, linear: KQuantLinear) -> Any:
    """``linear`` as the extension's ``Lin`` (the same tensors, not copies)."""
    bias = linear.bias if linear.bias is not None else torch.empty(0)
    return ext.Lin(linear.codes, linear.meta, linear.d, linear.dmin, bias, linear.kind_id)


_LEAN_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _lean_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The lean subclass of a decoder-layer class, made once per class (every layer of a model,
    and of the next model loaded, shares it)."""
    lean = _LEAN_CLASSES.get(cls)
    if lean is None:
        lean = type(f"KQuant{cls.__name__}", (LeanDecoderLayer, cls), {"__module__": __name__})
        _LEAN_CLASSES[cls] = lean
    return lean


def _leanable(layer: nn.Module, config: object) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    projections += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
    return (
        all(isinstance(p, KQuantLinear) for p in projections)
        and all(hasattr(n, "variance_epsilon") and hasattr(n, "weight") for n in norms)
        and all(hasattr(attn, a) for a in ("layer_idx", "head_dim", "scaling", "config"))
        and getattr(config, "hidden_act", None) == "silu"
    )


def use_lean_layers(model: nn.Module) -> int:
    """Swap in the lean modules on a kquant Qwen2/Llama model (after its linears became
    :class:`KQuantLinear`); returns how many decoder layers changed (0: another family, or a
    layer of a shape these modules do not know, which keeps HF's modules)."""
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if (
        getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES
        or inner is None
        or layers is None
    ):
        return 0
    if not all(_leanable(layer, config) for layer in layers):
        return 0
    for layer in layers:
        # the same object, now of a subclass of its own class whose forward is the lean one
        layer.__class__ = _lean_class(type(layer))
        layer.self_attn = KQuantAttention(layer.self_attn)
        layer.mlp = KQuantMLP(layer.mlp)
        layer.input_layernorm = KQuantRMSNorm(layer.input_layernorm)
        layer.post_attention_layernorm = KQuantRMSNorm(layer.post_attention_layernorm)
    if hasattr(inner.norm, "variance_epsilon"):
        inner.norm = KQuantRMSNorm(inner.norm)
    return len(layers)
