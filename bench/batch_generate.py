"""Offline batch generation: ``engine.generate_batch`` against Hugging Face's batched generate.

What a user with a list of prompts would otherwise run is ``model.generate`` on a left-padded
batch. For each batch size B this times, on the same prompts (chat-templated, greedy, fixed
``--max-new-tokens`` with EOS ignored so every system makes the same number of tokens):

* ``hf``: ``model.generate`` over batches of B left-padded prompts;
* ``ours-none``: ``engine.generate_batch(max_batch=B, speculate=False)``;
* ``ours-SPEC``: ``engine.generate_batch(max_batch=B)`` with the speculator SPEC;

and checks each output against our solo greedy output (identical, or how many differ).
Usage::

    .venv/bin/python bench/batch_generate.py --out bench-out/batch-generate --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from rich.console import Console

from specdec import SpeculativeEngine

console = Console(stderr=True)
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval" / "spec_bench"


def prompts(n: int) -> list[str]:
    """Spec-Bench questions, round-robin over categories (evaluation prompts, never trained on)."""
    rows = [json.loads(x) for x in (SHARED / "question.jsonl").read_text().splitlines()]
    by_cat: dict[str, list[str]] = {}
    for r in rows:
        by_cat.setdefault(r["category"], []).append(r["turns"][0][:600])
    out: list[str] = []
    while len(out) < n:
        for cat in sorted(by_cat):
            if by_cat[cat] and len(out) < n:
                out.append(by_cat[cat].pop(0))
    return out


def hf_batches(engine: SpeculativeEngine, ids: list[list[int]], b: int, n: int) -> list[list[int]]:
    model = engine.target.loaded.model  # type: ignore[attr-defined]
    pad = engine.tokenizer.pad_token_id or 0
    out: list[list[int]] = []
    for i in range(0, len(ids), b):
        batch = ids[i : i + b]
        width = max(len(x) for x in batch)
        x = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, p in enumerate(batch):
            x[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        with torch.inference_mode():
            gen = model.generate(
                input_ids=x,
                attention_mask=mask,
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,  # never stop: what ignore_eos does for ours
                pad_token_id=pad,
            )
        out.extend(gen[:, width:].tolist())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--speculator", default="prompt-lookup")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    engine = SpeculativeEngine.from_pretrained(None, speculator=args.speculator)
    texts = prompts(args.prompts)
    ids = [engine.encode(t, chat=True) for t in texts]
    n = args.max_new_tokens
    kw = {"max_new_tokens": n, "ignore_eos": True}
    engine.generate_batch_ids(ids[:2], max_batch=2, max_new_tokens=4)  # warm-up
    solo = [engine.generate_batch_ids([x], max_batch=1, speculate=False, **kw)[0] for x in ids]
    reference = [r.token_ids for r in solo]
    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        for system in ("hf", "ours-none", f"ours-{args.speculator}"):
            t0 = time.perf_counter()
            if system == "hf":
                outs = hf_batches(engine, ids, b, n)
            else:
                res = engine.generate_batch_ids(
                    ids, max_batch=b, speculate=system != "ours-none", **kw
                )
                outs = [r.token_ids for r in res]
            seconds = time.perf_counter() - t0
            tokens = sum(len(o) for o in outs)
            differ = sum(1 for o, r in zip(outs, reference, strict=True) if o != r)
            rows.append(
                {
                    "batch": b,
                    "system": system,
                    "tokens": tokens,
                    "seconds": round(seconds, 2),
                    "tok_s": round(tokens / seconds, 2),
                    "differ_from_solo_greedy": differ,
                }
            )
            console.print(rows[-1])
    hf = {r["batch"]: r["tok_s"] for r in rows if r["system"] == "hf"}
    cmd = "python bench/batch_generate.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"`{cmd}`", "", "| B | system | tok/s | × hf at B | outputs ≠ solo greedy |"]
    lines.append("|---|---|---|---|---|")
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['system']} | {r['tok_s']} | {r['tok_s'] / hf[r['batch']]:.2f} "
            f"| {r['differ_from_solo_greedy']}/{len(ids)} |"
        )
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    (args.out / "report.json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
