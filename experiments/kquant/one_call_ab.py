"""A/B of the one-call decoder layer (``lean_layer``) against the same lean layer run from
Python, interleaved in one process: the time of a k-row pass over a 200-token cache (then rolled
back), medians of four alternations of 30 passes each.

    taskset -c 0,1 .venv/bin/python experiments/kquant/one_call_ab.py [MODEL] [THREADS]

MODEL: a pack alias or path (default: the bundled SmolLM2-135M); THREADS default 2. The Python
path is forced by making the lean layer's :func:`in_place` answer ``None`` (what a full buffer
gets).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import specdec.target.kquant_layers as lean
from specdec.target import ModelRunner, load_model


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else ""
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    loaded = load_model(model or None, dtype="kquant")
    runner = ModelRunner(loaded.model)
    runner.forward(list(range(100, 300)))
    in_place = lean.in_place

    def passes(n: int, k: int) -> None:
        for i in range(n):
            runner.forward([500 + (i + j) % 7 for j in range(k)], logits_to_keep=1)
        runner.cache.rollback(200)

    for k in (1, 4):
        times: dict[str, list[float]] = {"python": [], "one-call": []}
        for _ in range(4):
            for mode in times:
                lean.in_place = (lambda layer, t: None) if mode == "python" else in_place  # type: ignore[assignment]
                passes(3, k)
                t = time.perf_counter()
                passes(30, k)
                times[mode].append((time.perf_counter() - t) / 30 * 1e3)
        med = {m: statistics.median(v) for m, v in times.items()}
        print(f"{model or 'bundled'} k={k}: python {med['python']:.2f} ms, one call "
              f"{med['one-call']:.2f} ms ({med['python'] / med['one-call']:.3f}x)")  # fmt: skip
    lean.in_place = in_place  # type: ignore[assignment]


if __name__ == "__main__":
    main()
