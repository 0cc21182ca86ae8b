"""``--dtype kquant`` (what ``--dtype auto`` picks for a GGUF file on the CPU): linears over a
GGUF file's own quantised blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), with a
small-row kernel that keeps verification cheap (``csrc/kquant.cpp``).

Why: llama.cpp decodes one token at memory speed, but its CPU kernels are bound by arithmetic
from two rows on, so verifying k drafted tokens costs nearly k decode steps and speculation
loses to its plain decoding (experiments/llamacpp/2026-12-05-zen4-isa.md). This kernel unpacks
each 256-weight super-block once and multiplies it with up to 8 rows by integer dot products
(AVX-512 VNNI, or AVX2 with the same bits; ``extension().path_name()`` says which runs).

Exactness: the weights are the file's codes and 6-bit sub-block scales as integers and its
fp16 ``d``/``dmin`` held in fp32 (for the 32-weight block types, each block's fp16 scale and
offset), so nothing is rounded a second time; rows not a multiple of 256 wide are padded with
zero weights; activations are rounded
per row and per 32 inputs to int8 (llama.cpp's Q8_0 rule). Every row is computed from itself
alone in the same order whatever the row count, so a k-row verification pass gives each row
bit for bit what a one-row decoding step gives it.

The extension is compiled on first use with torch's own toolchain (``ninja`` and a C++
compiler) into ``$XDG_CACHE_HOME/specdec/ext`` (``~/.cache`` by default), once per machine and
torch version (its compile time: experiments/kquant/2026-12-05-kquant.md).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from specdec.errors import ConfigError
from specdec.target import files
from specdec.target.gguf_blocks import SMALL_BLOCKS, q4k_fields, q5k_fields, small_block_fields

QK = 256
Q6_K_BYTES = 210  # 128 B low nibbles, 64 B high bits, 16 int8 scales, fp16 d


def _ext_dir() -> Path:
    path = files.cache_root() / "ext" / f"kquant-torch{torch.__version__.replace('+', '-')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def kernel_digest() -> str:
    """A digest of the kernel's sources: what a measurement of its speed is keyed by."""
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).with_name("csrc").glob("*.cpp")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:12]


