"""The kquant kernel's cost per row and 256-weight block with the weights in cache: a Q4_K
layer of N x 1536 random blocks, one thread, R rows per call, medians of three interleaved
rounds; cycles are counted at the CPU's nominal clock (``/proc/cpuinfo``), so they are an upper
bound where the core boosts above it.

    taskset -c 0 .venv/bin/python experiments/kquant/hot_rows.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from specdec.target.kquant import KQuantLinear  # noqa: E402
from tests.test_kquant import random_blocks  # noqa: E402

K = 1536


def nominal_hz() -> float:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("cpu MHz"):
            return float(line.split(":")[1]) * 1e6
    return 2.6e9


def main() -> None:
    torch.set_num_threads(1)
    hz, nb = nominal_hz(), K // 256
    print(f"| N | rows | µs a call | cycles per row and block (at {hz / 1e9:.2f} GHz) |")
    print("|---:|---:|---:|---:|")
    for n in (1024, 4096):
        layer = KQuantLinear.from_gguf("Q4_K", random_blocks("Q4_K", n, K, 0), K)
        times: dict[int, list[float]] = {}
        for _ in range(3):
            for rows in (1, 2, 4, 8, 16, 32, 64, 128):
                x = torch.randn(rows, K)
                for _ in range(5):
                    layer.mm(x)
                calls = max(3, 2000 // rows)
                t = time.perf_counter()
                for _ in range(calls):
                    layer.mm(x)
                times.setdefault(rows, []).append((time.perf_counter() - t) / calls)
        for rows, values in times.items():
            t = statistics.median(values)
            print(f"| {n} | {rows} | {t * 1e6:.1f} | {t * hz / (n * nb * rows):.2f} |")


if __name__ == "__main__":
    main()
