"""Low-bit weight numerics on the CPU: ``nn.Linear`` swaps onto torch's own quantised kernels.

Three kernels, three trade-offs (their figures: ``docs/lowbit.md``):

- ``int4`` / ``int4-g128``: 4-bit weights, asymmetric, one bf16 scale and zero per group of 32
  (128) input weights, bf16 activations (``aten._weight_int4pack_mm_for_cpu``). The fewest bytes
  per token, but its cost grows with the row count, so verifying a draft costs nearly as many
  decode steps as it verifies.
- ``int8``: 8-bit weights, symmetric, one bf16 scale per output channel, bf16 activations
  (``aten._weight_int8pack_mm``); the same small-row growth as ``int4``.
- ``int8-dynamic``: 8-bit weights per output channel *and* 8-bit activations quantised per row
  (per token) on the fly, multiplied by oneDNN's u8s8 GEMM (AMX or VNNI where the CPU has them,
  ``onednn.qlinear_pointwise``). Near-flat T(k) where the CPU has AMX or VNNI: this is the
  path that keeps small-row cost flat, as the integer GEMM does the arithmetic of k rows in
  about the time of reading the weight once.

Why speculation stays lossless (greedy output token for token that of plain decoding under the
same numerics): every kernel here computes each output row from that row alone, in the same
order, whatever the number of rows in the call. Measured bit for bit (``tests/test_lowbit.py``):
``int8-dynamic`` accumulates in integers, which is exact and so independent of blocking, and its
per-row activation scale depends on that row only (a per-tensor scale would let a rejected draft
token change the logits of the accepted ones); the ``int4``/``int8`` kernels loop over the input
dimension the same way for every row. The rest of the model (attention, norms) runs in fp32,
with the same tolerance to row count as the default fp32 path. The target verifies every draft
with these same kernels, so nothing about the draft changes the output.

A layer whose shape a kernel cannot take is refused before anything is swapped (no model is
left half quantised, and none silently runs partly in fp32): ``int4`` needs in_features
divisible by the group size and out_features by 16; ``int8`` needs in_features divisible by 16
(torch's kernel crashes otherwise); ``int8-dynamic`` takes any shape. These are CPU kernels:
on CUDA they are refused (:func:`specdec.target.numerics.check_numerics_device`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from specdec.errors import ConfigError
from specdec.target.gguf_blocks import q4k_fields

INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu packs 16 output channels together
INT8_K_MULTIPLE = 16  # _weight_int8pack_mm reads 16 inputs at a time (and crashes on a rest)
# Passes of more rows than this (a prompt's prefill, a draft's first catch-up) dequantise the
# weight once and run one dense matmul: the int4/int8 kernels pay for every row, so a long
# prompt through them is far slower than one dense matmul (docs/lowbit.md). Plain and
# speculative decoding prefill the same prompt the same way, and verification passes (at most
# 64 rows) never take this path, so it cannot make their outputs differ.
DENSE_ROWS = 64


@functools.cache
def dense_dtype() -> torch.dtype:
    """The dtype of the dense path: bf16 where oneDNN multiplies bf16 natively (AVX-512, AMX),
    fp32 elsewhere. Without native bf16 (AVX2 only) oneDNN emulates a bf16 matmul, many times
    slower than fp32, which made an int4 draft's prompt catch-up cost more than the fp32
    target's own prefill (docs/lowbit.md)."""
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        native = False
    return torch.bfloat16 if native else torch.float32


