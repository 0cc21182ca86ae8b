"""What each low-bit ``--dtype`` costs and how far it departs from fp32, on a real model.

For every numerics choice, one model at a time (never two copies of the 1.5B target at once):
weight bytes read per decoded token (every linear's packed weights, scales and biases, plus one
embedding row), the forward time T(k) for k new tokens over a 200-token cache (median of
repeats, k = 1, 2, 4, 8, 16) and T(k)/T(1), next-token (argmax) agreement with fp32 and the
perplexity of a fixed text (a Tiny Shakespeare excerpt and a Python function, teacher-forced).
``gguf`` is llama.cpp running the GGUF file itself (``--dtype gguf``): bytes per token are its
quantised blocks. With ``--gguf-check`` it also measures how exactly the GGUF file's own Q4_K
blocks map onto the int4 kernel's group-32 layout. Usage (one thread, pinned, as in docs/lowbit.md):

    taskset -c 1 .venv/bin/python bench/lowbit.py --model qwen2.5-coder-1.5b \\
        --dtypes float32,int8-dynamic,int8,int4,int4-g128 --threads 1 --gguf-check \\
        --out bench-out/lowbit-qwen2.5-coder-1.5b.json
    taskset -c 1 .venv/bin/python bench/lowbit.py --kernels --out bench-out/kernels-avx512.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 taskset -c 1 .venv/bin/python \\
        bench/lowbit.py --kernels --out bench-out/kernels-avx2.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import statistics
import time
from pathlib import Path

import torch

from specdec.target import ModelRunner, load_model
from specdec.target.lowbit import weight_bytes

KS = (1, 2, 4, 8, 16)
ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "data" / "corpus" / "tinyshakespeare.txt"
CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged


class LRUCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: dict[int, int] = {}

    def get(self, key: int) -> int:
        if key not in self.items:
            return -1
        value = self.items.pop(key)
        self.items[key] = value
        return value

    def put(self, key: int, value: int) -> None:
        self.items.pop(key, None)
        self.items[key] = value
        if len(self.items) > self.capacity:
            self.items.pop(next(iter(self.items)))
'''


def fixed_text() -> str:
    prose = CORPUS.read_text(encoding="utf-8")[:1800] if CORPUS.is_file() else ""
    return prose + "\n\n" + CODE


class _LlamaCppPass:
    """``--dtype gguf``: llama.cpp's pass with every row's logits (what verification runs),
    behind the two calls the measurements make."""

    def __init__(self, runner) -> None:  # noqa: ANN001 - a LlamaCppRunner
        self.runner, self.cache = runner, runner.cache

    def reset(self) -> None:
        self.runner.reset()

    def forward(self, tokens, logits_to_keep: int = 0) -> torch.Tensor:  # noqa: ANN001
        if logits_to_keep == 1:
            return self.runner.forward(tokens)
        return self.runner.forward_all(tokens)


def gguf_bytes_per_token(path: Path) -> int:
    """What llama.cpp reads per token from a GGUF: every tensor's quantised blocks, but one row
    of the token embedding (all of it when it is also the output layer: tied embeddings)."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    embd = tensors.get("token_embd.weight")
    if embd is not None and "output.weight" in tensors:
        total -= int(embd.n_bytes) - int(embd.n_bytes) // int(embd.shape[-1])
    return total


def forward_times(runner: ModelRunner | _LlamaCppPass, repeats: int) -> dict[int, float]:
    prefix = list(range(1000, 1200))
    runner.reset()
    runner.forward(prefix, logits_to_keep=1)
    times: dict[int, list[float]] = {k: [] for k in KS}
    for r in range(repeats + 1):  # interleaved, so a burst of load spreads over every k
        for k in KS:
            t0 = time.perf_counter()
            runner.forward(list(range(5, 5 + k)))
            if r:
                times[k].append(time.perf_counter() - t0)
            runner.cache.rollback(len(prefix))
    return {k: statistics.median(v) for k, v in times.items()}


