"""The learning-curve plot of experiments/eagle/2026-12-05-eagle3-first-turns.md (figures from
its tables).

    python experiments/eagle/eagle-heads-first-turns/learning_curve.py

Dashed lines extend the last doubling's rate, the extrapolation the page quotes.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend choice

HELD_OUT = [(2253, 1.70), (4554, 1.974), (9454, 2.152)]  # each head's held-out ShareGPT answers
MT_BENCH = [(4554, 1.654), (9454, 1.748)]  # the target's answers to 16 mt_bench questions
SHAREGPT_USER_TURNS = 61_420


def main() -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4))
    series = (
        (HELD_OUT, "held-out ShareGPT answers"),
        (MT_BENCH, "mt_bench answers (never trained on)"),
    )
    for points, label in series:
        x, y = zip(*points, strict=True)
        (line,) = ax.plot(x, y, "o-", label=label)
        slope = (y[-1] - y[-2]) / math.log2(x[-1] / x[-2])
        xs = [x[-1] * 2 ** (k / 4) for k in range(37)]
        ys = [y[-1] + slope * math.log2(v / x[-1]) for v in xs]
        ax.plot(xs, ys, "--", color=line.get_color(), alpha=0.5)
    ax.axhline(2.5, color="grey", lw=0.8)
    ax.text(1.2e5, 2.44, "target τ 2.5", color="grey", fontsize=8)
    ax.axvline(SHAREGPT_USER_TURNS, color="grey", lw=0.8, ls=":")
    ax.text(66000, 2.62, "all ShareGPT\nuser turns", color="grey", fontsize=8)
    ax.set_xscale("log")
    ax.set_ylim(1.6, 2.7)
    ax.set_xlim(2000, 5e6)
    ax.set_xlabel("self-distilled answers trained on")
    ax.set_ylabel("EAGLE-3 chain τ (3 steps, offline)")
    ax.set_title("EAGLE-3 head for SmolLM2-135M (dashed: last doubling's rate)", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(Path(__file__).with_name("learning-curve.png"), dpi=110)


if __name__ == "__main__":
    main()