def _bias(linear: nn.Linear) -> torch.Tensor | None:
    # a copy: a view would keep the memory-mapped checkpoint resident (see numerics._page_out)
    return None if linear.bias is None else linear.bias.detach().float().clone()


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``[N, K]`` two to a byte, low nibble first: ``[N, K/2]`` uint8."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def quantize_int4(
    weight: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes per group of ``group`` input weights, as the int4pack kernel
    reads them: ``w ~= (q - 8) * scale + zero`` with ``q`` in 0..15 and scale, zero in bf16.
    Codes are chosen against the bf16-rounded scale and zero, so the only rounding is the
    code's. Returns ``q [N, K] int32``, ``scale [N, K/G]``, ``zero [N, K/G]`` (bf16).

    >>> q, s, z = quantize_int4(torch.tensor([[-1.0, 2.0, 8.0, 14.0]]), 4)
    >>> q.tolist(), s.item(), z.item()  # a range of 15 gives scale 1; code 8 stands for 7.0
    ([[0, 3, 9, 15]], 1.0, 7.0)
    """
    n, k = weight.shape
    wg = weight.float().reshape(n, k // group, group)  # [N, K/G, G]
    lo = wg.amin(-1)
    hi = wg.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-10).to(torch.bfloat16)  # [N, K/G]
    zero = (lo + 8 * scale.float()).to(torch.bfloat16)  # the value code 8 stands for
    q = torch.round((wg - zero.float()[..., None]) / scale.float()[..., None]) + 8
    return q.clamp_(0, 15).to(torch.int32).reshape(n, k), scale, zero


def q4k_to_int4(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF Q4_K tensor's own codes in the int4pack group layout, without re-quantising.

    Q4_K stores 256-weight super-blocks of eight 32-weight sub-blocks, each an affine map of
    4-bit codes: ``w = d * sc * q - dmin * m`` (``d``, ``dmin`` fp16 per super-block, ``sc``,
    ``m`` 6-bit per sub-block). That is the int4 kernel's ``w = (q - 8) * scale + zero`` with
    group 32, ``scale = d * sc`` and ``zero = 8 * d * sc - dmin * m``: the same codes, and in
    fp32 the same weights (``d * sc`` needs 17 significant bits, fp32 has 24). The kernel's fast
    path reads scales and zeros in bf16 (8 bits; its fp32 path is a far slower reference), so
    there they are rounded: a relative error up to 2^-9 of each group's scale, not a second
    rounding of the codes. ``blocks``: the tensor's bytes as ``[N, K / 256 * 144]`` uint8.
    Returns ``q [N, K] int32``, ``scale [N, K/32]``, ``zero [N, K/32]`` (fp32).
    """
    n = blocks.shape[0]
    d16, dmin16, sc, m, codes = q4k_fields(blocks)
    d, dmin = d16.astype(np.float32)[:, None], dmin16.astype(np.float32)[:, None]
    scale = d * sc.astype(np.float32)  # [B, 8]
    zero = 8 * scale - dmin * m.astype(np.float32)
    q = torch.from_numpy(codes.reshape(n, -1).astype(np.int32))  # [N, K]
    return q, torch.from_numpy(scale.reshape(n, -1)), torch.from_numpy(zero.reshape(n, -1))


class Int4WeightLinear(nn.Module):
    """4-bit weights, group-wise bf16 scale and zero, bf16 activations; output back in fp32."""

    def __init__(self, linear: nn.Linear, group: int = 32) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.group = group
        q, scale, zero = quantize_int4(linear.weight.detach(), group)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)  # [N, K/2] u8
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()], -1).contiguous()  # [K/G, N, 2]
        self.nibbles = _nibbles(q)  # the same codes, plainly packed, for the dense path
        self.bias = _bias(linear)

    @classmethod
    def from_codes(
        cls,
        linear: nn.Linear,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        group: int,
    ) -> Int4WeightLinear:
        """A layer from given codes (``q [N, K]`` in 0..15) and per-group ``scale``/``zero``
        (``[N, K/G]``, rounded to bf16 here), e.g. a GGUF file's own Q4_K codes."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group = group
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        sz = torch.stack([scale.to(torch.bfloat16).t(), zero.to(torch.bfloat16).t()], -1)
        self.scales_and_zeros = sz.contiguous()
        self.nibbles = _nibbles(q.to(torch.int32))
        self.bias = _bias(linear)
        return self

    def dense(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The weight the kernel multiplies by, ``[N, K]`` in ``dtype`` (for long passes)."""
        n, k, g = self.out_features, self.in_features, self.group
        lo, hi = self.nibbles & 15, self.nibbles >> 4  # [N, K/2] each
        q = torch.stack([lo, hi], -1).view(n, k // g, g).float()
        s, z = self.scales_and_zeros.float().unbind(-1)  # [K/G, N] each
        s = s.t().contiguous().unsqueeze(-1)  # [N, K/G, 1]
        # (q - 8) s + z as one fused pass, q s + (z - 8 s): a long pass dequantises every linear
        # once, which took several times longer as four separate full-size passes
        return torch.addcmul(z.t().contiguous().unsqueeze(-1) - 8 * s, q, s).view(n, k).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _bf16_rows(
            x,
            self.out_features,
            self.bias,
            lambda x2: torch.nn.functional.linear(x2, self.dense(x2.dtype)),
            lambda x2: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, self.packed, self.group, self.scales_and_zeros
            ),
        )

    def weight_bytes(self) -> int:
        """What a decoding step reads (the nibble copy serves long prefill passes only)."""
        return _nbytes(self.packed, self.scales_and_zeros, self.bias)


