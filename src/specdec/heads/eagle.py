"""EAGLE drafters (Li et al.: EAGLE arXiv 2401.15077, EAGLE-2 2406.16858, EAGLE-3 2503.01840).

One decoder layer of the target's own architecture family (Llama-style: RMSNorm, rotary
attention with grouped KV heads, SwiGLU MLP) that autoregresses at the *feature* level, so the
target's verification pass hands it what it needs and drafting never runs the target:

* EAGLE-1/2: the input at position t is ``fc([embed(x_{t+1}); f_t])`` where ``f_t`` is the
  target's final (normed) hidden state at t, or the drafter's own prediction of it further down
  the tree; the layer predicts ``f_{t+1}``, which the target's LM head reads out.
* EAGLE-3: the target's low, middle and high layer outputs at t are fused, ``g_t = fc([l; m;
  h])``; the layer reads ``[norm(embed(x_{t+1})); norm(g_t)]`` (twice the hidden size) with
  ``g_t`` as the residual, and predicts tokens directly through its own norm and LM head, over a
  reduced draft vocabulary: ``target_id = draft_id + d2t[draft_id]``, ``t2d`` marks the target
  ids the draft vocabulary contains. Deeper in the tree ``g`` is the layer's previous output.

Parameter names follow the ``speculators`` checkpoint format that vLLM loads (``fc``,
``layers.0.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), so exporting is a rename-free save.

Hidden-state indices (``aux_layers``) count as Hugging Face's ``hidden_states`` do: 0 is the
embedding output, i the output of decoder layer i-1. That equals vLLM's
``eagle_aux_hidden_state_layer_ids`` (collected before layer i runs), default
``(2, L // 2, L - 3)``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, PretrainedConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from specdec.errors import CheckpointError, ConfigError

VARIANTS = ("eagle1", "eagle3")
_LAYER_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "rope_parameters",
    "vocab_size",
)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's and EAGLE-3's default low/middle/high feature layers.

    >>> default_aux_layers(30)
    (2, 15, 27)
    """
    return (2, num_layers // 2, num_layers - 3)


def layer_config_from(target_config: PretrainedConfig) -> dict[str, Any]:
    """The drafter layer's shape: the target's own (one Llama-style layer of its size)."""
    cfg = target_config.to_dict()
    out = {k: cfg[k] for k in _LAYER_KEYS if k in cfg}
    if "head_dim" not in out or out["head_dim"] is None:
        out["head_dim"] = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    if "rope_parameters" not in out:
        out["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": float(cfg.get("rope_theta", 10000.0)),
        }
    out.setdefault("attention_bias", False)
    out.setdefault("mlp_bias", False)
    out["num_hidden_layers"] = 1
    return out


@dataclass(frozen=True)
class EagleConfig:
    variant: str  # eagle1 | eagle3
    layer: dict[str, Any]  # the decoder layer's Llama config (``transformer_layer_config``)
    vocab_size: int  # the target's
    target_hidden_size: int
    aux_layers: tuple[int, ...] = (-1,)  # target hidden_states indices the drafter reads
    draft_vocab_size: int | None = None  # eagle3 only; None = the full vocabulary
    target: dict[str, Any] = field(default_factory=dict)  # the target's recorded identity
    speculative_tokens: int = 5  # default tree depth (and the exported proposal's length)
    fc_bias: bool = False

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ConfigError(f"unknown EAGLE variant {self.variant!r}; use one of {VARIANTS}")
        object.__setattr__(self, "aux_layers", tuple(int(i) for i in self.aux_layers))
        if self.variant == "eagle3" and len(self.aux_layers) < 1:
            raise CheckpointError("an EAGLE-3 drafter needs at least one auxiliary layer")
        if self.variant == "eagle1" and self.aux_layers != (-1,):
            raise CheckpointError("an EAGLE-1 drafter reads the target's final hidden state only")
        if self.draft_vocab_size is not None:
            if self.variant != "eagle3":
                raise CheckpointError("a reduced draft vocabulary needs the eagle3 variant")
            if not 1 <= self.draft_vocab_size <= self.vocab_size:
                raise CheckpointError(
                    f"draft_vocab_size {self.draft_vocab_size} is outside 1..{self.vocab_size}"
                )
        if self.speculative_tokens < 1:
            raise ConfigError(f"speculative_tokens must be >= 1, got {self.speculative_tokens}")

    @property
    def hidden_size(self) -> int:
        return int(self.layer["hidden_size"])

    @property
    def out_size(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(**self.layer)


class EagleAttention(nn.Module):
    """Rotary grouped-query attention whose keys include the caller's cached prefix, under an
    explicit boolean mask: the same code scores a causal prefix, a token tree, and the
    training-time-test unroll."""

    def __init__(self, cfg: LlamaConfig, in_size: int) -> None:
        super().__init__()
        self.num_heads = int(cfg.num_attention_heads)
        kv_heads, head_dim = cfg.num_key_value_heads, cfg.head_dim
        assert kv_heads is not None and head_dim is not None  # LlamaConfig fills both in
        self.num_kv = int(kv_heads)
        self.head_dim = int(head_dim)
        bias = bool(cfg.attention_bias)
        self.q_proj = nn.Linear(in_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_size, self.num_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_size, self.num_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, int(cfg.hidden_size), bias=bias)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, in]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each [B, T, D]
        past: tuple[torch.Tensor, torch.Tensor] | None,  # each [B, KV, S, D]
        mask: torch.Tensor,  # [B or 1, T, S + T] bool, True = may attend
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv, self.head_dim).transpose(1, 2)
        cos, sin = cos_sin
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        new = (k, v)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        rep = self.num_heads // self.num_kv
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])  # [B, H, T, D]
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_proj(out), new


class EagleLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, eagle3: bool) -> None:
        super().__init__()
        h = int(cfg.hidden_size)
        self.eagle3 = eagle3
        self.self_attn = EagleAttention(cfg, 2 * h if eagle3 else h)
        self.mlp = LlamaMLP(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        if eagle3:
            # EAGLE-3 normalises the embedding and the fused feature separately, then joins them
            self.input_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
            self.hidden_norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H or 2H]
        residual: torch.Tensor,  # [B, T, H]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        past: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        attn, new = self.self_attn(x, cos_sin, past, mask)
        h = residual + attn
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, new


class EagleHead(nn.Module):
    """The drafter. ``embed_tokens`` (and, for EAGLE-1, ``lm_head``) are the target's own
    tensors, shared rather than trained or copied into checkpoints."""

    embed_weight: torch.Tensor  # buffers, typed (nn.Module's attribute lookup is not)
    readout: torch.Tensor  # EAGLE-1 only

    def __init__(
        self,
        config: EagleConfig,
        embed_tokens: torch.Tensor,  # [V, H] the target's input embeddings
        target_lm_head: torch.Tensor | None = None,  # [V, H], EAGLE-1 reads out with it
    ) -> None:
        super().__init__()
        self.config = config
        lc = config.llama_config()
        h = config.hidden_size
        eagle3 = config.variant == "eagle3"
        if embed_tokens.shape != (config.vocab_size, h):
            raise CheckpointError(
                f"the target's embeddings are {tuple(embed_tokens.shape)}, this drafter expects "
                f"({config.vocab_size}, {h}): it was built for another model"
            )
        # frozen, not a parameter: never trained, never saved with the drafter
        self.register_buffer("embed_weight", _plain(embed_tokens), persistent=False)
        fc_in = len(config.aux_layers) * config.target_hidden_size if eagle3 else 2 * h
        self.fc = nn.Linear(fc_in, h, bias=config.fc_bias)
        self.layers = nn.ModuleList([EagleLayer(lc, eagle3)])
        self.rotary = LlamaRotaryEmbedding(lc)
        if eagle3:
            self.norm = LlamaRMSNorm(h, eps=lc.rms_norm_eps)
            self.lm_head = nn.Linear(h, config.out_size, bias=False)
            if config.draft_vocab_size is not None:
                self.register_buffer("d2t", torch.zeros(config.out_size, dtype=torch.long))
                self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
            else:
                self.d2t = None
        else:
            if target_lm_head is None:
                raise CheckpointError("an EAGLE-1 drafter reads out with the target's LM head")
            self.register_buffer("readout", _plain(target_lm_head), persistent=False)
            self.d2t = None
        # inference only: the target's own (prepacked) LM head module, shared instead of a
        # second copy of its 49k x H matrix; kept out of the module tree (never saved)
        self._readout_module: tuple[nn.Module, ...] = ()

    @property
    def eagle3(self) -> bool:
        return self.config.variant == "eagle3"

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The state the layer continues from at target positions: EAGLE-3 fuses the auxiliary
        layers here; EAGLE-1 fuses inside :meth:`forward`, with the token."""
        return self.fc(features) if self.eagle3 else features

    def forward(
        self,
        state: torch.Tensor,  # [B, T, H]: fused target feature, or the drafter's own output
        tokens: torch.Tensor,  # [B, T] the token that follows each state's position
        positions: torch.Tensor,  # [B, T]
        past: tuple[torch.Tensor, torch.Tensor] | None = None,  # [B, KV, S, D] each
        mask: torch.Tensor | None = None,  # [B or 1, T, S + T]; None = causal
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The next state at every position, and its new keys/values.  # [B, T, H]"""
        emb = F.embedding(tokens, self.embed_weight)  # [B, T, H]
        layer = self.layers[0]
        assert isinstance(layer, EagleLayer)
        if self.eagle3:
            x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(state)], dim=-1)
            residual = state
        else:
            x = self.fc(torch.cat([emb, state], dim=-1))
            residual = x
        if mask is None:
            mask = causal_prefix_mask(
                tokens.shape[1], 0 if past is None else past[0].shape[2], tokens.device
            )
        cos_sin = self.rotary(x, positions)
        return layer(x, residual, cos_sin, past, mask)

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """Scores over the draft vocabulary.  # [..., V_draft]"""
        if self.eagle3:
            return self.lm_head(self.norm(state))
        if self._readout_module:
            return self._readout_module[0](state)
        return state @ self.readout.T

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def set_vocabulary(self, target_ids: torch.Tensor) -> None:
        """Install a reduced draft vocabulary: ``target_ids[i]`` is draft id i's target id."""
        if self.d2t is None:
            raise ConfigError("this drafter has no reduced draft vocabulary")
        ids = target_ids.to(torch.long)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_token_ids(self) -> torch.Tensor:
        """Target ids of the draft vocabulary, in draft order.  # [V_draft]"""
        return self.to_target_ids(torch.arange(self.config.out_size, device=self.fc.weight.device))

    def init_from_target(self, final_norm: torch.Tensor | None, lm_head: torch.Tensor) -> None:
        """Start EAGLE-3's readout at the target's own norm and LM head rows: the first step
        then begins near the target's next-token prediction instead of at random."""
        if not self.eagle3:
            return
        w = lm_head.detach().float()
        if self.d2t is not None:
            w = w[self.draft_token_ids()]
        self.lm_head.weight.data.copy_(w)
        if final_norm is not None:
            self.norm.weight.data.copy_(final_norm.detach().float())


