"""Where a continuously batched run's time goes, with and without speculation, in process.

The server benchmark (``bench/batching.py``) measures what clients see; this one explains it.
It keeps ``--clients`` sequences in flight on one :class:`~specdec.batch.BatchScheduler` (a
finished request is replaced at once by the next prompt of ``bench/load_test.py``, as a
closed-loop client would) until ``--requests`` are done, for a speculating engine and a plain
one (alternating order per repeat), and prints per run: tokens/s, steps, mean sequences per
step, mean rows per pass, prefill passes, and seconds in verification and elsewhere.
Usage::

    taskset -c 0 .venv/bin/python bench/batch_breakdown.py --clients 16 --requests 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from load_test import PROMPTS  # noqa: E402

from specdec import SpeculativeEngine  # noqa: E402
from specdec.batch import BatchScheduler  # noqa: E402
from specdec.config import GenerationConfig  # noqa: E402
from specdec.target import load_model  # noqa: E402


def run(
    engine: SpeculativeEngine,
    clients: int,
    requests: int,
    max_tokens: int,
    fused: bool = True,
    chunk: int = 64,
) -> dict:
    scheduler = BatchScheduler(engine, max_batch=max(clients, 1), chunk=chunk, fused=fused)
    prompts = [engine.encode(p, True) for p in PROMPTS]
    config = GenerationConfig.of(max_new_tokens=max_tokens, ignore_eos=True)
    sent = 0

    def send() -> None:
        nonlocal sent
        scheduler.add(prompts[sent % len(prompts)], config)
        sent += 1

    for _ in range(min(clients, requests)):
        send()
    reports = []
    tokens = 0
    started = time.perf_counter()
    last: dict[int, float] = {}  # a sequence's previous event, for the gaps between events
    gaps: list[float] = []
    while not scheduler.idle:
        events = scheduler.step()
        now = time.perf_counter()
        for seq, event in events:
            if seq.id in last:
                gaps.append(now - last[seq.id])
            last[seq.id] = now
            tokens += len(event.token_ids)
            if event.finish_reason is not None and sent < requests:
                send()
        reports.append(scheduler.last)
    wall = time.perf_counter() - started
    decoding = [r for r in reports if r is not None and r.batch_size]
    return {
        "tok/s": tokens / wall,
        "steps": len(reports),
        "mean batch": statistics.mean(r.batch_size for r in decoding),
        "mean rows": statistics.mean(r.rows for r in decoding),
        "steps with prompt tokens": sum(1 for r in reports if r is not None and r.prefill_tokens),
        "p99 step s": sorted(r.seconds for r in reports if r is not None)[
            int(0.99 * (len(reports) - 1))
        ],
        "p99 gap s": sorted(gaps)[int(0.99 * (len(gaps) - 1))] if gaps else 0.0,
        "verify s": sum(r.verify_seconds for r in decoding),
        "other s": wall - sum(r.verify_seconds for r in decoding),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--speculator", default="prompt-lookup")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--separate-prefill",
        action="store_true",
        help="prefill prompts in passes of their own, not inside the verification passes",
    )
    ap.add_argument(
        "--chunk", type=int, default=64, help="prompt tokens per step while others decode"
    )
    args = ap.parse_args(argv)
    if args.chunk < 1 or args.clients < 1 or args.requests < 1:
        ap.error("--chunk, --clients and --requests must be at least 1")
    torch.set_num_threads(args.threads)
    model = load_model()
    engines = {
        name: SpeculativeEngine.from_pretrained(model, speculator=name)
        for name in (args.speculator, "none")
    }
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for repeat in range(args.repeats):
        order = list(engines) if repeat % 2 == 0 else list(engines)[::-1]
        for name in order:
            result = run(
                engines[name],
                args.clients,
                args.requests,
                args.max_tokens,
                not args.separate_prefill,
                args.chunk,
            )
            rates[name].append(result["tok/s"])
            cells = ", ".join(
                f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()
            )
            print(f"{name}: {cells}", flush=True)
    ratios = [a / b for a, b in zip(rates[args.speculator], rates["none"], strict=True)]
    print("speculation / none:", ", ".join(f"{r:.3f}" for r in ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
