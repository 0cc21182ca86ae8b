"""A real sliding-window model end to end: Gemma 3 270M (local layers with a 512-token window
interleaved with global ones), prompts long enough that the window matters.

For each method: greedy output identical to plain decoding (token ids), τ, tokens/s and the
speedup over plain decoding of the same prompt; then the same prompts through continuous
batching (``generate_batch``), compared with the solo outputs. Prompts are Spec-Bench
summarization and RAG questions of 600+ tokens (evaluation prompts, never trained on), as
completions (the GGUF is the base model, without a chat template). Usage::

    scripts/install.sh --gemma   # once: the model pack
    .venv/bin/python bench/sliding_window.py --out bench-out/sliding-window --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console

from specdec import SpeculativeEngine
from specdec.target import load_model

console = Console(stderr=True)
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval" / "spec_bench"


def long_prompts(tokenizer, n: int, min_tokens: int) -> list[str]:
    rows = [json.loads(x) for x in (SHARED / "question.jsonl").read_text().splitlines()]
    out = []
    for r in rows:
        if r["category"] not in ("summarization", "rag"):
            continue
        text = r["turns"][0]
        if len(tokenizer(text)["input_ids"]) >= min_tokens:
            out.append(text)
        if len(out) == n:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--min-prompt-tokens", type=int, default=600)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--methods", default="prompt-lookup,suffix,lookahead,draft:model=layers:9")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(args.model)
    window = loaded.model.config.get_text_config().sliding_window
    prompts = long_prompts(loaded.tokenizer, args.prompts, args.min_prompt_tokens)
    kw = {"max_new_tokens": args.max_new_tokens, "chat": False}
    plain_engine = SpeculativeEngine.from_pretrained(loaded)
    plain_engine.generate(prompts[0][:200], max_new_tokens=4, chat=False)  # warm-up
    plain = [plain_engine.generate(p, speculate=False, **kw) for p in prompts]
    lengths = [r.stats.prompt_tokens for r in plain]
    rows = []
    for spec in args.methods.split(","):
        engine = SpeculativeEngine.from_pretrained(loaded, speculator=spec)
        speedups, taus, same = [], [], 0
        for p, ref in zip(prompts, plain, strict=True):
            t0 = time.perf_counter()
            res = engine.generate(p, **kw)
            seconds = time.perf_counter() - t0
            same += res.token_ids == ref.token_ids
            taus.append(res.stats.mean_accepted)
            speedups.append(ref.stats.seconds / seconds)
        rows.append(
            {
                "method": spec,
                "identical": f"{same}/{len(prompts)}",
                "tau": round(statistics.fmean(taus), 2),
                "speedup": round(statistics.geometric_mean(speedups), 2),
            }
        )
        console.print(rows[-1])
    batch_engine = SpeculativeEngine.from_pretrained(loaded, speculator="prompt-lookup")
    t0 = time.perf_counter()
    batched = batch_engine.generate_batch(prompts, max_batch=len(prompts), **kw)
    batch_seconds = time.perf_counter() - t0
    batch_same = sum(b.token_ids == r.token_ids for b, r in zip(batched, plain, strict=True))
    plain_seconds = sum(r.stats.seconds for r in plain)
    cmd = "python bench/sliding_window.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        f"`{cmd}`",
        "",
        f"Model {args.model}: sliding window {window}; prompts of {min(lengths)}-{max(lengths)} "
        f"tokens + {args.max_new_tokens} generated, so every local layer's window is exceeded.",
        "",
        "| method | identical to plain | τ | speedup (geo. mean) |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['method']} | {r['identical']} | {r['tau']} | {r['speedup']}× |" for r in rows]
    lines += [
        "",
        f"Continuous batching of the {len(prompts)} prompts (prompt lookup, one pass per step): "
        f"{batch_same}/{len(prompts)} identical to plain solo decoding; "
        f"{batch_seconds:.1f} s against {plain_seconds:.1f} s of plain solo decoding "
        f"({plain_seconds / batch_seconds:.2f}×).",
    ]
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    (args.out / "report.json").write_text(
        json.dumps(
            {
                "command": cmd,
                "window": window,
                "prompt_tokens": lengths,
                "rows": rows,
                "batch": {
                    "identical": batch_same,
                    "seconds": batch_seconds,
                    "plain_seconds": plain_seconds,
                },
            },
            indent=1,
        )  # fmt: skip
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
