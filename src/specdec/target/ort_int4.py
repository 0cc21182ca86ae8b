"""``--dtype int4-ort``: 4-bit weights and 8-bit activation blocks through onnxruntime's MLAS
kernels (the ``MatMulNBits`` operator), one session per linear layer.

Why another int4: torch's own CPU int4 kernel (``--dtype int4``) unpacks nibbles into bf16
and is compute-bound on an AVX2-only CPU, reading its weights far below memory speed, where
llama.cpp multiplies the same 4-bit blocks by 8-bit activation blocks with integer dot
products. MLAS does the same (``accuracy_level=4``: each 32-weight block's activations rounded
to int8 with their own scale, integer dot products, fp32 block sums) and runs a row in a
fraction of torch's time (docs/lowbit.md, ``int4-ort``). It is a maintained library
(onnxruntime's CPU kernels, with AVX2, AVX-512 and ARM paths) rather than a kernel of ours.

Lossless under these numerics needs every output row to be computed from its own input row in
the same order whatever the number of rows in the call (see :mod:`specdec.target.lowbit`).
MLAS runs a single row through a GEMV kernel whose block sums are ordered differently from its
multi-row kernel (up to 1e-6 apart), and all multi-row calls agree with each other bit for bit
(measured for 2..64 rows, one and two threads; ``tests/test_lowbit.py``). So a one-row call
runs as two copies of the row and keeps the first: the multi-row kernel is the only one ever
used, and on two threads the two-row call is also faster than the one-row one (the GEMV path
runs on one thread).

Weights: asymmetric 4-bit codes per 32 input weights with an fp32 scale and a 4-bit zero point
(``w = (q - zp) * scale``), rounded once from the fp32 weight; each session prepacks them into
its own layout. Threads: every session shares one onnxruntime pool sized from torch's thread
count when the first layer is built, and torch's own ops run on one thread during the model's
forward (:func:`torch_single_threaded`), so the pool's spinning workers and torch's never fight
over the same cores (see :func:`_global_pool`).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import torch
from torch import nn

from specdec.errors import ConfigError

GROUP = 32
ACCURACY_LEVEL = 4  # int8 activation blocks (MLAS "CompInt8"); 0/1 would compute in fp32
INSTALL_HINT = "pip install 'specdec[ort]' (onnxruntime and onnx)"


def ort_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("onnxruntime", "onnx"))


def require_ort() -> None:
    """A clear error, before any weight is touched, where onnxruntime is not installed."""
    if not ort_available():
        raise ConfigError(
            f"dtype 'int4-ort' runs onnxruntime's int4 kernels, which are not installed here: "
            f"{INSTALL_HINT}; or use --dtype int4 (torch's own int4 kernel)"
        )


def quantize_blocks(weight: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric 4-bit codes per ``GROUP`` input weights in MatMulNBits' layout.

    Returns packed codes ``[N, K/G, G/2]`` (low nibble first), fp32 scales ``[N * K/G]`` and
    packed 4-bit zero points ``[N * ceil(K/G / 2)]`` (``w ~= (q - zp) * scale``).

    >>> codes, scales, zeros = quantize_blocks(torch.linspace(-1.0, 2.0, 32).reshape(1, 32))
    >>> codes.shape, scales.shape, zeros.shape, round(float(scales[0]), 4), int(zeros[0] & 15)
    ((1, 1, 16), (1,), (1,), 0.2, 5)
    """
    n, k = weight.shape
    wg = weight.detach().float().reshape(n, k // GROUP, GROUP)
    lo = wg.amin(-1).clamp_max(0.0)  # the range holds 0, so zero maps to a code exactly
    hi = wg.amax(-1).clamp_min(0.0)
    scale = ((hi - lo) / 15).clamp_min(1e-10)  # [N, K/G]
    zp = torch.round(-lo / scale).clamp_(0, 15)
    q = (torch.round(wg / scale[..., None]) + zp[..., None]).clamp_(0, 15).to(torch.uint8)
    codes = (q[..., 0::2] | (q[..., 1::2] << 4)).numpy()  # [N, K/G, G/2]
    zq = zp.to(torch.uint8)
    if zq.shape[1] % 2:
        zq = torch.cat([zq, torch.zeros(n, 1, dtype=torch.uint8)], 1)
    zeros = (zq[:, 0::2] | (zq[:, 1::2] << 4)).reshape(-1).numpy()
    return np.ascontiguousarray(codes), scale.reshape(-1).numpy().copy(), zeros.copy()


_POOL: list[int] = []  # the size of this process's onnxruntime thread pool, once created


def _global_pool() -> None:
    """One onnxruntime thread pool for every session of the process, sized from torch's thread
    count when the first int4-ort layer is built (it cannot be resized afterwards).

    Why one: a pool per session with spinning workers (onnxruntime's default) made a forward
    many times slower, every idle pool's worker spinning on the core the next session needs;
    pools per session whose workers sleep were better, and this shared pool with torch itself on
    one thread during the forward (see :func:`torch_single_threaded`) the fastest of the three
    (the timings: docs/lowbit.md, "Threads, and where a step goes")."""
    import onnxruntime as ort
    from onnxruntime.capi import _pybind_state

    if not _POOL:
        threads = max(1, torch.get_num_threads())
        _pybind_state.set_global_thread_pool_sizes(threads, 1)
        ort.get_available_providers()  # creates the environment with that pool
        _POOL.append(threads)


def _session(k: int, n: int, codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    _global_pool()
    node = helper.make_node(
        "MatMulNBits",
        ["A", "B", "scales", "zero_points"],
        ["Y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=GROUP,
        accuracy_level=ACCURACY_LEVEL,
    )
    graph = helper.make_graph(
        [node],
        "linear",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
        initializer=[
            numpy_helper.from_array(codes, "B"),
            numpy_helper.from_array(scales, "scales"),
            numpy_helper.from_array(zeros, "zero_points"),
        ],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
        ir_version=onnx.IR_VERSION,
    )
    options = ort.SessionOptions()
    options.use_per_session_threads = False
    options.log_severity_level = 3
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def torch_single_threaded(model: nn.Module) -> None:
    """Run torch's own ops (attention, norms, rotary embeddings: small at decoding sizes) on
    one thread during ``model``'s forward, then restore the caller's count. The onnxruntime
    pool's workers spin between calls; torch's OpenMP workers spinning on the same cores made
    the forward much slower (docs/lowbit.md, "Threads, and where a step goes")."""
    saved: list[int] = []

    def pre(module: nn.Module, args: object) -> None:
        saved.append(torch.get_num_threads())
        if saved[-1] != 1:
            torch.set_num_threads(1)

    def post(module: nn.Module, args: object, output: object) -> None:
        threads = saved.pop() if saved else 1
        if threads != 1:
            torch.set_num_threads(threads)

    model.register_forward_pre_hook(pre)
    model.register_forward_hook(post, always_call=True)


class OrtInt4Linear(nn.Module):
    """An ``nn.Linear`` as onnxruntime's MatMulNBits (int4 weights, int8 activation blocks);
    see the module doc for why single rows run as two."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        require_ort()
        _global_pool()  # sized now, from the caller's thread count (a forward runs torch on one)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.codes, self.scales, self.zeros = quantize_blocks(linear.weight)
        # a copy: a view would keep the memory-mapped checkpoint resident
        self.bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self._sess: Any = None  # built on first use: loading stays quick, a session per layer

    def _run(self, x2: np.ndarray) -> np.ndarray:
        if self._sess is None:
            self._sess = _session(
                self.in_features, self.out_features, self.codes, self.scales, self.zeros
            )
        return self._sess.run(None, {"A": x2})[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float().contiguous()
        rows = x2.shape[0]
        a = x2.numpy()
        if rows == 1:  # the multi-row kernel, as every verification pass runs it
            a = np.concatenate([a, a])
        y = torch.from_numpy(self._run(a)[:rows])
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the kernel multiplies by, ``[N, K]`` (its activations are rounded too)."""
        n, k = self.out_features, self.in_features
        c = torch.from_numpy(self.codes)
        q = torch.stack([c & 15, c >> 4], -1).reshape(n, k // GROUP, GROUP).float()
        zq = torch.from_numpy(self.zeros)
        zp = torch.stack([zq & 15, zq >> 4], -1).reshape(n, -1)[:, : k // GROUP].float()
        s = torch.from_numpy(self.scales).reshape(n, k // GROUP)
        return ((q - zp[..., None]) * s[..., None]).reshape(n, k).to(dtype)

    def weight_bytes(self) -> int:
        return (
            self.codes.nbytes
            + self.scales.nbytes
            + self.zeros.nbytes
            + (0 if self.bias is None else self.bias.numel() * 4)
        )
