"""The table and plot of a crossvocab_vs_uag.py run: per Spec-Bench group, each method's
tokens/s over plain decoding's (geometric mean over the group's prompts), and ours over HF's
universal assisted generation.

    python experiments/crossvocab/plot_uag.py results.jsonl out.png "title" > table.md
"""

import json
import math
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src, png, title = sys.argv[1], sys.argv[2], sys.argv[3]
rows = [json.loads(line) for line in open(src)]
empty = [r["id"] for r in rows if r["plain"]["tok_s"] == 0]  # the target ended at once
rows = [r for r in rows if r["plain"]["tok_s"] > 0]
names = [k for k, v in rows[0].items() if isinstance(v, dict) and k != "plain"]


def geo(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


groups = defaultdict(list)
for r in rows:
    groups[r["category"]].append(r)
groups["all"] = rows
table = {
    g: {n: geo([r[n]["tok_s"] / r["plain"]["tok_s"] for r in rs]) for n in names}
    for g, rs in groups.items()
}
ours = "cross-vocab draft"
print("| group (prompts) | plain tok/s | " + " | ".join(f"{n} ÷ plain" for n in names)
      + f" | {ours} ÷ HF UAG | identical |")
print("|---|---:|" + "---:|" * len(names) + "---:|---:|")
for g, rs in groups.items():
    same = sum(r[n]["ids"] == r["plain"]["ids"] for r in rs for n in names)
    plain = geo([r["plain"]["tok_s"] for r in rs])
    vs = geo([r[ours]["tok_s"] / r["HF UAG"]["tok_s"] for r in rs])
    print(f"| {g} ({len(rs)}) | {plain:.1f} | "
          + " | ".join(f"{table[g][n]:.2f}×" for n in names)
          + f" | **{vs:.2f}×** | {same}/{len(rs) * len(names)} |")
if empty:
    print(f"\nLeft out (the target's first token was its end of sequence): prompts {empty}")
fig, ax = plt.subplots(figsize=(9, 4))
width = 0.8 / len(names)
for i, n in enumerate(names):
    xs = [j + i * width for j in range(len(groups))]
    ax.bar(xs, [table[g][n] for g in groups], width, label=n)
ax.axhline(1.0, color="k", lw=0.8)
ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(groups))], list(groups))
ax.set_ylabel("tokens/s ÷ plain decoding")
ax.set_title(title)
ax.legend()
fig.tight_layout()
fig.savefig(png, dpi=120)
