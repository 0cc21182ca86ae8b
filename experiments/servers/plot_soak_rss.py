"""RSS of the pair's server over a 500-request soak (bench/batching.py's report.json), before
and after the llama.cpp draft context was freed with its request.

    python experiments/servers/plot_soak_rss.py before/report.json after/report.json out.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots(figsize=(7, 3.5))
for path, label in zip(sys.argv[1:3], ("before (runner and cache a cycle)", "after (weak)")):
    series = json.load(open(path))["soak"]["rss_series_mb"]
    ax.plot(range(len(series)), [m / 1024 for m in series], label=label)
ax.set_xlabel("seconds into the soak")
ax.set_ylabel("server RSS, GB")
ax.set_title("Qwen 1.5B + 0.5B draft server, 500 requests, 16 clients, 1/3 hung up")
ax.grid(alpha=0.3)
ax.legend()
fig.tight_layout()
fig.savefig(sys.argv[3], dpi=120)