def _bf16_rows(
    x: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    dense: Callable[[torch.Tensor], torch.Tensor],
    kernel: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """A weight-only linear: the low-bit ``kernel`` on bf16 rows for up to ``DENSE_ROWS`` rows
    (decoding, verification), one ``dense`` matmul in :func:`dense_dtype` above (long prefill
    passes)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.shape[0] > DENSE_ROWS:
        y = dense(x2.to(dense_dtype())).float()
    else:
        y = kernel(x2.to(torch.bfloat16)).float()
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], out_features)


class Int8WeightLinear(nn.Module):
    """8-bit weights, symmetric, one bf16 scale per output channel; bf16 activations."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = linear.weight.detach().float()  # [N, K]
        scale = (w.abs().amax(1) / 127).clamp_min(1e-10).to(torch.bfloat16)  # [N]
        self.qweight = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        self.scale = scale
        self.bias = _bias(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _bf16_rows(
            x,
            self.out_features,
            self.bias,
            lambda x2: torch.nn.functional.linear(x2, self.dense(x2.dtype)),
            lambda x2: torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale),
        )

    def dense(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The weight the kernel multiplies by, ``[N, K]`` in ``dtype`` (for long passes)."""
        return self.qweight.to(dtype) * self.scale.to(dtype)[:, None]

    def weight_bytes(self) -> int:
        return _nbytes(self.qweight, self.scale, self.bias)


def _has_vnni() -> bool:
    """Whether the CPU multiplies u8 x s8 into int32 directly (AVX512-VNNI / AVX-VNNI / AMX)."""
    probe = getattr(torch.cpu, "_is_vnni_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


class DynamicInt8Linear(nn.Module):
    """8-bit weights per output channel, activations quantised to 8 bits per row on the fly,
    integer GEMM through oneDNN (u8s8, AMX/VNNI), rescaled to fp32.

    Row ``i`` of the output depends on row ``i`` of the input alone, bit for bit: its
    activation scale is its own absolute maximum / 127 and the GEMM accumulates exactly in
    int32. So one row and the same row among k others give identical results, which keeps
    greedy speculation token-identical to plain decoding under these numerics.

    Without VNNI (AVX2 only) oneDNN multiplies u8 x s8 pairs into a saturating int16
    (``vpmaddubsw``): 255 x 127 x 2 overflows it, and a full-range row came out far off
    (docs/lowbit.md). There activations use 7 bits (scale max / 63, codes 1..127), which cannot
    saturate; PyTorch's own x86 quantisation reduces the range for the same reason."""

    levels: int = 127  # activation code magnitude; set per CPU in __init__

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = linear.weight.detach().float()  # [N, K]
        self.scale = (w.abs().amax(1) / 127).clamp_min(1e-10)  # [N] fp32
        qweight = torch.round(w / self.scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.packed = torch.ops.onednn.qlinear_prepack(qweight, None)
        self.zero_points = torch.zeros(self.out_features, dtype=torch.int64)
        self.bias = _bias(linear)
        self.levels = 127 if _has_vnni() else 63

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()  # [T, K]
        levels = self.levels
        row_scale = x2.abs().amax(-1, keepdim=True).clamp_min_(1e-30).div_(levels)  # [T, 1]
        # |x / row_scale| <= levels by construction; + levels + 1 makes the unsigned code
        xq = torch.round(x2 / row_scale).add_(levels + 1).to(torch.uint8)
        y = torch.ops.onednn.qlinear_pointwise(
            xq,
            1.0,
            levels + 1,
            self.packed,
            self.scale,
            self.zero_points,
            None,
            1.0,
            0,
            torch.float32,
            "none",
            [],
            "",
        )  # [T, N]: exact integer dot products times the weight scales
        y = y.mul_(row_scale)
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        return self.out_features * self.in_features + _nbytes(self.scale, self.bias)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _nothing(*args: object) -> None:
    return None


@dataclass(frozen=True)
class LowBitScheme:
    """One ``--dtype`` choice: how to build a swapped linear, which shapes it takes, what must
    be installed for it, and what the model needs once its linears are swapped."""

    name: str
    description: str
    make: Callable[[nn.Linear], nn.Module]
    k_multiple: int = 1  # in_features must be a multiple of this
    n_multiple: int = 1  # out_features must be a multiple of this
    hint: str = ""  # what to use instead when a shape is refused
    kernels: str = "torch's CPU quantised-linear kernels"  # named when refused off the CPU
    requires: Callable[[], None] = _nothing  # a clear error where the kernels are missing
    after_swap: Callable[[nn.Module], None] = _nothing  # beyond row-wise attention

    def shape_error(self, where: str, linear: nn.Linear) -> str | None:
        n, k = linear.out_features, linear.in_features
        if k % self.k_multiple or n % self.n_multiple:
            return (
                f"dtype {self.name!r} cannot quantise {where} ([out={n}, in={k}]): it needs "
                f"in_features divisible by {self.k_multiple} and out_features by "
                f"{self.n_multiple}; nothing was quantised. {self.hint}"
            )
        return None


# onnxruntime is an optional extra: its module is imported only when int4-ort is asked for
def _ort_linear(linear: nn.Linear) -> nn.Module:
    from specdec.target.ort_int4 import OrtInt4Linear

    return OrtInt4Linear(linear)


def _require_ort() -> None:
    from specdec.target.ort_int4 import require_ort

    require_ort()


def _ort_threads(model: nn.Module) -> None:
    from specdec.target.ort_int4 import torch_single_threaded

    torch_single_threaded(model)


def _kquant_linear(linear: nn.Linear) -> nn.Module:
    from specdec.target.kquant import KQuantLinear

    return KQuantLinear.from_attached(linear)


def _kquant_lean_layers(model: nn.Module) -> None:
    from specdec.target.kquant import use_quantised_embedding
    from specdec.target.kquant_layers import use_lean_layers

    use_quantised_embedding(model)
    use_lean_layers(model)


def _require_kquant() -> None:
    import warnings

    from specdec.target.kquant import extension

    if not extension().has_simd():
        warnings.warn(
            "dtype 'kquant': this CPU lacks AVX2, so the kernel runs its portable loop (correct, "
            "but many times slower); --dtype gguf runs the file through llama.cpp",
            stacklevel=2,
        )


SCHEMES: dict[str, LowBitScheme] = {
    s.name: s
    for s in (
        LowBitScheme(
            "int8-dynamic",
            "int8 weights per channel + int8 activations per token, oneDNN integer GEMM",
            DynamicInt8Linear,
        ),
        LowBitScheme(
            "int8",
            "int8 weight-only, per-channel scales, bf16 activations (int8pack)",
            Int8WeightLinear,
            k_multiple=INT8_K_MULTIPLE,
            hint="Use int8-dynamic, which takes any shape.",
        ),
        LowBitScheme(
            "int4",
            "int4 weight-only, group 32, bf16 scales/zeros and activations (int4pack)",
            lambda linear: Int4WeightLinear(linear, 32),
            k_multiple=32,
            n_multiple=INT4_N_MULTIPLE,
            hint="Use int8 or int8-dynamic.",
        ),
        LowBitScheme(
            "int4-g128",
            "int4 weight-only, group 128, bf16 scales/zeros and activations (int4pack)",
            lambda linear: Int4WeightLinear(linear, 128),
            k_multiple=128,
            n_multiple=INT4_N_MULTIPLE,
            hint="Use int4 (group 32), int8 or int8-dynamic.",
        ),
        LowBitScheme(
            "int4-ort",
            "int4 weights, group 32, int8 activation blocks (onnxruntime MLAS MatMulNBits)",
            _ort_linear,
            k_multiple=32,
            hint="Use int8 or int8-dynamic.",
            kernels="onnxruntime's CPU int4 kernels (MLAS)",
            requires=_require_ort,
            after_swap=_ort_threads,
        ),
        LowBitScheme(
            "kquant",
            "the GGUF file's own quantised blocks, int8 activations, specdec's kernel; output "
            "lossless with respect to these numerics",
            _kquant_linear,
            k_multiple=32,
            hint="Use int8-dynamic, which takes any shape.",
            kernels="specdec's quantised-block CPU kernel (compiled on first use)",
            requires=_require_kquant,
            after_swap=_kquant_lean_layers,
        ),
    )
}


def check_shapes(model: nn.Module, name: str) -> None:
    """Refuse, before anything is swapped, a model with a linear the scheme cannot take."""
    scheme = SCHEMES[name]
    for where, module in model.named_modules():
        if isinstance(module, nn.Linear):
            error = scheme.shape_error(where, module)
            if error:
                raise ConfigError(error)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every linear layer's weights (packed, with scales and biases) in ``model``:
    what one decoding step reads besides one embedding row. A swapped linear reports its own
    (its ``weight_bytes()``), so this layer needs no list of the modules that swap them in."""
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            total += _nbytes(module.weight, module.bias)
            continue
        sized = getattr(module, "weight_bytes", None)
        if callable(sized):
            total += int(sized())
    return total
