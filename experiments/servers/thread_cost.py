"""The same decoding on Python's main thread and on another thread, in one process.

The server runs its engine on a worker thread. This times one ``BatchScheduler`` decoding the
bundled model one sequence at a time (median step) and one small kquant matmul, first on the
main thread and then on a second thread. Usage::

    taskset -c 0-1 .venv/bin/python experiments/servers/thread_cost.py
"""

from __future__ import annotations

import threading
import time

import torch

from specdec import SpeculativeEngine
from specdec.batch import BatchScheduler
from specdec.config import GenerationConfig
from specdec.target import load_model
from specdec.target.kquant import KQuantLinear

torch.set_num_threads(2)
loaded = load_model()
engine = SpeculativeEngine.from_pretrained(loaded, speculator="none")
ids = engine.encode("Write the numbers from one to twenty as English words.", False)
config = GenerationConfig.of(max_new_tokens=128, ignore_eos=True)
small = min(
    (m for m in loaded.model.modules() if isinstance(m, KQuantLinear)),
    key=lambda m: m.codes.numel(),
)
x = torch.randn(1, small.in_features)


def measure(where: str) -> None:
    for _ in range(2):
        scheduler = BatchScheduler(engine, max_batch=16)
        scheduler.add(ids, config)
        steps = []
        while not scheduler.idle:
            start = time.perf_counter()
            scheduler.step()
            steps.append(time.perf_counter() - start)
        steps.sort()
        for _ in range(20):
            small.mm(x)
        start = time.perf_counter()
        for _ in range(300):
            small.mm(x)
        matmul = (time.perf_counter() - start) / 300
        print(
            f"{where}: median step {1000 * steps[len(steps) // 2]:.1f} ms, "
            f"one {tuple(small.codes.shape)} matmul {1e6 * matmul:.0f} us",
            flush=True,
        )


measure("main thread")
worker = threading.Thread(target=measure, args=("other thread",))
worker.start()
worker.join()
