"""The bar chart of 2026-12-06-kquant-default.md from its table (figures typed in from the runs
that page lists)."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RUNS = {  # tok/s: ours plain, ours speculative, llama.cpp plain (same file, same run)
    "Qwen 1.5B + 0.5B draft\n(README main job)": (24.01, 31.35, 24.59),
    "bundled 135M, prompt lookup\n(README summary)": (51.97, 78.27, 63.98),
}
fig, ax = plt.subplots(figsize=(7, 3.6))
width = 0.26
for i, (name, values) in enumerate(RUNS.items()):
    for j, (label, v) in enumerate(
        zip(("specdec plain", "specdec speculative", "llama.cpp plain"), values, strict=True)
    ):
        ax.bar(i + (j - 1) * width, v, width, label=label if i == 0 else None,
               color=("#9ecae1", "#3182bd", "#fdae6b")[j])
        ax.text(i + (j - 1) * width, v + 1, f"{v:.1f}", ha="center", fontsize=8)
ax.set_xticks(range(len(RUNS)), list(RUNS))
ax.set_ylabel("tokens/s (greedy, 2 threads)")
ax.set_title("--dtype auto (the file's own blocks), 2-core Zen 4 EPYC")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(Path(__file__).with_name("data") / "2026-12-06-kquant-default.png", dpi=110)
