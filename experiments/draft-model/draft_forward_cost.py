"""What one forward of the Qwen2.5-Coder 0.5B draft costs in each numerics a draft can run in,
interleaved in one process: a k-row pass over a 200-token cache (then rolled back), medians of
four alternations of 20 passes each.

    taskset -c 0,1 .venv/bin/python experiments/draft-model/draft_forward_cost.py

Rows: the pack's Q4_K_M file in its own blocks (``kquant``) with the full LM head and with the
32,768-token subset head (``vocab=32768``, the default for this tokenizer); the file requantized
to Q4_0 (what the llama.cpp draft runs) in ``kquant``, both heads; torch ``int4`` with the
subset head; and llama.cpp on the Q4_0 file (one row only: it is the chain's backend).
"""

from __future__ import annotations

import statistics
import time

import torch

from specdec.speculators.draft_vocab import draft_vocabulary, with_subset_head
from specdec.target import ModelRunner, load_model
from specdec.target.drafts import load_llamacpp_draft
from specdec.target.llamacpp import requantized

DRAFT = "qwen2.5-coder-0.5b"


def main() -> None:
    torch.set_num_threads(2)
    target = load_model("qwen2.5-coder-1.5b")
    llama = load_llamacpp_draft(DRAFT, target, "q4_0", fall_back=False, any_vocabulary=False)
    runners: dict[str, object] = {}
    for name, source in (
        ("kquant Q4_K_M", {"model": DRAFT}),
        ("kquant Q4_0", {"gguf": str(requantized(llama.source, "q4_0"))}),
        ("int4", {"model": DRAFT}),
    ):
        dtype = "int4" if name == "int4" else "kquant"
        loaded = load_model(dtype=dtype, **source)
        if dtype == "kquant":
            runners[f"{name}, full head"] = ModelRunner(loaded.model)
        ids = draft_vocabulary(loaded.tokenizer, 32768, 151936, loaded.tokenizer.all_special_ids)
        runners[f"{name}, vocab=32768"] = ModelRunner(with_subset_head(loaded.model, ids, dtype))
    runners["llama.cpp Q4_0, full head"] = llama.runner
    for runner in runners.values():
        runner.forward(list(range(100, 300)))  # type: ignore[attr-defined]

    def passes(runner: object, n: int, k: int) -> None:
        for i in range(n):
            runner.forward([500 + (i + j) % 7 for j in range(k)], logits_to_keep=1)  # type: ignore[attr-defined]
        runner.cache.rollback(200)  # type: ignore[attr-defined]

    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(4):
        for name, runner in runners.items():
            for k in (1,) if name.startswith("llama") else (1, 4):
                passes(runner, 3, k)
                t = time.perf_counter()
                passes(runner, 20, k)
                times.setdefault((name, k), []).append((time.perf_counter() - t) / 20 * 1e3)
    print("| draft numerics | 1 row, ms | 4 rows, ms |\n|---|---:|---:|")
    for name in runners:
        one = statistics.median(times[(name, 1)])
        four = times.get((name, 4))
        cell = f"{statistics.median(four):.2f}" if four else "–"
        print(f"| {name} | {one:.2f} | {cell} |")


if __name__ == "__main__":
    main()