def kernel_times(repeats: int, rows: range = range(1, 17)) -> dict[str, dict[int, float]]:
    """One 1536 -> 8960 projection (Qwen2.5-Coder-1.5B's gate/up) per kernel: milliseconds for
    k = 1..16 rows. Run under ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` to see an
    AVX2-only machine (torch's int4/int8 kernels and oneDNN then skip AVX-512, VNNI and AMX)."""
    from specdec.target.lowbit import DynamicInt8Linear, Int4WeightLinear, Int8WeightLinear
    from specdec.target.numerics import PackedLinear

    torch.manual_seed(0)
    ref = torch.nn.Linear(1536, 8960, bias=False)
    layers = {
        "fp32 oneDNN (float32)": PackedLinear(ref),
        "int8 x int8 oneDNN (int8-dynamic)": DynamicInt8Linear(ref),
        "int8 weight-only (int8)": Int8WeightLinear(ref),
        "int4 g32 weight-only (int4)": Int4WeightLinear(ref, 32),
        "int4 g128 weight-only (int4-g128)": Int4WeightLinear(ref, 128),
    }
    out: dict[str, dict[int, float]] = {}
    with torch.inference_mode():
        for name, layer in layers.items():
            times: dict[int, list[float]] = {k: [] for k in rows}
            for r in range(repeats + 1):
                for k in rows:
                    x = torch.randn(k, 1536)
                    t0 = time.perf_counter()
                    layer(x)
                    if r:
                        times[k].append(time.perf_counter() - t0)
            out[name] = {k: round(statistics.median(v) * 1000, 3) for k, v in times.items()}
            print(name, json.dumps(out[name]), flush=True)
    return out


def gguf_check(gguf_path: Path, loaded) -> dict[str, float | int]:
    """Max |GGUF-dequantised fp32 weight - int4 representation| over the file's Q4_K tensors:
    (a) the file's own codes with fp32 scales (exact affine map), (b) the same codes with the
    kernel's bf16 scales/zeros, (c) our own group-32 re-quantisation of the dequantised weight."""
    from gguf import GGMLQuantizationType, GGUFReader, dequantize

    from specdec.target.lowbit import q4k_to_int4, quantize_int4

    reader = GGUFReader(str(gguf_path))
    worst = {"own_codes_fp32": 0.0, "own_codes_bf16": 0.0, "requantised": 0.0}
    rel = {k: 0.0 for k in worst}
    n_q4k = n_other = 0
    for t in reader.tensors:
        if t.tensor_type != GGMLQuantizationType.Q4_K:
            n_other += 1
            continue
        n_q4k += 1
        raw = t.data  # [N, K/256*144] uint8
        want = torch.from_numpy(dequantize(raw, t.tensor_type).astype("float32"))  # [N, K]
        q, scale, zero = q4k_to_int4(raw)
        for key, (s, z) in {
            "own_codes_fp32": (scale, zero),
            "own_codes_bf16": (scale.bfloat16().float(), zero.bfloat16().float()),
        }.items():
            w = (q.float() - 8) * s.repeat_interleave(32, 1) + z.repeat_interleave(32, 1)
            d = float((w - want).abs().max())
            worst[key] = max(worst[key], d)
            rel[key] = max(rel[key], d / float(want.abs().max()))
        q2, s2, z2 = quantize_int4(want, 32)
        w2 = (q2.float() - 8) * s2.float().repeat_interleave(32, 1)
        w2 += z2.float().repeat_interleave(32, 1)
        d = float((w2 - want).abs().max())
        worst["requantised"] = max(worst["requantised"], d)
        rel["requantised"] = max(rel["requantised"], d / float(want.abs().max()))
    return {
        "q4k_tensors": n_q4k,
        "other_tensors": n_other,
        **{f"max_abs_{k}": v for k, v in worst.items()},
        **{f"max_rel_{k}": v for k, v in rel.items()},
    }