@functools.cache
def extension() -> ModuleType:
    """The compiled kernel; a ConfigError naming the fix where it cannot be built."""
    from torch.utils import cpp_extension

    csrc = Path(__file__).with_name("csrc")
    build = _ext_dir()
    if not (build / "specdec_kquant.so").is_file():  # long work says so (sources changed: quiet)
        print(  # noqa: T201 - once per machine, before a minute of silence
            f"compiling specdec's quantised-block kernel once (about a minute) into {build}",
            file=sys.stderr,
            flush=True,
        )
    try:
        return cpp_extension.load(
            name="specdec_kquant",
            sources=[str(csrc / "kquant.cpp"), str(csrc / "layer.cpp")],
            extra_cflags=["-O3", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as error:
        raise ConfigError(
            "the quantised-block kernel could not be compiled (it needs a C++ compiler and the "
            f"'ninja' package: pip install ninja): {str(error).splitlines()[0]}"
        ) from error


def _to_lanes(codes: np.ndarray, per_lane: int = 16) -> np.ndarray:
    """``[B, W]`` codes in weight order -> ``[B, per_lane / 4, 4 * W / per_lane]`` in the
    kernel's lane layout: register c, byte 4 l + i holds weight ``per_lane * l + 4 c + i``
    (lane l: one group of ``per_lane`` weights with one scale: 16 for Q6_K's blocks, 32 for the
    kinds scaled per 32, whose W is a pair of blocks or a row's last single block)."""
    b, lanes, regs = len(codes), codes.shape[1] // per_lane, per_lane // 4
    return codes.reshape(b, lanes, regs, 4).transpose(0, 2, 1, 3).reshape(b, regs, 4 * lanes)


def _pack_nibbles(codes: np.ndarray, per_lane: int = 16) -> np.ndarray:
    """4-bit codes (see :func:`_to_lanes`) as the kernel reads them: registers 2 j and
    2 j + 1 share the low and high nibbles of the j-th register's worth of bytes."""
    lanes = _to_lanes(codes, per_lane)
    packed = (lanes[:, 0::2] | (lanes[:, 1::2] << 4)).astype(np.uint8)
    return packed.reshape(len(codes), codes.shape[1] // 2)


def _pack_six(codes: np.ndarray, per_lane: int = 16) -> np.ndarray:
    """Codes of up to 6 bits as the kernel reads them: the low nibbles packed as for 4 bits,
    then the 2-bit high parts, a register's worth of bytes per 4 registers, register 4 h + c's
    in bits 2c and 2c + 1 of the h-th."""
    nibbles = _pack_nibbles(codes & 15, per_lane)
    lanes = _to_lanes(codes >> 4, per_lane)
    high = lanes.reshape(len(codes), lanes.shape[1] // 4, 4, lanes.shape[2])
    high = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    high = high.astype(np.uint8).reshape(len(codes), codes.shape[1] // 4)
    return np.concatenate([nibbles, high], 1)


def _pack_bytes(codes: np.ndarray, per_lane: int = 16) -> np.ndarray:
    """8-bit codes in the lane layout, a register after another."""
    return _to_lanes(codes, per_lane).reshape(codes.shape).astype(np.uint8)


def _paired_codes(codes: np.ndarray, n: int, pack: Callable[..., np.ndarray]) -> np.ndarray:
    """A kind scaled per 32: codes ``[N * nb, 256]`` in weight order as ``[N, nb * stride]``,
    each row's blocks two at a time and, where ``nb`` is odd, its last block alone."""
    nb = len(codes) // max(n, 1)
    rows = codes.reshape(n, nb, QK)
    even = nb - nb % 2
    pairs = pack(rows[:, :even].reshape(n * even // 2, 2 * QK), 32)
    parts = [pairs.reshape(n, pairs.size // max(n, 1))]
    if nb % 2:
        last = pack(np.ascontiguousarray(rows[:, -1]), 32)
        parts.append(last.reshape(n, last.size // max(n, 1)))
    return np.concatenate(parts, 1)


def _paired_meta(first: np.ndarray, second: np.ndarray, n: int) -> np.ndarray:
    """Two per-block fields ``[N * nb, w]`` (scales and mins) as the kernel reads them: per
    pair of blocks both blocks' ``first``, then both blocks' ``second``; a row's last single
    block its own two. ``[N, nb * 2 * w]``."""
    w = first.shape[1]
    nb = len(first) // max(n, 1)
    f, s = first.reshape(n, nb, w), second.reshape(n, nb, w)
    even = nb - nb % 2
    pairs = (n, even // 2, 2 * w)
    out = np.concatenate([f[:, :even].reshape(pairs), s[:, :even].reshape(pairs)], 2)
    out = out.reshape(n, even * 2 * w)
    if nb % 2:
        out = np.concatenate([out, f[:, -1], s[:, -1]], 1)
    return out


def q4k_parts(blocks: np.ndarray, n: int) -> dict[str, torch.Tensor]:
    """A Q4_K tensor's bytes ``[N, K/256 * 144]`` as the kernel's arrays: nibbles repacked
    into the paired lane layout, integer scales and mins one byte each, fp16 d/dmin."""
    d, dmin, sc, m, codes = q4k_fields(blocks)
    return {
        "codes": torch.from_numpy(_paired_codes(codes, n, _pack_nibbles)),
        "meta": torch.from_numpy(_paired_meta(sc, m, n).astype(np.uint8)),
        "d": torch.from_numpy(d.reshape(n, -1).copy()),
        "dmin": torch.from_numpy(dmin.reshape(n, -1).copy()),
    }


def q6k_parts(blocks: np.ndarray, n: int) -> dict[str, torch.Tensor]:
    """A Q6_K tensor's bytes ``[N, K/256 * 210]``: its 6-bit codes (:func:`_pack_six`), its
    int8 scale per 16 weights, fp16 d.
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
    codes = _pack_six((lo | (hi << 4)).reshape(-1, 256))  # 6.5 bits a weight, as in the file
    nb = b.shape[0] // n
    return {
        "codes": torch.from_numpy(codes.reshape(n, nb * 192).copy()),
        "meta": torch.from_numpy(scales.reshape(n, nb * 16).view(np.uint8).copy()),
        "d": torch.from_numpy(d.reshape(n, nb).copy()),
        "dmin": torch.zeros(0, dtype=torch.float16),
    }


def q5k_parts(blocks: np.ndarray, n: int) -> dict[str, torch.Tensor]:
    """A Q5_K tensor's bytes ``[N, K/256 * 176]``: 5-bit codes in the paired 6-bit layout,
    scales, mins and d/dmin as for Q4_K. ``w = d * sc * q - dmin * m``."""
    d, dmin, sc, m, codes = q5k_fields(blocks)
    return {
        "codes": torch.from_numpy(_paired_codes(codes, n, _pack_six)),
        "meta": torch.from_numpy(_paired_meta(sc, m, n).astype(np.uint8)),
        "d": torch.from_numpy(d.reshape(n, -1).copy()),
        "dmin": torch.from_numpy(dmin.reshape(n, -1).copy()),
    }


def small_parts(kind: str, blocks: np.ndarray, n: int, k: int) -> dict[str, torch.Tensor]:
    """A tensor of 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), ``[N, K/32 * bytes]``, as
    the kernel's lane-scaled super-blocks: each row padded with zero blocks (d = m = 0) to a
    multiple of 256 weights, its codes in the paired lane layout (4-bit, 6-bit or 8-bit), and
    per pair of 256-weight blocks 16 fp16 d then 16 fp16 m (a last single block: 8 and 8),
    ``w = d * code + m`` (exact: the file's own values)."""
    codes, d, m = small_block_fields(blocks, kind)
    per_row = k // 32
    padded = -(-k // QK) * (QK // 32)  # 32-blocks per padded row
    c = np.zeros((n, padded, 32), np.uint8)
    c[:, :per_row] = codes.reshape(n, per_row, 32)
    dd = np.zeros((n, padded), np.float16)
    mm = np.zeros((n, padded), np.float16)
    dd[:, :per_row], mm[:, :per_row] = d.reshape(n, per_row), m.reshape(n, per_row)
    bits = SMALL_BLOCKS[kind][2]
    pack = _pack_nibbles if bits == 4 else _pack_six if bits == 5 else _pack_bytes
    packed = _paired_codes(c.reshape(-1, QK), n, pack)
    meta = _paired_meta(dd.reshape(-1, 8), mm.reshape(-1, 8), n).view(np.uint8)
    return {
        "codes": torch.from_numpy(np.ascontiguousarray(packed).reshape(n, -1).copy()),
        "meta": torch.from_numpy(meta.copy()),
        "d": torch.zeros(0, dtype=torch.float16),
        "dmin": torch.zeros(0, dtype=torch.float16),
    }


# the kernel's weight kinds (csrc/kquant.cpp ``Kind``): each file type, and its code width
KIND_IDS = {"Q4_K": 0, "Q6_K": 1, "Q5_K": 2, "Q4_0": 3, "Q4_1": 3, "Q5_0": 4, "Q5_1": 4, "Q8_0": 5}
KINDS = tuple(KIND_IDS)  # what the kernel multiplies
_LANE_SCALED = 3  # kinds from here on carry a scale and offset per 32 weights
_Q6_K = 1  # the one kind scaled per 16 weights; the kernel takes every other two blocks at once
_CODE_STRIDE = {0: 128, 1: 192, 2: 192, 3: 128, 4: 192, 5: 256}


def _parts(kind: str, data: np.ndarray, in_features: int) -> dict[str, torch.Tensor]:
    n = data.shape[0]
    if kind == "Q4_K":
        return q4k_parts(data, n)
    if kind == "Q6_K":
        return q6k_parts(data, n)
    if kind == "Q5_K":
        return q5k_parts(data, n)
    return small_parts(kind, data, n, in_features)


def _rows_of(part: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Output channels ``rows`` of one of a layer's per-channel parts (an unused, empty part
    stays empty)."""
    return part if part.numel() == 0 else part.index_select(0, rows)


def _unpack(raw: torch.Tensor, regs: int, lanes: int, stride: int) -> torch.Tensor:
    """Codes ``[N, units, bytes]`` in the lane layout (``regs`` registers of ``lanes`` lanes a
    unit; ``stride`` a block's bytes: 128 4-bit, 192 6-bit, 256 8-bit) back in weight order,
    ``[N, units, lanes * 4 * regs]`` int16 (undoing :func:`_pack_nibbles` and its kin)."""
    n, units, rb = raw.shape[0], raw.shape[1], 4 * lanes  # rb: bytes of one register
    if stride == 256:
        codes = raw.reshape(n, units, regs, rb).to(torch.int16)
    else:
        packed = raw[..., : regs * rb // 2].reshape(n, units, regs // 2, 1, rb)
        codes = torch.cat([packed & 15, packed >> 4], 3).reshape(n, units, regs, rb)
        codes = codes.to(torch.int16)
    if stride == 192:
        high = raw[..., regs * rb // 2 :].reshape(n, units, regs // 4, 1, rb)
        parts = torch.cat([(high >> (2 * c)) & 3 for c in range(4)], 3)
        codes = codes | (parts.reshape(n, units, regs, rb).to(torch.int16) << 4)
    # register c, byte 4 l + i -> weight (4 regs) l + 4 c + i of the unit
    codes = codes.view(n, units, regs, lanes, 4).permute(0, 1, 3, 2, 4)
    return codes.reshape(n, units, lanes * 4 * regs)


class KQuantLinear(nn.Module):
    """A linear layer over one GGUF tensor of a type in :data:`KINDS`, multiplied by the
    small-row kernel. Rows whose width is not a multiple of 256 are padded with zero weights
    (and the input with zeros) to the next one."""

    def __init__(
        self, kind: str, parts: dict[str, torch.Tensor], in_features: int, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        if kind not in KIND_IDS:
            raise ConfigError(f"KQuantLinear takes {', '.join(KINDS)} tensors, not {kind}")
        self.kind = kind
        self.kind_id = KIND_IDS[kind]
        self.in_features = in_features
        self.padded_in = -(-in_features // QK) * QK
        if self.kind_id < _LANE_SCALED and self.padded_in != in_features:
            raise ConfigError(f"in_features {in_features} is not a multiple of {QK}")
        self.paired = self.kind_id != _Q6_K  # laid out two blocks at a time
        self.out_features = parts["codes"].shape[0]
        self.codes, self.meta = parts["codes"], parts["meta"]
        self.d, self.dmin = parts["d"], parts["dmin"]
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @classmethod
    def from_gguf(
        cls, kind: str, data: np.ndarray, in_features: int, bias: torch.Tensor | None = None
    ) -> KQuantLinear:
        if kind not in KIND_IDS:
            raise ConfigError(f"KQuantLinear takes {', '.join(KINDS)} tensors, not {kind}")
        # a vocabulary-sized tensor is repacked a slice of rows at a time: the repacking's
        # temporaries are several times the tensor, which was the peak of a model's load
        step = 8192
        chunks = [_parts(kind, data[i : i + step], in_features) for i in range(0, len(data), step)]
        if len(chunks) == 1:
            parts = chunks[0]
        else:
            parts = {
                name: chunks[0][name]
                if chunks[0][name].numel() == 0
                else torch.cat([c[name] for c in chunks])
                for name in chunks[0]
            }
        return cls(kind, parts, in_features, bias)

    @classmethod
    def q8_from_float(cls, linear: nn.Linear) -> KQuantLinear:
        """``linear``'s weights rounded to Q8_0 blocks (llama.cpp's rule: per 32 weights an fp16
        scale amax / 127 and int8 codes), for a module that needs speed, not exactness: a
        drafter's linears, which the target verifies. At one row it reads half of fp16's bytes,
        and a one-row pass is bound by those bytes (measured against fbgemm's fp16 GEMM:
        experiments/eagle/2026-12-07-qwen15-eagle-data.md)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        w = linear.weight.detach().float().cpu().numpy()
        k = w.shape[1]
        if k % 32:
            raise ConfigError(f"Q8_0 rows hold whole 32-weight blocks; in_features is {k}")
        blocks = quantize(w, GGMLQuantizationType.Q8_0)  # gguf's own Q8_0, llama.cpp's rule
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls.from_gguf("Q8_0", blocks, k, bias)

    def _codes(self, codes: torch.Tensor | None = None) -> torch.Tensor:
        """Every weight's code, ``[N, nb, 256]`` int16 in weight order (of ``codes``, rows of
        this layer's, or all of them)."""
        raw2d = self.codes if codes is None else codes
        n, nb = raw2d.shape[0], self.padded_in // QK
        stride = _CODE_STRIDE[self.kind_id]
        raw2d = raw2d.reshape(n, nb * stride)
        if not self.paired:
            return _unpack(raw2d.view(n, nb, stride), 4, 16, stride).view(n, nb, 256)
        even = nb - nb % 2
        pairs = raw2d[:, : even * stride].reshape(n, even // 2, 2 * stride)
        parts = [_unpack(pairs, 8, 16, stride)]
        if nb % 2:  # the last block alone
            parts.append(_unpack(raw2d[:, even * stride :].reshape(n, 1, stride), 8, 8, stride))
        flat = [part.reshape(n, part.shape[1] * part.shape[2]) for part in parts]
        return torch.cat(flat, 1).view(n, nb, 256)

    def _unpaired(self, meta: torch.Tensor, n: int, nb: int) -> torch.Tensor:
        """A paired kind's meta ``[N, nb * w]`` bytes per block again: ``[N, nb, w]`` with
        each block's first field then its second (undoing :func:`_paired_meta`)."""
        width = meta.shape[1] // nb // 2  # bytes of one field of one block
        even = nb - nb % 2
        body = meta[:, : even * 2 * width].reshape(n, even // 2, 2, 2, width).transpose(2, 3)
        out = body.reshape(n, even, 2 * width)
        if nb % 2:
            out = torch.cat([out, meta[:, even * 2 * width :].reshape(n, 1, 2 * width)], 1)
        return out

    def exact_weight(self) -> torch.Tensor:
        """The exact fp32 weight ``[N, K]`` (what the file's own dequantisation gives)."""
        return self._exact(self.codes, self.meta, self.d, self.dmin)

    def exact_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The exact fp32 weight rows ``rows`` (int64 ``[R]``) as ``[R, K]``: an embedding
        lookup in the file's own numbers, without a dequantised copy of the whole table."""
        parts = (_rows_of(t, rows) for t in (self.codes, self.meta, self.d, self.dmin))
        return self._exact(*parts)

    def select_rows(self, rows: torch.Tensor) -> KQuantLinear:
        """A layer of just the output channels ``rows`` (int64 ``[R]``), in the same blocks: a
        draft's LM head over its most frequent tokens reads only their rows, and each channel's
        output keeps its bits (channels are independent in the kernel)."""
        names = ("codes", "meta", "d", "dmin")
        parts = {name: _rows_of(getattr(self, name), rows) for name in names}
        bias = None if self.bias is None else self.bias.index_select(0, rows)
        return type(self)(self.kind, parts, self.in_features, bias)

    def _exact(
        self, codes: torch.Tensor, meta: torch.Tensor, d_: torch.Tensor, dmin_: torch.Tensor
    ) -> torch.Tensor:
        n, nb = codes.shape[0], self.padded_in // QK
        if n == 0:  # no rows asked for (a pass of no new tokens)
            return torch.zeros(0, self.in_features)
        if self.kind_id >= _LANE_SCALED:
            scales = self._unpaired(meta, n, nb).view(torch.float16).view(n, nb, 2, 8).float()
            q = self._codes(codes).view(n, nb, 8, 32).float()
            w = scales[:, :, 0, :, None] * q + scales[:, :, 1, :, None]
            return w.reshape(n, -1)[:, : self.in_features].contiguous()
        d = d_.float().view(n, nb, 1, 1)
        if self.kind == "Q6_K":
            q = self._codes(codes).view(n, nb, 16, 16).float() - 32
            sc = meta.view(torch.int8).view(n, nb, 16, 1).float()
            return (d * sc * q).view(n, -1)
        q = self._codes(codes).view(n, nb, 8, 32).float()
        meta4 = self._unpaired(meta, n, nb).float()
        sc, m = meta4[..., :8].unsqueeze(-1), meta4[..., 8:].unsqueeze(-1)
        dmin = dmin_.float().view(n, nb, 1, 1)
        return (d * sc * q - dmin * m).view(n, -1)[:, : self.in_features].contiguous()

    @classmethod
    def from_attached(cls, linear: nn.Linear) -> KQuantLinear:
        """The layer for ``linear`` from the GGUF blocks :func:`attach_gguf_blocks` gave it."""
        blocks = getattr(linear, ATTACHED, None)
        if blocks is None:
            raise ConfigError(
                "dtype 'kquant' runs a GGUF file's own quantised blocks, and this linear layer "
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
        # rows narrower than the padded blocks are padded with zeros by the kernel
        y = extension().kquant_mm(x, self.codes, self.meta, self.d, self.dmin, self.kind_id, False)
        if self.bias is not None:
            y += self.bias
        return y

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.meta, self.d, self.dmin))


class KQuantEmbedding(nn.Module):
    """An input embedding kept in quantised blocks (the file's ``token_embd``, or a tied
    model's LM head, which is the same tensor): each lookup dequantises just the rows asked
    for, exactly as the file's own dequantisation (so the outputs are those of the float32
    table, bit for bit). The float32 table it replaces is the
    largest tensor of a small model (151,936 x 1,536 floats, 0.93 GB, for the 1.5B Qwen), held
    only to be looked up a few rows a step."""

    head: KQuantLinear  # the blocks; not a submodule (a tied model owns them as its lm_head)

    def __init__(self, head: KQuantLinear, padding_idx: int | None = None) -> None:
        super().__init__()
        self.__dict__["head"] = head
        self.num_embeddings = head.out_features
        self.embedding_dim = head.in_features
        self.padding_idx = padding_idx

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.head.exact_rows(input_ids.reshape(-1).long())
        return rows.view(*input_ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table, dequantised now (a full float32 copy, for the rare reader that
        needs it: a drafter sharing the embedding, a digest)."""
        return self.head.exact_weight()

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the table (a digest reads it in slices)."""
        return self.head.exact_rows(torch.arange(start, stop))


def use_quantised_embedding(model: nn.Module) -> bool:
    """Replace the input ``nn.Embedding`` by :class:`KQuantEmbedding` (after the linear swap);
    returns whether it did. Its table is the file's ``token_embd`` blocks where
    :func:`attach_gguf_blocks` gave the embedding its own, else the kquant LM head of a tied
    model whose rows are the table's. A scaled or otherwise special embedding class (Gemma's
    multiplies by sqrt(hidden)) keeps its table."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return False
    embedding, head = get_in(), get_out()
    if type(embedding) is not nn.Embedding:
        return False
    own = getattr(embedding, ATTACHED, None)
    if own is not None:
        table = KQuantLinear.from_gguf(own[0], own[1], embedding.embedding_dim)
    elif isinstance(head, KQuantLinear) and head.bias is None:
        table = head
    else:
        return False
    if (embedding.num_embeddings, embedding.embedding_dim) != (
        table.out_features,
        table.in_features,
    ):
        return False
    # the blocks' rows must be the table's: check a few, exactly
    probe = torch.tensor([0, embedding.num_embeddings // 2, embedding.num_embeddings - 1])
    if not torch.equal(table.exact_rows(probe), embedding.weight.detach()[probe].float()):
        return False
    cast(Any, model).set_input_embeddings(KQuantEmbedding(table, embedding.padding_idx))
    return True


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


# the architectures whose GGUF rows the reader knows how to place
ARCHITECTURES = ("qwen2", "llama", "gemma3")


def coverage(gguf_path: str | os.PathLike[str]) -> str | None:
    """Why ``dtype='kquant'`` cannot run ``gguf_path`` (``None``: it can): an architecture
    whose rows it cannot place, or a linear's tensor type it has no kernel for. Reads the
    file's header and tensor table only."""
    from gguf import GGUFReader

    return _coverage(GGUFReader(str(gguf_path)))


def _coverage(reader: Any) -> str | None:
    arch = _field(reader, "general.architecture") or "unknown"
    if arch not in ARCHITECTURES:
        return f"its architecture is {arch} (kquant runs {', '.join(ARCHITECTURES)})"
    tensors = {t.name: t.tensor_type.name for t in reader.tensors}
    tied = "output.weight" not in tensors
    for name, kind in tensors.items():
        if module_path(name, tied) is not None and kind not in KINDS:
            return f"its {name} is {kind} (kquant multiplies {', '.join(KINDS)})"
    return None


def linear_bytes(gguf_path: str | os.PathLike[str]) -> tuple[float, float]:
    """GB of the file's linear weights as stored, and as fp32 (what a dequantised copy reads
    per token)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    stored = fp32 = 0
    for t in reader.tensors:
        if module_path(t.name, tied) is not None:
            stored += int(t.n_bytes)
            fp32 += 4 * int(t.n_elements)
    return stored / 1e9, fp32 / 1e9


def _field(reader: Any, key: str) -> Any:
    """A GGUF header field's value (a string field decoded), or ``None``."""
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[-1]
    return bytes(value).decode() if field.types and field.types[0].name == "STRING" else value[0]


def llama_row_order(rows: int, heads: int) -> np.ndarray:
    """The GGUF row each checkpoint row of a llama-architecture q/k projection is: llama.cpp's
    converter interleaves each head's two rotary halves (``permute``); transformers' reader
    undoes it (``reverse_permute``), and the kernel reads the file's rows in that order."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


def attach_gguf_blocks(model: nn.Module, gguf_path: str | os.PathLike[str]) -> int:
    """Give every ``nn.Linear`` of ``model`` (loaded from ``gguf_path``) its tensor's blocks,
    so the ``kquant`` swap builds from the file's codes. Refuses, before anything is swapped, a
    file the kernel does not cover (:func:`coverage`)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    reason = _coverage(reader)
    if reason is not None:
        raise ConfigError(
            f"dtype 'kquant' cannot run {Path(gguf_path).name}: {reason}; use --dtype float32 "
            "(the dequantised weights), gguf (llama.cpp) or int8-dynamic for this one"
        )
    arch = _field(reader, "general.architecture")
    tensors = {t.name: t for t in reader.tensors}
    modules = dict(model.named_modules())
    tied = "output.weight" not in tensors
    blocks: dict[str, tuple[str, np.ndarray]] = {}
    for name, tensor in tensors.items():
        path = module_path(name, tied)
        if path is None or not isinstance(modules.get(path), nn.Linear):
            continue
        data = np.asarray(tensor.data)
        role = name.split(".")[2] if name.startswith("blk.") else ""
        if arch == "llama" and role in ("attn_q", "attn_k"):
            heads = _field(reader, "llama.attention.head_count")
            if role == "attn_k":
                heads = _field(reader, "llama.attention.head_count_kv") or heads
            data = data[llama_row_order(data.shape[0], int(heads))]
        blocks[path] = (tensor.tensor_type.name, data)
    attached = attach_blocks(model, blocks, Path(gguf_path).name)
    table = tensors.get("token_embd.weight")
    if not tied and table is not None and table.tensor_type.name in KINDS:
        _attach_embedding(model, table.tensor_type.name, np.asarray(table.data))
    return attached


def _attach_embedding(model: nn.Module, kind: str, data: np.ndarray) -> None:
    """Give an untied model's input embedding its own ``token_embd`` blocks, so that the kquant
    swap can keep the table quantised (:func:`use_quantised_embedding`, which checks them
    against the loaded table before using them)."""
    get_in = getattr(model, "get_input_embeddings", None)
    embedding = get_in() if get_in is not None else None
    if type(embedding) is nn.Embedding:
        setattr(embedding, ATTACHED, (kind, data))


def attach_blocks(model: nn.Module, blocks: dict[str, tuple[str, np.ndarray]], origin: str) -> int:
    """Attach ``{module path: (kind, [N, bytes] blocks)}`` to ``model``'s linears, each checked
    against the loaded weight (its first rows, exactly) so a layout the mapping does not know
    is refused rather than run; every linear must get blocks."""
    modules = dict(model.named_modules())
    for path, (kind, data) in blocks.items():
        linear = modules.get(path)
        if not isinstance(linear, nn.Linear):
            raise ConfigError(f"dtype 'kquant': {origin} has blocks for {path}, not a linear layer")
        rows = np.unique(np.linspace(0, len(data) - 1, 4).astype(int))
        probe = KQuantLinear.from_gguf(kind, data[rows], linear.in_features).exact_weight()
        if not torch.equal(probe, linear.weight.detach()[rows].float()):
            raise ConfigError(
                f"{origin}'s blocks for {path} do not hold the checkpoint's weight as it lays "
                "it out (a row order this reader does not know); use --dtype float32, gguf "
                "or int8-dynamic"
            )
        setattr(linear, ATTACHED, (kind, data))
    missing = [
        p for p, m in modules.items() if isinstance(m, nn.Linear) and not hasattr(m, ATTACHED)
    ]
    if missing:
        raise ConfigError(
            f"dtype 'kquant': no quantised tensor in {origin} for {missing[0]} "
            f"(and {len(missing) - 1} more); use --dtype gguf or int8-dynamic"
        )
    return len(blocks)
