"""Summaries of step_log.py's files: total time, the step time each decoding sequence waited
(every emitting step counted once per sequence it emitted for; the first, all-prompt pack of
1,024 tokens left out, as it is before any first token) at p50/p90/p99, and the mean time and
rows of steps with and without prompt tokens.

    python experiments/servers/step_stats.py steps.json [more.json ...]
"""

import json
import sys

import numpy as np

for path in sys.argv[1:]:
    steps = json.load(open(path))
    waits = []
    for s in steps:
        if s["batch"] > 0 and s["prefill"] < 1000:
            waits += [s["seconds"]] * s["batch"]
    total = sum(s["seconds"] for s in steps)
    pre = [s for s in steps if 0 < s["prefill"] < 1000]
    dec = [s for s in steps if not s["prefill"]]
    p50, p90, p99 = np.percentile(waits, [50, 90, 99])
    print(
        f"{path}: {len(steps)} steps, total {total:.1f} s, wait p50/p90/p99 "
        f"{p50:.3f} {p90:.3f} {p99:.3f}; {len(pre)} steps with prompt tokens "
        f"(mean {np.mean([s['seconds'] for s in pre]):.3f} s, "
        f"{np.mean([s['rows'] for s in pre]):.1f} rows); decode-only mean "
        f"{np.mean([s['seconds'] for s in dec]):.3f} s, "
        f"{np.mean([s['rows'] for s in dec]):.1f} rows"
    )
