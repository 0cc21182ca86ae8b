"""Numerics choices per device; on the CPU, applied by swapping ``nn.Linear`` modules.

On CPU the cost of verifying k drafted tokens, T(k), decides what speculation is worth. Stock fp32
``nn.Linear`` (MKL) is about twice as slow for a handful of rows as for one, so a verification
pass costs about two decode steps. oneDNN with weights prepacked once keeps T(8)/T(1) near 1.4
with identical maths (fp32 in, fp32 out), which is why it is the default. The other choices trade
exactness against the float32 model for speed and are opt-in; speculation stays lossless with
respect to whichever numerics the target runs, because drafts are always verified by that target.

Swapping modules keeps the model's code untouched: the forward still calls ``self.q_proj(x)``.

On CUDA the swaps (CPU kernels) never happen: ``float32`` there is stock cuBLAS at full fp32
precision, the fastest exact choice; ``bfloat16`` is the fast inexact one (see
:func:`apply_numerics`).
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from specdec.errors import ConfigError
from specdec.target import lowbit
from specdec.target.attention import use_rowwise_attention


class PackedLinear(nn.Module):
    """fp32 linear through oneDNN with the weight reordered once for small row counts."""

    def __init__(self, linear: nn.Linear, rows_hint: int = 8) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = linear.weight.detach().float().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, rows_hint)
        # a copy: a view would keep the whole memory-mapped checkpoint resident (see below)
        self.bias = None if linear.bias is None else linear.bias.detach().float().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, shape[-1]), self.packed, self.bias, "none", [], ""
        )
        return y.reshape(*shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        """The prepacked fp32 weight (the bias is not counted, as for the other layouts here)."""
        return self.out_features * self.in_features * 4


class Fp16WeightLinear(nn.Module):
    """Weights stored in fp16, maths in fp32 (fbgemm): faster, logits close to fp32's (how
    close: experiments/verification-cost/2026-11-29-numerics.md)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        bias = linear.bias
        self.bias = (
            torch.zeros(self.out_features) if bias is None else bias.detach().float().clone()
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.packed = torch.fbgemm_pack_gemm_matrix_fp16(linear.weight.detach().float())
            torch.fbgemm_linear_fp16_weight(
                torch.zeros(1, self.in_features), self.packed, self.bias
            )  # consume torch's one-time deprecation warning here, not in the decode loop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.fbgemm_linear_fp16_weight(x.reshape(-1, shape[-1]), self.packed, self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        """The fp16 weight the GEMM reads."""
        return self.out_features * self.in_features * 2


def swap_linears(module: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every ``nn.Linear`` under ``module`` by ``make(linear)``, in place, handing each
    replaced weight's pages back (:func:`_page_out`); returns how many were swapped."""
    swapped = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child))
            _page_out(child.weight)
            swapped += 1
        else:
            swapped += swap_linears(child, make)
    return swapped


_MADV_PAGEOUT = 21  # Linux >= 5.4: reclaim these pages now; file-backed ones are re-read on use


def _page_out(weight: torch.Tensor) -> None:
    """Hand the pages of a weight just repacked back to the kernel. Loaded through a memory map
    (transformers' default for safetensors), they stay resident until the whole file's mapping
    goes, so repacking a model would briefly hold it twice (the peak: docs/models.md, Devices).
    PAGEOUT keeps the contents: file-backed pages are dropped and re-read if touched again (a
    tied embedding still uses them), anonymous ones without swap stay put. Best effort: other
    systems, or kernels without it, simply keep the pages."""
    if not sys.platform.startswith("linux") or weight.device.type != "cpu":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = os.sysconf("SC_PAGE_SIZE")
        start = weight.data_ptr() // page * page
        end = weight.data_ptr() + weight.numel() * weight.element_size()
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_PAGEOUT)
    except (OSError, AttributeError, ValueError):
        pass


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


@dataclass(frozen=True)
class Numerics:
    """A named way to run the target; ``exact`` means the same fp32 maths as the stock model,
    ``reference`` a numerics kept for exactness checks (its drafts keep it too)."""

    name: str
    storage_dtype: torch.dtype
    exact: bool
    description: str
    reference: bool = False


NUMERICS: dict[str, Numerics] = {
    n.name: n
    for n in (
        Numerics("float32", torch.float32, True, "fp32, oneDNN prepacked linears (default)"),
        Numerics("float32-stock", torch.float32, True, "fp32, stock nn.Linear (MKL)"),
        Numerics("fp16-weights", torch.float32, False, "fp16-stored weights, fp32 maths"),
        Numerics("bfloat16", torch.bfloat16, False, "bf16 weights and activations"),
        Numerics("float64", torch.float64, True, "fp64 (reference for exactness checks)", True),
        # low-bit weights (CPU kernels, src/specdec/target/lowbit.py; figures: docs/lowbit.md)
        *(Numerics(s.name, torch.float32, False, s.description) for s in lowbit.SCHEMES.values()),
    )
}


def get_numerics(name: str) -> Numerics:
    try:
        return NUMERICS[name]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; choose one of: {', '.join(NUMERICS)}") from None


