"""How fast could *any* lossless speculative mode be against llama.cpp plain decoding here?

    python experiments/llamacpp/llamacpp_bound.py --target qwen2.5-coder-1.5b \
        --draft qwen2.5-coder-0.5b [--threads 2] [--reps 15] [--out DIR]

Speculation commits E tokens per round for the price of one verification of K+1 tokens plus K
draft tokens. Timing llama.cpp's own kernels on this machine (the fastest we have for these
GGUF blocks), T(k) for the target and one draft token's cost c (in target steps), bounds every
engine that verifies with them, llama.cpp's speculative mode included:

    speedup(K, a) = E(K, a) / (T(K+1)/T(1) + K*c),    E = (1 - a^(K+1)) / (1 - a)

for a chain of K drafts, each accepted with probability a given the ones before. The table
gives the best K at each a, for the draft's measured price and for a free draft (prompt lookup,
suffix). Timings alternate target and draft passes of each size so that drift in the machine's
speed hits both alike; each is the median of ``--reps``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from specdec.target.llamacpp import LlamaCppRunner, LlamaModel
from specdec.target.packs import is_pack, pack_gguf

SIZES = (1, 2, 3, 4, 5, 6, 8)
ACCEPTANCE = (0.6, 0.7, 0.8, 0.82, 0.9, 0.95, 1.0)


def timer(runner: LlamaCppRunner):
    """A function timing one decode of k tokens (logits for all k), rolled back after."""
    lib = runner._lib

    def once(k: int) -> float:
        base = len(runner.cache)
        batch = lib.llama_batch_init(k, 0, 1)
        try:
            for i in range(k):
                batch.token[i], batch.pos[i] = 2000 + i, base + i
                batch.n_seq_id[i], batch.logits[i] = 1, 1
                batch.seq_id[i][0] = 0
            batch.n_tokens = k
            t0 = time.perf_counter()
            if lib.llama_decode(runner.ctx, batch) != 0:
                raise RuntimeError("llama.cpp decode failed")
            for i in range(k):  # what a verifier reads: every row's logits
                ptr = lib.llama_get_logits_ith(runner.ctx, i)
                np.ctypeslib.as_array(ptr, shape=(runner.vocab_size,)).copy()
            return time.perf_counter() - t0
        finally:
            lib.llama_batch_free(batch)
            runner._remove_from(base)

    return once


def speedup(k: int, a: float, t: dict[int, float], c: float) -> float:
    expected = k + 1 if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
    return expected / (t[k + 1] / t[1] + k * c)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--context", type=int, default=300, help="tokens in the cache first")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    runners = {}
    for role, name in (("target", args.target), ("draft", args.draft)):
        path = pack_gguf(name) if is_pack(name) else Path(name)
        runners[role] = LlamaCppRunner(LlamaModel(path), threads=args.threads)
        runners[role].forward(list(range(1000, 1000 + args.context)))
    times: dict[str, dict[int, list[float]]] = {r: {k: [] for k in SIZES} for r in runners}
    timers = {r: timer(x) for r, x in runners.items()}
    for r in timers:
        timers[r](1)  # warm-up
    for _ in range(args.reps):
        for k in SIZES:
            for r in timers:
                times[r][k].append(timers[r](k))
    med = {r: {k: statistics.median(v) for k, v in per.items()} for r, per in times.items()}
    t, c = med["target"], med["draft"][1] / med["target"][1]

    lines = [
        f"target {args.target}, draft {args.draft}, {args.threads} threads, cache "
        f"{args.context} tokens, median of {args.reps}",
        "",
        "| k | target T(k) ms | T(k)/T(1) | draft ms |",
        "|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {k} | {t[k] * 1e3:.1f} | {t[k] / t[1]:.2f} | {med['draft'][k] * 1e3:.1f} |"
        for k in SIZES
    ]
    lines += [
        "",
        f"one draft token costs c = {c:.2f} target steps",
        "",
        "| acceptance a | best with this draft (K) | best with a free draft (K) |",
        "|---:|---:|---:|",
    ]
    ks = [k for k in SIZES if k + 1 in t]
    rows = []
    for a in ACCEPTANCE:
        paid = max((speedup(k, a, t, c), k) for k in ks)
        free = max((speedup(k, a, t, 0.0), k) for k in ks)
        rows.append({"a": a, "paid": paid, "free": free})
        lines.append(f"| {a:.2f} | {paid[0]:.2f}× ({paid[1]}) | {free[0]:.2f}× ({free[1]}) |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bound.md").write_text(report)
        doc = {"args": vars(args) | {"out": str(args.out)}, "median_seconds": med,
               "draft_cost": c, "bound": rows, "samples": times}  # fmt: skip
        (args.out / "bound.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
