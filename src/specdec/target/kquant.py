"""``--dtype kquant``: linears over a GGUF file's own Q4_K / Q6_K blocks, with a small-row
kernel that keeps verification cheap (``csrc/kquant.cpp``).

Why: llama.cpp decodes one token at memory speed, but its CPU kernels are bound by arithmetic
from two rows on, so verifying k drafted tokens costs nearly k decode steps and speculation
loses to its plain decoding (experiments/llamacpp/2026-12-05-zen4-isa.md). This kernel unpacks
each 256-weight super-block once and multiplies it with up to 8 rows by integer dot products
(AVX-512 VNNI, or AVX2 with the same bits; ``extension().path_name()`` says which runs).

Exactness: the weights are the file's codes and 6-bit sub-block scales as integers and its
fp16 ``d``/``dmin`` held in fp32, so nothing is rounded a second time; activations are rounded
per row and per 256-block to int8 (llama.cpp's Q8_K rule). Every row is computed from itself
alone in the same order whatever the row count, so a k-row verification pass gives each row
bit for bit what a one-row decoding step gives it.

The extension is compiled on first use with torch's own toolchain (``ninja`` and a C++
compiler) into ``$XDG_CACHE_HOME/specdec/ext`` (``~/.cache`` by default), once per machine and
torch version (its compile time: experiments/kquant/2026-12-05-kquant.md).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from torch import nn

from specdec.errors import ConfigError
from specdec.target import files
from specdec.target.gguf_blocks import q4k_fields

QK = 256
Q6_K_BYTES = 210  # 128 B low nibbles, 64 B high bits, 16 int8 scales, fp16 d


def _ext_dir() -> Path:
    path = files.cache_root() / "ext" / f"kquant-torch{torch.__version__.replace('+', '-')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def extension() -> ModuleType:
    """The compiled kernel; a ConfigError naming the fix where it cannot be built."""
    from torch.utils import cpp_extension

    csrc = Path(__file__).with_name("csrc")
    try:
        return cpp_extension.load(
            name="specdec_kquant",
            sources=[str(csrc / "kquant.cpp"), str(csrc / "layer.cpp")],
            extra_cflags=["-O3", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(_ext_dir()),
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as error:
        raise ConfigError(
            "the Q4_K/Q6_K kernel could not be compiled (it needs a C++ compiler and the "
            f"'ninja' package: pip install ninja): {str(error).splitlines()[0]}"
        ) from error


def _to_lanes(codes: np.ndarray) -> np.ndarray:
    """``[B, 256]`` codes in weight order -> ``[B, 4, 64]`` in the kernel's lane layout:
    register c, byte 4 l + i holds weight 16 l + 4 c + i (lane l: one 16-weight group)."""
    return codes.reshape(-1, 16, 4, 4).transpose(0, 2, 1, 3).reshape(-1, 4, 64)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """``[B, 256]`` 4-bit codes as the kernel reads them: registers 0 and 1 share the low and
    high nibbles of the first 64 bytes, registers 2 and 3 those of the next 64."""
    lanes = _to_lanes(codes)
    return (lanes[:, 0::2] | (lanes[:, 1::2] << 4)).astype(np.uint8).reshape(-1, 128)


def q4k_parts(blocks: np.ndarray, n: int) -> dict[str, torch.Tensor]:
    """A Q4_K tensor's bytes ``[N, K/256 * 144]`` as the kernel's arrays: nibbles repacked
    into the kernel's lane layout, integer scales and mins one byte each, fp16 d/dmin."""
    d, dmin, sc, m, codes = q4k_fields(blocks)
    packed = _pack_nibbles(codes)
    nb = len(d) // n
    meta = np.concatenate([sc, m], 1).astype(np.uint8)
    return {
        "codes": torch.from_numpy(packed.reshape(n, nb * 128).copy()),
        "meta": torch.from_numpy(meta.reshape(n, nb * 16).copy()),
        "d": torch.from_numpy(d.reshape(n, nb).copy()),
        "dmin": torch.from_numpy(dmin.reshape(n, nb).copy()),
    }