def long_pass_times(repeats: int, rows: int = 700) -> dict[str, float]:
    """A prompt's prefill through one 1536 -> 8960 projection (``rows`` rows, milliseconds):
    the low-bit layers take their dense path there (dequantise once, one matmul in
    :func:`~specdec.target.lowbit.dense_dtype`), priced against fp32 and a bf16 matmul, which
    an AVX2-only CPU emulates, and the int4 kernel run over every row."""
    from specdec.target.lowbit import Int4WeightLinear, dense_dtype

    torch.manual_seed(0)
    ref = torch.nn.Linear(1536, 8960, bias=False)
    int4 = Int4WeightLinear(ref, 32)
    w_bf16 = ref.weight.detach().bfloat16()
    x = torch.randn(rows, 1536)
    x_bf16 = x.bfloat16()
    cases = {
        "fp32 matmul": lambda: ref(x),
        "bf16 matmul": lambda: torch.nn.functional.linear(x_bf16, w_bf16),
        "int4 kernel on every row": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x_bf16, int4.packed, 32, int4.scales_and_zeros
        ),
        f"int4 dense path ({str(dense_dtype()).removeprefix('torch.')})": lambda: int4(x),
        "int4 dequantise alone": lambda: int4.dense(dense_dtype()),
    }
    out: dict[str, float] = {}
    with torch.inference_mode():
        for name, fn in cases.items():
            fn()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            out[name] = round(statistics.median(times) * 1000, 1)
            print(f"{rows} rows, {name}: {out[name]} ms", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtypes", default="float32,int8-dynamic,int8,int4,int4-g128")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gguf-check", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--kernels", action="store_true", help="only the per-kernel T(k), k=1..16")
    ap.add_argument(
        "--quality-from",
        type=Path,
        default=None,
        help="reuse agreement and perplexity from this earlier JSON (prefill, which they "
        "measure, does not change with the timing-relevant code); time only",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.kernels:
        import os

        result = {
            "isa": {
                k: os.environ.get(k, "") for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
            },
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "native_bf16_matmul": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            "threads": args.threads,
            "kernels_ms": kernel_times(max(args.repeats, 20)),
            "long_pass_700_rows_ms": long_pass_times(max(args.repeats // 2, 3)),
        }
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        return
    dtypes = args.dtypes.split(",")
    rows = []
    ref_argmax = None
    extra: dict[str, object] = {}
    for i, dtype in enumerate(dtypes):
        t0 = time.perf_counter()
        where = {"gguf" if args.model.endswith(".gguf") else "model": args.model}
        loaded = load_model(**where, dtype=dtype)
        load_s = time.perf_counter() - t0
        ids = loaded.tokenizer(fixed_text())["input_ids"]
        runner: ModelRunner | _LlamaCppPass
        if dtype == "gguf":
            from specdec.target.llamacpp import LlamaCppRunner, shared_model

            runner = _LlamaCppPass(LlamaCppRunner(shared_model(loaded.source), args.threads))
        else:
            runner = ModelRunner(loaded.model)
        times = forward_times(runner, args.repeats)
        quality = None
        if args.quality_from:
            earlier = json.loads(args.quality_from.read_text())["rows"]
            quality = next(r for r in earlier if r["dtype"] == dtype)
            argmax = ref_argmax = torch.zeros(1)
            logits = torch.zeros(1)
            nll = torch.tensor(math.log(quality["perplexity"]))
        else:
            runner.reset()
            logits = runner.forward(ids).float()  # [T, V]
            logp = torch.log_softmax(logits[:-1].double(), -1)
            nll = -logp.gather(1, torch.tensor(ids[1:])[:, None]).mean()
            argmax = logits.argmax(-1)
            if i == 0:
                ref_argmax = argmax
        assert ref_argmax is not None
        if dtype == "gguf":
            read = gguf_bytes_per_token(Path(loaded.source))
        else:
            emb = loaded.model.get_input_embeddings().weight
            read = weight_bytes(loaded.model) + emb.shape[1] * emb.element_size()
        row = {
            "dtype": dtype,
            "numerics": loaded.numerics,
            "weight_bytes_per_token": read,
            "t_ms": {k: round(v * 1000, 2) for k, v in times.items()},
            "ratio": {k: round(v / times[1], 3) for k, v in times.items()},
            "agreement_with_first": (
                quality["agreement_with_first"]
                if quality
                else float((argmax == ref_argmax).double().mean())
            ),
            "perplexity": math.exp(float(nll)),
            "text_tokens": len(ids),
            "load_s": round(load_s, 1),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.gguf_check and i == 0 and not quality:
            extra["gguf"] = gguf_check(Path(loaded.source), loaded)
            print(json.dumps(extra["gguf"]), flush=True)
        del runner, loaded, logits
        gc.collect()
    result = {
        "model": args.model,
        "threads": args.threads,
        "torch": torch.__version__,
        "reference": dtypes[0],
        "rows": rows,
        **extra,
        **({"quality_from": str(args.quality_from)} if args.quality_from else {}),
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| --dtype | bytes/token | T(1) ms | " + " | ".join(f"T({k})/T(1)" for k in KS[1:]))
    for r in rows:
        print(
            f"| {r['dtype']} | {r['weight_bytes_per_token'] / 1e9:.2f} GB | {r['t_ms'][1]:.1f} | "
            + " | ".join(f"{r['ratio'][k]:.2f}" for k in KS[1:])
            + f" | {r['agreement_with_first']:.1%} | {r['perplexity']:.2f} |"
        )


if __name__ == "__main__":
    main()
