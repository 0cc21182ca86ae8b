"""Where the server's p99 gap between streamed tokens comes from: the same 16-client level as
``bench/peers.py`` against one ``specdec serve`` of the Qwen 1.5B, then the server's own
engine-side gaps (``specdec_inter_token_latency_seconds``: the time between two events of a
request as the engine thread produced them, before any delivery) against the gaps the
clients saw, as the share of gaps above each bucket bound.

    python experiments/servers/gap_split.py out.json [extra serve options...]

The server's environment is this process's (so ``OMP_WAIT_POLICY=passive python ...`` reaches
the server's OpenMP threads).
"""

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import vllm_interop as vi  # noqa: E402


def buckets(text: str) -> dict[float, float]:
    """The engine-side inter-token histogram's cumulative bucket counts in ``/metrics``."""
    return {
        float(s.labels["le"]): s.value
        for f in text_string_to_metric_families(text)
        if f.name == "specdec_inter_token_latency_seconds"
        for s in f.samples
        if s.name.endswith("_bucket")
    }


out = Path(sys.argv[1])
extra = sys.argv[2:]
port = vi.free_port()
cmd = [
    "taskset", "-c", "0-1", str(Path(sys.executable).parent / "specdec"), "serve",
    "--model", "qwen2.5-coder-1.5b", "--speculator", "prompt-lookup", "--max-batch", "16",
    "--max-queue", "256", "--threads", "2", "--log-level", "warning", "--port", str(port),
    *extra,
]  # fmt: skip
log = out.with_suffix(".log")
proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
url = f"http://127.0.0.1:{port}"
try:
    if vi.wait_healthy(proc, url, log, 600) is None:
        sys.exit(f"the server did not start; last lines of {log}:\n{vi.tail(log, 20)}")
    prompts = [p["prompt"] for p in vi.select_prompts(8)]
    vi.chat(url, "qwen2.5-coder-1.5b", prompts[0], 8)  # warm-up
    before = httpx.get(f"{url}/metrics").text

    began = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:  # peers.py's 16-client level: 16 requests at once
        answers = list(
            pool.map(
                lambda i: vi.chat(
                    url, "qwen2.5-coder-1.5b", prompts[i % 8], 128, {"ignore_eos": True}
                ),
                range(16),
            )
        )
    wall = time.perf_counter() - began
    after = httpx.get(f"{url}/metrics").text
finally:
    proc.terminate()
    proc.wait(30)
b0, b1 = buckets(before), buckets(after)
engine = {le: b1[le] - b0.get(le, 0.0) for le in b1}
total = engine[float("inf")]
gaps = [g for a in answers for g in a.get("gaps", [])]
tokens = sum(a.get("completion_tokens") or 0 for a in answers)
print(f"{tokens} tokens in {wall:.1f} s: {tokens / wall:.1f} tok/s")
print(
    f"{len(gaps)} client gaps, p50 {np.percentile(gaps, 50):.3f} s, "
    f"p99 {np.percentile(gaps, 99):.3f} s; {int(total)} engine-side gaps"
)
rows = []
for le in sorted(engine):
    if le == float("inf") or le < 0.1:
        continue
    client = sum(g > le for g in gaps) / len(gaps)
    rows.append({"above_s": le, "engine_share": 1 - engine[le] / total, "client_share": client})
    print(
        f"gaps above {le:5.2f} s: engine-side {100 * (1 - engine[le] / total):5.1f}%, "
        f"at the clients {100 * client:5.1f}%"
    )
out.write_text(
    json.dumps(
        {
            "command": cmd,
            "engine_buckets": {str(k): v for k, v in engine.items()},
            "client_gaps": gaps,
            "rows": rows,
        },
        indent=1,
    )
)
