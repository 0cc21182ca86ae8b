"""Verification cost of token trees on this machine: T(n) for an n-node tree (4D tree mask,
explicit positions) and for an n-token chain (the model's causal fast path), over a 200-token
cache, median of repeats, as ratios to one decode step T(1). This is what decides how large a
Medusa/EAGLE tree can be before verifying it costs more than it gains. Usage:

    .venv/bin/python experiments/verification-cost/tree_cost.py [--repeats 9] \\
        [--out experiments/verification-cost/tree_cost.md]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specdec.target import ModelRunner, load_model
from specdec.tree import DraftTree
from specdec.tree.topology import load_topology, tree_from_topology

SIZES = (1, 4, 8, 16, 24, 32, 48, 64)


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    loaded = load_model(None)
    runner = ModelRunner(loaded.model)
    prefix = list(range(1000, 1200))
    runner.forward(prefix, logits_to_keep=1)
    topology = load_topology("sparse-64", 4)
    ranked = [list(range(100 + 10 * d, 110 + 10 * d)) for d in range(4)]
    rows = []
    for n in SIZES:
        tree = tree_from_topology(7, topology, ranked, budget=n - 1)
        chain = DraftTree.chain(7, list(range(20, 20 + n - 1)))

        def run(t: DraftTree = tree) -> None:
            runner.forward_tree(t)
            runner.cache.rollback(len(prefix))

        def run_chain(t: DraftTree = chain) -> None:
            runner.forward_tree(t)
            runner.cache.rollback(len(prefix))

        rows.append((n, timed(run, args.repeats), timed(run_chain, args.repeats)))
    t1 = rows[0][2]
    lines = [
        f"Verification cost over a 200-token cache; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {loaded.numerics}; median of {args.repeats}.",
        "",
        "| nodes n | tree T(n) ms | tree T(n)/T(1) | chain T(n) ms | chain T(n)/T(1) |",
        "|---|---|---|---|---|",
    ]
    for n, tt, tc in rows:
        lines.append(f"| {n} | {tt * 1e3:.1f} | {tt / t1:.2f} | {tc * 1e3:.1f} | {tc / t1:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
