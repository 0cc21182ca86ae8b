"""Verification cost over llama.cpp with the last row's logits against every row's.

A verification pass of k tokens needs every row's logits; ``llama-bench`` times passes that
compute only the last. The difference is the output matrix, run once per requested row. Prints
T(k)/T(1) for both, medians of alternating rounds over a 200-token cache:

    .venv/bin/python experiments/llamacpp/llamacpp_rows.py --model qwen2.5-coder-1.5b --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specdec.target.llamacpp import LlamaCppRunner, shared_model
from specdec.target.packs import pack_gguf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--gguf", nargs="*", default=[], help="GGUF files timed beside --model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="1,2,3,4,8")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    files = [(args.model, pack_gguf(args.model))] + [(Path(g).name, Path(g)) for g in args.gguf]
    runners = {name: LlamaCppRunner(shared_model(path), args.threads) for name, path in files}
    sizes = [int(x) for x in args.sizes.split(",")]
    times: dict[tuple[str, int, str], list[float]] = {}
    for runner in runners.values():
        runner.forward(list(range(1000, 1200)))
    for _ in range(args.rounds):  # files, sizes and modes alternate within each round
        for name, runner in runners.items():
            for k in sizes:
                for how, call in (("last", runner.forward), ("all", runner.forward_all)):
                    runner.cache.rollback(200)
                    t0 = time.perf_counter()
                    call(list(range(300, 300 + k)))
                    times.setdefault((name, k, how), []).append(time.perf_counter() - t0)
    for name in runners:
        t1 = statistics.median(times[(name, 1, "last")])
        print(f"\n{name}: T(1) = {t1 * 1000:.1f} ms ({args.threads} threads)")
        print("| tokens | last row's logits | every row's logits |")
        print("|---|---|---|")
        for k in sizes:
            last, every = (statistics.median(times[(name, k, h)]) / t1 for h in ("last", "all"))
            print(f"| {k} | {last:.2f} | {every:.2f} |")


if __name__ == "__main__":
    main()
