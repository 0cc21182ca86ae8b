"""The layout of a GGUF file's quantised blocks, unpacked with the ``gguf`` package's help.

Below every kernel that reads a GGUF file's own codes: torch's int4 layout
(:func:`specdec.target.lowbit.q4k_to_int4`) and specdec's Q4_K kernel
(:func:`specdec.target.kquant.q4k_parts`) both start from :func:`q4k_fields`.
"""

from __future__ import annotations

import numpy as np

Q4_K_BLOCK_BYTES = 144  # a 256-weight super-block: fp16 d and dmin, 12 B of scales, 128 of codes


def q4k_fields(
    blocks: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_K tensor's super-blocks, unpacked: ``d``, ``dmin`` ``[B]`` fp16, ``sc``, ``m``
    ``[B, 8]`` (6-bit, through the gguf package's own unpacking) and the codes ``[B, 256]``
    in weight order. ``blocks``: the tensor's bytes, any shape holding whole blocks."""
    from gguf.quants import Q4_K

    b = np.ascontiguousarray(blocks).reshape(-1, Q4_K_BLOCK_BYTES)
    d = b[:, 0:2].copy().view(np.float16)[:, 0]
    dmin = b[:, 2:4].copy().view(np.float16)[:, 0]
    sc, m = Q4_K.get_scale_min(b[:, 4:16])
    qs = b[:, 16:].reshape(-1, 4, 1, 32)  # 4 chunks of 32 bytes: 64 weights each
    codes = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    return d, dmin, sc.reshape(-1, 8), m.reshape(-1, 8), codes.reshape(-1, 256)


Q5_K_BLOCK_BYTES = 176  # fp16 d and dmin, 12 B of scales, 32 B of high bits, 128 B of low nibbles


def q5k_fields(
    blocks: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`q4k_fields` for Q5_K: the same scales and mins, 5-bit codes ``[B, 256]``
    (the low nibbles as in Q4_K; bit ``2j`` / ``2j + 1`` of high byte ``l`` is the fifth bit of
    weight ``64 j + l`` / ``64 j + 32 + l``)."""
    from gguf.quants import Q4_K

    b = np.ascontiguousarray(blocks).reshape(-1, Q5_K_BLOCK_BYTES)
    d = b[:, 0:2].copy().view(np.float16)[:, 0]
    dmin = b[:, 2:4].copy().view(np.float16)[:, 0]
    sc, m = Q4_K.get_scale_min(b[:, 4:16])
    qh = b[:, 16:48].reshape(-1, 1, 1, 32)
    qs = b[:, 48:].reshape(-1, 4, 1, 32)
    low = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    shifts = (2 * np.arange(4).reshape(1, 4, 1, 1) + np.arange(2).reshape(1, 1, 2, 1)).astype(
        np.uint8
    )
    high = (qh >> shifts) & 1  # [B, 4, 2, 32]
    codes = low | (high << 4)
    return d, dmin, sc.reshape(-1, 8), m.reshape(-1, 8), codes.reshape(-1, 256)


# the 32-weight blocks: bytes, whether they carry an fp16 min after d, bits of the codes
SMALL_BLOCKS = {
    "Q4_0": (18, False, 4),
    "Q4_1": (20, True, 4),
    "Q5_0": (22, False, 5),
    "Q5_1": (24, True, 5),
    "Q8_0": (34, False, 8),
}


def small_block_fields(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A 32-weight-block tensor (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) as unsigned codes ``[B, 32]``
    in weight order and fp16 ``d``, ``m`` ``[B]`` with ``w = d * code + m`` exactly: the
    signed kinds' offsets (-8, -16, -128 times d) are powers of two, so ``m`` is exact in fp16.
    """
    size, has_min, bits = SMALL_BLOCKS[kind]
    b = np.ascontiguousarray(blocks).reshape(-1, size)
    d = b[:, 0:2].copy().view(np.float16)[:, 0]
    if bits == 8:
        codes = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        m = d * np.float16(-128)
        return codes, d, _exact_offset(d, m, 128)
    at = 4 if has_min else 2
    qh = None
    if bits == 5:
        qh = b[:, at : at + 4].copy().view("<u4")[:, 0]
        at += 4
    qs = b[:, at : at + 16]
    codes = np.concatenate([qs & 0x0F, qs >> 4], 1)  # weights 0-15 low nibbles, 16-31 high
    if qh is not None:
        bit = ((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        codes = (codes | (bit << 4)).astype(np.uint8)
    if has_min:
        m = b[:, 2:4].copy().view(np.float16)[:, 0]
        return codes, d, m
    offset = 1 << (bits - 1)
    return codes, d, _exact_offset(d, d * np.float16(-offset), offset)


def _exact_offset(d: np.ndarray, m: np.ndarray, offset: int) -> np.ndarray:
    if not np.array_equal(m.astype(np.float64), -offset * d.astype(np.float64), equal_nan=True):
        raise ValueError("a block scale too large to hold its offset in fp16")
    return m
