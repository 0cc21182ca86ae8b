"""Per task group, each method's speed against llama.cpp plain on the same prompts, from a
``specdec bench`` run that timed ``llamacpp``: geometric means of per-prompt tokens/s ratios,
as a markdown table (stdout) and a grouped bar chart.

    python experiments/kquant/plot_vs_llamacpp.py RESULTS.jsonl OUT.png "title"
"""

from __future__ import annotations

import collections
import json
import math
import sys
from pathlib import Path


def ratios(path: Path) -> tuple[list[str], list[str], dict[tuple[str, str], float]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    speed: dict[tuple[str, int], dict[str, float]] = collections.defaultdict(dict)
    for r in rows:
        speed[(r["group"], r["question_id"])][r["method"]] = r["tokens_per_s"]
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "llamacpp"]
    groups = [*dict.fromkeys(r["group"] for r in rows), "all"]
    out = {}
    for g in groups:
        keys = [k for k in speed if g in ("all", k[0])]
        for m in methods:
            logs = [math.log(speed[k][m] / speed[k]["llamacpp"]) for k in keys]
            out[(g, m)] = math.exp(sum(logs) / len(logs))
    return groups, methods, out


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups, methods, r = ratios(Path(sys.argv[1]))
    print("| group | " + " | ".join(f"`{m}`" for m in methods) + " |")
    print("|---|" + "---:|" * len(methods))
    for g in groups:
        print(f"| {g} | " + " | ".join(f"{r[(g, m)]:.2f}×" for m in methods) + " |")
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(groups))]
        ax.bar(xs, [r[(g, m)] for g in groups], width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("tokens/s ÷ llama.cpp plain")
    ax.set_title(sys.argv[3] if len(sys.argv) > 3 else "")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
