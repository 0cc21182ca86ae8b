"""Measure what each ``--dtype`` costs and how far it departs from stock float32.

For every numerics choice: the forward time T(k) for k new tokens over a 200-token cache (median
of repeats, k = 1, 2, 4, 8, 16), T(k)/T(1) (what a verification pass costs in decode steps), the
largest logit difference from stock fp32, and next-token (argmax) agreement with stock fp32 on the
positions of real prompts. Usage:

    .venv/bin/python experiments/verification-cost/numerics.py [--model DIR] [--repeats 15] \\
        [--out experiments/verification-cost/numerics.md]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track

from specdec.request import encode_prompt
from specdec.target import ModelRunner, load_model
from specdec.target.numerics import NUMERICS

PROMPTS = [
    "Summarize: The city council met on Tuesday to discuss the new budget, which includes "
    "funding for parks, roads and schools. Several residents spoke against the plan.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What are the main causes of the French Revolution?",
    "Translate German to English: Der Hund spielt im Garten mit dem Ball.",
]
KS = (1, 2, 4, 8, 16)


def forward_times(runner: ModelRunner, repeats: int) -> dict[int, float]:
    prefix = list(range(1000, 1200))
    runner.reset()
    runner.forward(prefix, logits_to_keep=1)
    out = {}
    for k in KS:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.forward(list(range(5, 5 + k)))
            times.append(time.perf_counter() - t0)
            runner.cache.rollback(len(prefix))
        out[k] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    console = Console()
    ref = load_model(args.model, dtype="float32-stock")
    tok = ref.tokenizer
    prompts = [encode_prompt(tok, p, chat=True) for p in PROMPTS]
    ref_logits = [ModelRunner(ref.model).forward(p).double() for p in prompts]
    rows = []
    for name in track(list(NUMERICS), description="numerics", console=console):
        loaded = ref if name == "float32-stock" else load_model(args.model, dtype=name)
        runner = ModelRunner(loaded.model)
        times = forward_times(runner, args.repeats)
        agree = total = 0
        max_diff = 0.0
        for p, want in zip(prompts, ref_logits, strict=False):
            runner.reset()
            got = runner.forward(p).double()
            agree += int((got.argmax(-1) == want.argmax(-1)).sum())
            total += want.shape[0]
            max_diff = max(max_diff, float((got - want).abs().max()))
        rows.append((name, loaded.numerics, times, agree / total, max_diff))
        del runner
    lines = [
        f"Forward time T(k) for k new tokens over a 200-token cache, median of {args.repeats}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads.",
        "",
        "| --dtype | what runs | T(1) ms | T(2)/T(1) | T(4)/T(1) | T(8)/T(1) | T(16)/T(1) "
        "| argmax agreement with fp32 | max logit diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, desc, t, agreement, diff in rows:
        lines.append(
            f"| {name} | {desc} | {t[1] * 1000:.1f} | "
            + " | ".join(f"{t[k] / t[1]:.2f}" for k in KS[1:])
            + f" | {agreement:.1%} | {diff:.2g} |"
        )
    text = "\n".join(lines)
    console.print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
