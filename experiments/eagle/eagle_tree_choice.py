"""What EAGLE-2's dynamic tree chooses when served, per head: the tokens per target pass it
got, the extra tokens per drafted step the kept tree predicted (Σ p over kept nodes), the nodes
kept and how many of them sit at depth 1. A head that scores better offline but serves slower
shows here whether it builds smaller trees (its served root distributions are less sure) or
builds the same trees and is accepted less (it is miscalibrated when served).

    python experiments/eagle/eagle_tree_choice.py --group qa --count 5 \\
        --head shipped=eagle --head other=eagle:dir=/path/to/head
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch

from specdec import SpeculativeEngine
from specdec.bench.workloads import load_questions, spread
from specdec.speculators.eagle import EagleSpeculator

QUESTIONS = Path(__file__).resolve().parents[3] / "shared/data/eval/spec_bench/question.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", action="append", required=True, help="NAME=SPECULATOR, repeatable")
    ap.add_argument("--questions", type=Path, default=QUESTIONS)
    ap.add_argument("--group", default="mt_bench")
    ap.add_argument("--count", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    group = [q for q in load_questions(args.questions).questions if q.group == args.group]
    picked = [group[i] for i in spread(len(group), args.count)]
    print("| head | served τ | predicted extra per step | nodes kept | depth-1 nodes |")
    print("|---|---:|---:|---:|---:|")
    original = EagleSpeculator._select
    for name, spec in (h.split("=", 1) for h in args.head):
        engine = SpeculativeEngine.from_pretrained(None, speculator=spec)
        seen: list[tuple[float, int, int]] = []

        def select(
            self: EagleSpeculator, nodes: list[Any], cap: int, context: Any, seen: list = seen
        ) -> list[int]:
            keep = original(self, nodes, cap, context)
            predicted = sum(math.exp(nodes[i].score) for i in keep)
            seen.append((predicted, len(keep), sum(nodes[i].depth == 1 for i in keep)))
            return keep

        EagleSpeculator._select = select  # type: ignore[method-assign]
        try:
            tokens = passes = 0
            for q in picked:
                messages = [{"role": "user", "content": q.prompt}]
                stats = engine.generate(messages, max_new_tokens=args.max_new_tokens).stats
                tokens += stats.new_tokens
                passes += stats.target_forwards
        finally:
            EagleSpeculator._select = original  # type: ignore[method-assign]
        n = max(len(seen), 1)
        mean = [sum(s[i] for s in seen) / n for i in range(3)]
        print(
            f"| {name} | {tokens / max(passes, 1):.2f} | {mean[0]:.2f} | {mean[1]:.1f} "
            f"| {mean[2]:.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