def for_inference(head: EagleHead) -> EagleHead:
    """A drafting copy of ``head`` on the target's device. On the CPU its linears run int8
    weights (Q8_0 blocks) through specdec's quantised-block kernel where it is built, else keep
    fp16-stored weights (fp32 maths): drafting is memory-bound on a CPU, and each halving of the
    bytes read made the linears faster (fp16 against fp32:
    experiments/eagle/2026-12-05-eagle3-first-turns.md; Q8_0 against fp16:
    experiments/eagle/2026-12-07-qwen15-eagle-data.md). A draft needs no exactness: the target
    verifies it. EAGLE-1's
    readout, the target's LM head, gets such a copy too. The embeddings are shared, not copied,
    and ``head`` itself is left as it is (it can still be trained or saved)."""
    from specdec.target.numerics import swap_linears

    memo: dict[int, object] = {id(head.embed_weight): head.embed_weight}
    if not head.eagle3:
        memo[id(head.readout)] = head.readout
    fast = copy.deepcopy(head, memo).eval()
    for p in fast.parameters():
        p.requires_grad_(False)
    embed = head.embed_weight
    assert isinstance(embed, torch.Tensor)
    device = embed.device  # the target's device: the drafter runs beside it
    if device.type != "cpu":
        # fbgemm and oneDNN are CPU kernels; elsewhere the fp32 drafter runs with stock linears
        return fast.to(device)
    make = cpu_linear_maker()
    swap_linears(fast, make)
    if not fast.eagle3:
        readout = nn.Linear(fast.readout.shape[1], fast.readout.shape[0], bias=False)
        readout.weight.data = fast.readout
        fast._readout_module = (make(readout),)
    return fast


def cpu_linear_maker() -> Callable[[nn.Linear], nn.Module]:
    """How a drafter's linears are rebuilt on this CPU, fastest first: Q8_0 weights through the
    quantised-block kernel (needs the compiled kernel with AVX2 or AVX-512, and whole 32-weight
    blocks), fp16 weights through fbgemm, fp32 prepacked by oneDNN."""
    from specdec.target.numerics import Fp16WeightLinear, PackedLinear

    fallback: Callable[[nn.Linear], nn.Module] = Fp16WeightLinear
    try:
        Fp16WeightLinear(nn.Linear(2, 2))
    except RuntimeError:  # no fbgemm in this torch build: prepacked fp32 instead
        fallback = PackedLinear
    try:
        from specdec.target import kquant

        if not kquant.extension().has_simd():
            return fallback
    except ConfigError:  # no compiler here: the kernel cannot be built
        return fallback

    def make(linear: nn.Linear) -> nn.Module:
        if linear.in_features % 32:
            return fallback(linear)
        return kquant.KQuantLinear.q8_from_float(linear)

    return make


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A float32 view of a target tensor, usable by autograd: weights loaded under
    ``torch.inference_mode`` cannot take part in a training graph, so those (only) are copied."""
    w = t.detach().float()
    return w.clone() if w.is_inference() else w


def extend_kv(
    past: tuple[torch.Tensor, torch.Tensor] | None, new: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values of ``past`` followed by ``new`` along the sequence axis."""
    if past is None:
        return new
    return torch.cat([past[0], new[0]], 2), torch.cat([past[1], new[1]], 2)


def causal_prefix_mask(
    num_new: int, num_past: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """New positions see every cached one and the new ones before them.  # [1, T, S + T]

    >>> causal_prefix_mask(2, 1).int().tolist()
    [[[1, 1, 0], [1, 1, 1]]]
    """
    ones = torch.ones(num_new, num_past + num_new, dtype=torch.bool, device=device)
    return ones.tril(num_past)[None]
