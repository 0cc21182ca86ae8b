"""Per-group speed against llama.cpp plain of the catch-up pricing A/B (catch_up_ab.py's JSONL):
geometric means by Spec-Bench group, one bar per method.

    .venv/bin/python experiments/auto/plot_catch_up.py RESULTS.jsonl OUT.png
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    rows = [json.loads(line) for line in open(sys.argv[1])]
    by_q: dict[object, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        by_q[r["question_id"]][r["method"]] = r
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "llamacpp"]
    groups = list(dict.fromkeys(r["group"] for r in rows)) + ["all"]
    logs: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rs in by_q.values():
        ref = rs["llamacpp"]["new_tokens"] / rs["llamacpp"]["seconds"]
        for m in methods:
            ratio = rs[m]["new_tokens"] / rs[m]["seconds"] / ref
            logs[m][rs[m]["group"]].append(math.log(ratio))
            logs[m]["all"].append(math.log(ratio))
    fig, ax = plt.subplots(figsize=(9, 3.6))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        values = [math.exp(sum(logs[m][g]) / len(logs[m][g])) for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], values, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(groups))], groups)
    ax.set_ylabel("tokens/s ÷ llama.cpp plain")
    ax.set_ylim(0.8, 1.3)
    ax.legend(ncol=len(methods), fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
