"""What one drafted token costs a draft model, per numerics and draft vocabulary, the way a
chain drafts: one-token forwards over a cache that holds a prompt.

Every variant is loaded once in one process (a ``vocab=N`` variant shares its model's weights
and swaps only the LM head) and timed in turn, repeat after repeat, so a burst of load on the
machine spreads over all of them. A single projection timed alone keeps its weight in cache and
can rank kernels differently from a whole forward (weight-only int8 on an AVX2 EPYC: faster
than int4 on one hot projection, slower as a draft), which is why this times whole forwards.

    taskset -c 0,1 .venv/bin/python experiments/draft-model/draft_cost.py \\
        --model qwen2.5-coder-0.5b \\
        --dtypes int4,int8,gguf --vocabs 0,16384,32768 --threads 2 \\
        --out experiments/draft-model/bench-qwen-pair-vocab/draft-cost-epyc.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdec.speculators.draft_vocab import draft_vocabulary, with_subset_head
from specdec.target import ModelRunner, load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtypes", default="int4,int8", help="gguf: the file run by llama.cpp")
    ap.add_argument("--vocabs", default="0,16384,32768", help="0: the full head")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=32, help="drafted tokens per timing")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runners: dict[str, ModelRunner] = {}
    for dtype in args.dtypes.split(","):
        if dtype == "gguf":  # the model's GGUF file run by llama.cpp (draft:...,dtype=gguf)
            from specdec.speculators.draft_model import draft_gguf_path
            from specdec.target.llamacpp import LlamaCppRunner, LlamaModel

            runner = LlamaCppRunner(LlamaModel(draft_gguf_path(args.model)), args.threads)
            runners["gguf (llama.cpp)"] = runner  # type: ignore[assignment]
            continue
        loaded = load_model(args.model, dtype=dtype)
        size = int(loaded.model.config.vocab_size)
        for vocab in (int(v) for v in args.vocabs.split(",")):
            model = loaded.model
            if vocab:
                keep = loaded.tokenizer.all_special_ids
                model = with_subset_head(
                    model, draft_vocabulary(loaded.tokenizer, vocab, size, keep), dtype
                )
            runners[f"{dtype}" + (f",vocab={vocab}" if vocab else "")] = ModelRunner(model)
    prefix = list(range(1000, 1000 + args.prompt_tokens))
    times: dict[str, list[float]] = {name: [] for name in runners}
    for rep in range(args.repeats + 1):  # the first round warms up
        for name, runner in runners.items():
            runner.reset()
            runner.forward(prefix, logits_to_keep=1)
            t0 = time.perf_counter()
            for i in range(args.tokens):
                runner.forward([2000 + i], logits_to_keep=1)
            if rep:
                times[name].append((time.perf_counter() - t0) / args.tokens * 1e3)
    rows = []
    for name, ts in times.items():
        row = {"variant": name, "ms_per_token": round(statistics.median(ts), 2)}
        row["runs_ms"] = [round(t, 2) for t in ts]
        rows.append(row)
        print(json.dumps(row))
    if args.out:
        body = {"model": args.model, "threads": args.threads, "torch": torch.__version__}
        body |= {"prompt_tokens": args.prompt_tokens, "rows": rows}
        args.out.write_text(json.dumps(body, indent=1))


if __name__ == "__main__":
    main()
