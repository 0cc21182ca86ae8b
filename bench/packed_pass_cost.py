"""Cost of one batched verification pass by draft shape, packed against padded.

16 sequences of ``--context`` random tokens are prefilled into a packed and a padded
:class:`~specdec.batch.BatchTarget` on the bundled model; then each shape (how many nodes each
sequence brings beyond its root) is verified ``--rounds`` times, shapes interleaved, and the
median (first round dropped) is printed with the rows the pass computed. Then a newcomer's
``--chunk``-token prompt chunk: riding the 16 roots' pass as a 17th row's prefix, against the
roots' pass plus a prefill pass of its own (the scheduler's two prefill paths). Usage::

    taskset -c 0 .venv/bin/python bench/packed_pass_cost.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from specdec.batch import BatchTarget
from specdec.target import load_model
from specdec.tree import DraftTree

SHAPES = [  # (packed?, drafts per sequence)
    (True, [0] * 16),
    (True, [4] + [0] * 15),
    (False, [4] + [0] * 15),
    (True, [4] * 2 + [0] * 14),
    (True, [4] * 4 + [0] * 12),
    (True, [1] * 16),
    (True, [4] * 8 + [0] * 8),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=64)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    model = load_model()
    vocab = model.model.config.vocab_size

    def chain(k: int) -> DraftTree:
        tokens = tuple(rng.randrange(vocab) for _ in range(k + 1))
        return DraftTree(tokens=tokens, parents=tuple([-1, *range(k)]))

    targets = {packed: BatchTarget(model, packed=packed) for packed in (True, False)}
    for target in targets.values():
        for _ in range(16):
            prefill = target.start_prefill([rng.randrange(vocab) for _ in range(args.context)])
            while target.prefill_chunk(prefill, args.context) is None:
                pass
    times: dict[int, list[float]] = {i: [] for i in range(len(SHAPES))}
    rows: dict[int, int] = {}
    for _ in range(args.rounds):
        for i, (packed, shape) in enumerate(SHAPES):
            target = targets[packed]
            started = time.perf_counter()
            target.verify([chain(k) for k in shape])
            times[i].append(time.perf_counter() - started)
            rows[i] = target.last_rows
            target.commit([[0]] * 16)  # keep the roots only: contexts stay put
    print("| pass | rows computed | ms |\n|---|---|---|")
    for i, (packed, shape) in enumerate(SHAPES):
        drafting = sum(1 for k in shape if k)
        label = f"{drafting} sequences draft {max(shape)}" if drafting else "16 roots, no drafts"
        label += "" if packed else ", padded"
        print(f"| {label} | {rows[i]} | {statistics.median(times[i][1:]) * 1000:.0f} |")
    target = targets[True]
    fused: list[float] = []
    apart: list[float] = []
    for _ in range(args.rounds):
        prompt = [rng.randrange(vocab) for _ in range(args.chunk + 1)]
        row = target.attach(target.start_prefill(prompt))
        started = time.perf_counter()
        target.verify([chain(0) for _ in range(16)] + [None], [[]] * 16 + [prompt[:-1]])
        fused.append(time.perf_counter() - started)
        target.commit([[0]] * 16 + [None])
        target.remove(row)
        started = time.perf_counter()
        target.verify([chain(0) for _ in range(16)])
        prefill = target.start_prefill(prompt)
        row = target.prefill_chunk(prefill, args.chunk)
        apart.append(time.perf_counter() - started)
        target.commit([[0]] * 16)
        assert row is not None
        target.remove(row)
    print(
        f"| 16 roots + a {args.chunk}-token prompt chunk, one pass | {16 + args.chunk} | "
        f"{statistics.median(fused[1:]) * 1000:.0f} |"
    )
    print(
        f"| 16 roots, then the chunk in a pass of its own | 16 + {args.chunk} | "
        f"{statistics.median(apart[1:]) * 1000:.0f} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