# modes built on CPU-only kernels (oneDNN prepacking, fbgemm); elsewhere "float32" is stock
_CPU_ONLY = {
    "fp16-weights": "fbgemm's fp16-weight GEMM",
    **{name: scheme.kernels for name, scheme in lowbit.SCHEMES.items()},
}


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when this torch build sees a GPU, else
    the CPU) as a device, or a clear error when the requested one is not present.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if isinstance(spec, torch.device):
        text = str(spec)
    else:
        text = (spec or "cpu").strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ConfigError(f"unknown device {spec!r}; use cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {text!r} was requested but this torch build ({torch.__version__}) sees "
                "no CUDA GPU; install a CUDA build of torch, or use --device cpu"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(
                f"device {text!r} does not exist: this machine has {count} CUDA device(s), "
                f"cuda:0..cuda:{count - 1}"
            )
    elif device.type != "cpu":
        raise ConfigError(f"device {text!r} is not supported; use cpu, cuda, cuda:N or auto")
    return device


def check_numerics_device(numerics: Numerics, device: torch.device) -> None:
    """Refuse, before a model loads, a numerics mode that has no kernels on ``device``."""
    if device.type != "cpu" and numerics.name in _CPU_ONLY:
        raise ConfigError(
            f"dtype {numerics.name!r} uses {_CPU_ONLY[numerics.name]}, which exists on the CPU "
            f"only; on {device} use float32 (exact) or bfloat16 (faster, not exact)"
        )


def apply_numerics(model: nn.Module, numerics: Numerics, device: torch.device | None = None) -> str:
    """Convert ``model`` in place and move it to ``device``; returns what actually runs.

    Each device gets its fastest *exact* fp32 by default: on the CPU, oneDNN prepacked linears
    (falling back to stock ones, and saying so, where oneDNN is unavailable); on CUDA, stock
    cuBLAS linears at full fp32 precision (TF32 would round inputs to 10 mantissa bits, so it is
    left off, torch's default; a process that turned it on is told). The linear swaps are CPU
    kernels and never happen elsewhere.
    """
    device = device or torch.device("cpu")
    check_numerics_device(numerics, device)
    model.to(numerics.storage_dtype)
    if device.type != "cpu":
        model.to(device)
        if numerics.name in ("float32", "float32-stock"):
            precision = torch.get_float32_matmul_precision()
            if precision != "highest":
                return (
                    f"fp32 weights, but float32 matmul precision is {precision!r} in this "
                    "process (TF32): not exact; call torch.set_float32_matmul_precision('highest')"
                )
            return "fp32, stock nn.Linear (cuBLAS, TF32 off) (default)"
        return numerics.description
    if numerics.name == "float32" and not onednn_available():
        return "fp32, stock nn.Linear (oneDNN unavailable in this torch build)"
    make = _cpu_linear_maker(numerics.name)
    if make is not None:
        scheme = lowbit.SCHEMES.get(numerics.name)
        if scheme is not None:  # refuse before anything is swapped
            scheme.requires()
            lowbit.check_shapes(model, numerics.name)
        swap_linears(model, make)
        if scheme is not None:
            # rounding activations needs a row-invariant forward
            use_rowwise_attention(model)
            scheme.after_swap(model)
        # after the scheme's own swaps: a table it replaced is not copied first
        _own_tensors(model)
        _trim_heap()
    return numerics.description


def _trim_heap() -> None:
    """Return the heap the repacking freed to the system (glibc keeps freed small blocks in
    the process otherwise: about 0.3 GB after the 1.5B Qwen's load). Best effort."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _cpu_linear_maker(name: str) -> Callable[[nn.Linear], nn.Module] | None:
    """What a CPU ``nn.Linear`` becomes under numerics ``name`` (``None``: it stays a stock
    linear in the storage dtype)."""
    if name == "float32":
        return PackedLinear if onednn_available() else None
    if name == "fp16-weights":
        return Fp16WeightLinear
    if name in lowbit.SCHEMES:
        return lowbit.SCHEMES[name].make
    return None


def linear_like(linear: nn.Linear, name: str, device: torch.device) -> nn.Module:
    """One fp32 ``linear`` in numerics ``name`` on ``device``, as :func:`apply_numerics` would
    have converted it inside a model (e.g. a draft's reduced LM head, built after loading)."""
    numerics = get_numerics(name)
    linear = linear.to(numerics.storage_dtype)
    make = _cpu_linear_maker(name) if device.type == "cpu" else None
    if make is None:
        return linear.to(device)
    if name in lowbit.SCHEMES:
        error = lowbit.SCHEMES[name].shape_error("a linear layer", linear)
        if error:
            raise ConfigError(error)
    return make(linear)


@torch.no_grad()
def _own_tensors(model: nn.Module) -> None:
    """Copy the parameters and buffers the swaps left (embeddings, norms) out of the loaded
    checkpoint. transformers memory-maps safetensors files, and the mapping lives as long as any
    tensor viewing it; every page the repacking read stays resident with it, beside the packed
    copies (what that costs: docs/models.md, Devices)."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = nn.Parameter(p.detach().clone(), p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = b.clone()


@torch.inference_mode()
def dense_weight(linear: nn.Module) -> torch.Tensor:
    """The float32 weight ``[out, in]`` of a linear layer, whether a plain ``nn.Linear`` or one
    of the swapped modules above (whose weight is prepacked and opaque): the layer applied to
    the identity matrix is its transposed weight plus bias, exactly, in float32."""
    weight = getattr(linear, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.detach().float().clone()
    exact = getattr(linear, "exact_weight", None)
    if callable(exact):  # a layer that rounds its inputs (kquant): the identity trick would not be
        return exact()
    n_in = int(getattr(linear, "in_features"))  # noqa: B009 - every swapped linear has it
    eye = torch.eye(n_in, dtype=torch.float32, device=_module_device(linear))  # [in, in]
    y = linear(eye).float()  # [in, out]
    bias = getattr(linear, "bias", None)
    if isinstance(bias, torch.Tensor):
        y = y - bias.float()
    return y.T.contiguous()


def _module_device(module: nn.Module) -> torch.device:
    """Where ``module``'s tensors live (prepacked CPU modules hold no parameters: the CPU)."""
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")