def q6k_parts(blocks: np.ndarray, n: int) -> dict[str, torch.Tensor]:
    """A Q6_K tensor's bytes ``[N, K/256 * 210]``: its 6-bit codes (low nibbles packed as for
    Q4_K, then the 2-bit high parts, in the kernel's lane layout), its int8 scale per 16
    weights, fp16 d.
    ``w = d * sc * (q - 32)``."""
    b = np.ascontiguousarray(blocks).reshape(-1, Q6_K_BYTES)
    ql = b[:, :128].reshape(-1, 2, 64)
    qh = b[:, 128:192].reshape(-1, 2, 32)
    scales = b[:, 192:208].copy().view(np.int8)
    d = b[:, 208:210].copy().view(np.float16)[:, 0]
    lo = np.concatenate(
        [ql[:, :, :32] & 15, ql[:, :, 32:] & 15, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], 2
    )  # [B, 2, 128]: weights 0-31, 32-63, 64-95, 96-127
    hi = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], 2)  # [B, 2, 128]
    nibbles = _pack_nibbles(lo.reshape(-1, 256))
    high = _to_lanes(hi.reshape(-1, 256))  # register c's 2-bit parts go to bits 2c, 2c + 1
    high = (high[:, 0] | (high[:, 1] << 2) | (high[:, 2] << 4) | (high[:, 3] << 6)).astype(np.uint8)
    codes = np.concatenate([nibbles, high], 1)  # [B, 192]: 6.5 bits a weight, as in the file
    nb = b.shape[0] // n
    return {
        "codes": torch.from_numpy(codes.reshape(n, nb * 192).copy()),
        "meta": torch.from_numpy(scales.reshape(n, nb * 16).view(np.uint8).copy()),
        "d": torch.from_numpy(d.reshape(n, nb).copy()),
        "dmin": torch.zeros(0, dtype=torch.float16),
    }


