"""The layout of a GGUF file's Q4_K super-blocks, unpacked with the ``gguf`` package.

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
