"""A/B of an EAGLE drafter's CPU linears: fp16 weights (fbgemm) against Q8_0 blocks through
specdec's kernel (the default since this change), one engine each on one loaded target,
the arms' order alternated per prompt; greedy, both identical to plain decoding by construction.

    python experiments/eagle/q8_head_ab.py [N_PROMPTS] [MAX_NEW] [MODEL] [EAGLE_SPEC]

Prompts: the first N MT-bench questions of Spec-Bench (first turns). Prints tok/s, tau and
draft seconds per token for each arm, and their ratio.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

import specdec.heads.eagle as eagle_heads
from specdec.engine import SpeculativeEngine
from specdec.target import load_model
from specdec.target.numerics import Fp16WeightLinear

SPEC = Path(__file__).resolve().parents[3] / "shared" / "data" / "eval" / "spec_bench"


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    max_new = int(sys.argv[2]) if len(sys.argv) > 2 else 96
    model = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] else None
    spec = sys.argv[4] if len(sys.argv) > 4 else "eagle"
    rows = [json.loads(x) for x in (SPEC / "question.jsonl").read_text().splitlines()]
    prompts = [r["turns"][0] for r in rows if 81 <= r["question_id"] <= 160][:n]
    loaded = load_model(model)
    q8 = SpeculativeEngine.from_pretrained(loaded, speculator=spec)
    real = eagle_heads.cpu_linear_maker
    eagle_heads.cpu_linear_maker = lambda: Fp16WeightLinear  # type: ignore[assignment]
    try:
        fp16 = SpeculativeEngine.from_pretrained(loaded, speculator=spec)
    finally:
        eagle_heads.cpu_linear_maker = real
    arms = {"fp16": fp16, "q8": q8}
    stats: dict[str, list[tuple[float, float, float]]] = {k: [] for k in arms}
    for i, p in enumerate(prompts):
        outs = {}
        order = list(arms.items()) if i % 2 == 0 else list(arms.items())[::-1]
        for name, eng in order:
            r = eng.generate(p, max_new_tokens=max_new, chat=True)
            s = r.stats
            outs[name] = r.token_ids
            stats[name].append(
                (s.new_tokens / s.seconds, s.mean_accepted, s.draft_seconds / max(s.new_tokens, 1))
            )
        assert outs["fp16"] == outs["q8"], "greedy outputs differ"
        print(" ".join(f"{k} {v[-1][0]:.1f} tok/s tau {v[-1][1]:.2f}" for k, v in stats.items()))
    for k, v in stats.items():
        tok = statistics.geometric_mean([x[0] for x in v])
        print(f"{k}: {tok:.2f} tok/s (geo mean), tau {statistics.mean(x[1] for x in v):.2f}, "
              f"draft {1000 * statistics.mean(x[2] for x in v):.2f} ms per new token")  # fmt: skip
    pairs = zip(stats["q8"], stats["fp16"], strict=True)
    ratio = statistics.geometric_mean([a[0] / b[0] for a, b in pairs])
    print(f"q8 / fp16: {ratio:.3f}x over {len(prompts)} prompts, threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