class KQuantLinear(nn.Module):
    """A linear layer over one GGUF Q4_K or Q6_K tensor, multiplied by the small-row kernel."""

    def __init__(
        self, kind: str, parts: dict[str, torch.Tensor], in_features: int, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        if kind not in ("Q4_K", "Q6_K"):
            raise ConfigError(f"KQuantLinear takes Q4_K or Q6_K tensors, not {kind}")
        if in_features % QK:
            raise ConfigError(f"in_features {in_features} is not a multiple of {QK}")
        self.kind = kind
        self.in_features = in_features
        self.out_features = parts["d"].shape[0]
        self.codes, self.meta = parts["codes"], parts["meta"]
        self.d, self.dmin = parts["d"], parts["dmin"]
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @classmethod
    def from_gguf(
        cls, kind: str, data: np.ndarray, in_features: int, bias: torch.Tensor | None = None
    ) -> KQuantLinear:
        n = data.shape[0]
        parts = q4k_parts(data, n) if kind == "Q4_K" else q6k_parts(data, n)
        return cls(kind, parts, in_features, bias)

    def _codes(self) -> torch.Tensor:
        """Every weight's code, ``[N, nb, 256]`` int16 in weight order."""
        n, nb = self.out_features, self.in_features // QK
        stride = 192 if self.kind == "Q6_K" else 128
        raw = self.codes.view(n, nb, stride)
        packed = raw[..., :128].reshape(n, nb, 2, 1, 64)
        lanes = torch.cat([packed & 15, packed >> 4], 3).reshape(n, nb, 4, 64).to(torch.int16)
        if self.kind == "Q6_K":
            high = raw[..., 128:].reshape(n, nb, 1, 64)
            parts = torch.cat([(high >> (2 * c)) & 3 for c in range(4)], 2)  # [n, nb, 4, 64]
            lanes = lanes | (parts.to(torch.int16) << 4)
        # register c, byte 4 l + i -> weight 16 l + 4 c + i
        return lanes.view(n, nb, 4, 16, 4).permute(0, 1, 3, 2, 4).reshape(n, nb, 256)

    def exact_weight(self) -> torch.Tensor:
        """The exact fp32 weight ``[N, K]`` (what the file's own dequantisation gives)."""
        n, nb = self.out_features, self.in_features // QK
        d = self.d.float().view(n, nb, 1, 1)
        if self.kind == "Q6_K":
            q = self._codes().view(n, nb, 16, 16).float() - 32
            sc = self.meta.view(torch.int8).view(n, nb, 16, 1).float()
            return (d * sc * q).view(n, -1)
        codes = self._codes().view(n, nb, 8, 32).float()
        meta = self.meta.view(n, nb, 16).float()
        sc, m = meta[..., :8].unsqueeze(-1), meta[..., 8:].unsqueeze(-1)
        dmin = self.dmin.float().view(n, nb, 1, 1)
        return (d * sc * codes - dmin * m).view(n, -1)

    @classmethod
    def from_attached(cls, linear: nn.Linear) -> KQuantLinear:
        """The layer for ``linear`` from the GGUF blocks :func:`attach_gguf_blocks` gave it."""
        blocks = getattr(linear, ATTACHED, None)
        if blocks is None:
            raise ConfigError(
                "dtype 'kquant' runs a GGUF file's own Q4_K/Q6_K blocks, and this linear layer "
                f"([out={linear.out_features}, in={linear.in_features}]) has none: load the "
                "model from its GGUF file (--gguf FILE or a model pack), or use int8-dynamic"
            )
        kind, data = blocks
        return cls.from_gguf(kind, data, linear.in_features, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # every pass, prefill included, goes through the kernel (8 rows at a time): it is also
        # faster than dequantising every weight to fp32 for one long matmul
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        return self.mm(x2).view(*x.shape[:-1], self.out_features)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on float32 rows ``[rows, in]`` -> ``[rows, out]``, without the module
        call (the lean decoder layers call it a few hundred times a step)."""
        y = extension().kquant_mm(
            x, self.codes, self.meta, self.d, self.dmin, self.kind == "Q6_K", False
        )
        if self.bias is not None:
            y += self.bias
        return y

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.meta, self.d, self.dmin))


ATTACHED = "_specdec_gguf_blocks"
# GGUF tensor name (llama.cpp's) -> the Hugging Face module, for the architectures whose GGUF
# rows are the checkpoint's rows as they are (qwen2 and its family; llama's q/k are permuted)
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def module_path(tensor_name: str, tied: bool) -> str | None:
    """The module a GGUF weight belongs to, or ``None`` for a tensor that is no linear."""
    if tensor_name == "output.weight" or (tied and tensor_name == "token_embd.weight"):
        return "lm_head"
    parts = tensor_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
    return None


def attach_gguf_blocks(model: nn.Module, gguf_path: str | os.PathLike[str]) -> int:
    """Give every ``nn.Linear`` of ``model`` (loaded from ``gguf_path``) its tensor's blocks,
    so the ``kquant`` swap builds from the file's codes. Refuses, before anything is swapped, a
    file whose linears are not all Q4_K/Q6_K."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(gguf_path)).tensors}
    modules = dict(model.named_modules())
    tied = "output.weight" not in tensors
    blocks: dict[str, tuple[str, np.ndarray]] = {}
    for name, tensor in tensors.items():
        path = module_path(name, tied)
        if path is None or not isinstance(modules.get(path), nn.Linear):
            continue
        kind = tensor.tensor_type.name
        if kind not in ("Q4_K", "Q6_K"):
            raise ConfigError(
                f"dtype 'kquant' multiplies Q4_K and Q6_K blocks, but {Path(gguf_path).name}'s "
                f"{name} is {kind}; use a Q4_K_M/Q4_K_S file, or --dtype gguf (llama.cpp) or "
                "int8-dynamic for this one"
            )
        blocks[path] = (kind, np.asarray(tensor.data))
    return attach_blocks(model, blocks, Path(gguf_path).name)


def attach_blocks(model: nn.Module, blocks: dict[str, tuple[str, np.ndarray]], origin: str) -> int:
    """Attach ``{module path: (kind, [N, bytes] blocks)}`` to ``model``'s linears, each checked
    against the loaded weight (its first rows, exactly) so a layout the mapping does not know
    is refused rather than run; every linear must get blocks."""
    modules = dict(model.named_modules())
    for path, (kind, data) in blocks.items():
        linear = modules.get(path)
        if not isinstance(linear, nn.Linear):
            raise ConfigError(f"dtype 'kquant': {origin} has blocks for {path}, not a linear layer")
        probe = KQuantLinear.from_gguf(kind, data[:2], linear.in_features).exact_weight()
        if not torch.equal(probe, linear.weight.detach()[:2].float()):
            raise ConfigError(
                f"{origin}'s blocks for {path} do not hold the checkpoint's weight as it lays "
                "it out (llama-architecture files permute q/k rows); dtype 'kquant' supports "
                "the qwen2 family so far: use --dtype gguf or int8-dynamic"
            )
        setattr(linear, ATTACHED, (kind, data))
    missing = [
        p for p, m in modules.items() if isinstance(m, nn.Linear) and not hasattr(m, ATTACHED)
    ]
    if missing:
        raise ConfigError(
            f"dtype 'kquant': no Q4_K/Q6_K tensor in {origin} for {missing[0]} "
            f"(and {len(missing) - 1} more); use --dtype gguf or int8-dynamic"
        )
    return len(blocks)
