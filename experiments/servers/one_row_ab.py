"""A/B of the one-call decoder layer in the batch scheduler's one-row passes (a server with one
client) against the same passes through the Python layers, interleaved in one process: each
prompt decoded by ``generate_batch`` with ``max_batch=1``, alternately with
:meth:`SlotLayer.room` answering and refusing, four alternations.

    taskset -c 0,1 .venv/bin/python experiments/servers/one_row_ab.py [MODEL] [SPEC] [THREADS]

MODEL: a pack alias or path (default: the bundled SmolLM2-135M); SPEC default prompt-lookup;
THREADS default 2. Prints decode tokens/s per mode and whether the outputs are identical.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from specdec import SpeculativeEngine
from specdec.batch.cache import SlotLayer

PROMPTS = [
    "Write a Python function merge_intervals(intervals) that merges overlapping intervals.",
    "Explain why the sky is blue to a ten-year-old.",
    "Summarize: The city council voted on Tuesday to approve a new budget for the coming year. "
    "The budget includes more money for parks, road repairs and the public library.",
]


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else None
    spec = sys.argv[2] if len(sys.argv) > 2 else "prompt-lookup"
    torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
    engine = SpeculativeEngine.from_pretrained(model, speculator=spec)
    kw = {"max_new_tokens": 96, "ignore_eos": True}
    room = SlotLayer.room
    engine.generate_batch(PROMPTS[:1], max_batch=1, **kw)  # warm-up
    rates: dict[str, list[float]] = {"python": [], "one-call": []}
    outputs: dict[str, list[list[int]]] = {"python": [], "one-call": []}
    for _ in range(4):
        for mode in rates:
            SlotLayer.room = (lambda self, t: None) if mode == "python" else room  # type: ignore[method-assign]
            tokens, seconds = 0, 0.0
            for prompt in PROMPTS:
                start = time.perf_counter()
                (result,) = engine.generate_batch([prompt], max_batch=1, **kw)
                seconds += time.perf_counter() - start
                tokens += len(result.token_ids)
                outputs[mode].append(result.token_ids)
            rates[mode].append(tokens / seconds)
    SlotLayer.room = room  # type: ignore[method-assign]
    med = {m: statistics.median(v) for m, v in rates.items()}
    same = outputs["python"] == outputs["one-call"]
    print(f"{model or 'bundled'} {spec}: python {med['python']:.2f} tok/s, one call "
          f"{med['one-call']:.2f} tok/s ({med['one-call'] / med['python']:.3f}x), "
          f"identical: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
