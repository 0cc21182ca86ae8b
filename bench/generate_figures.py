"""Figures for `specdec generate --compare` on three kinds of prompt, plus HF generate.

For each prompt (a Spec-Bench summarization prompt, a chat question, a code request) and each
method, interleaved over repeats after a warm-up: plain decoding (ours), speculative decoding
(ours), and Hugging Face ``model.generate`` greedy on the same model object and numerics.
Prints a markdown table of medians. Usage:

    .venv/bin/python bench/generate_figures.py [--methods prompt-lookup,draft:layers:8] \
        [-n 128] [--repeats 3]

``--methods`` is a comma-separated list of speculator specs, as ``specdec bench`` takes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdec import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.speculators.spec import parse_spec, split_specs
from specdec.target import load_model

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared/data/eval/spec_bench/question.jsonl"


def prompts() -> dict[str, str]:
    summary = next(
        json.loads(line)["turns"][0]
        for line in SPEC_BENCH.read_text().splitlines()
        if json.loads(line)["category"] == "summarization"
    )
    return {
        "summarization (Spec-Bench 241)": summary,
        "chat": "What are some good ways to improve my sleep? Give practical advice.",
        "code": "Write a Python function that parses a CSV file and returns the average of "
        "each numeric column. Include error handling.",
    }


def hf_generate_seconds(loaded, ids: list[int], n: int) -> tuple[float, int]:
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = loaded.model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=loaded.tokenizer.eos_token_id,
        )
        seconds = time.perf_counter() - t0
    return seconds, out.shape[1] - len(ids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="prompt-lookup", help="comma-separated speculator specs")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    try:
        specs = {m: parse_spec(m) for m in split_specs(args.methods)}
    except SpecDecError as e:
        ap.error(str(e))
    loaded = load_model(None)
    engines = {m: SpeculativeEngine.from_pretrained(loaded, speculator=o) for m, o in specs.items()}
    plain_engine = next(iter(engines.values()))
    rows = []
    for kind, prompt in prompts().items():
        ids = plain_engine.encode(prompt, chat=True)
        plain_engine.generate(prompt, chat=True, max_new_tokens=4, speculate=False)  # warm-up
        plain_tps, hf_tps, spec = [], [], {m: [] for m in engines}
        plain_ids: list[int] = []
        for _ in range(args.repeats):
            res = plain_engine.generate(
                prompt, chat=True, max_new_tokens=args.max_new_tokens, speculate=False
            )
            plain_ids = res.token_ids
            plain_tps.append(res.stats.tokens_per_s)
            for m, eng in engines.items():
                spec[m].append(eng.generate(prompt, chat=True, max_new_tokens=args.max_new_tokens))
            secs, n = hf_generate_seconds(loaded, ids, args.max_new_tokens)
            hf_tps.append(n / secs)
        for m, results in spec.items():
            tps = statistics.median(r.stats.tokens_per_s for r in results)
            rows.append(
                (
                    kind,
                    m,
                    statistics.median(plain_tps),
                    tps,
                    tps / statistics.median(plain_tps),
                    statistics.median(r.stats.mean_accepted for r in results),
                    all(r.token_ids == plain_ids for r in results),
                    statistics.median(hf_tps),
                    len(plain_ids),
                )
            )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {loaded.numerics}, "
        f"{args.max_new_tokens} new tokens max, median of {args.repeats}"
    )
    print()
    print(
        "| prompt | method | plain tok/s | speculative tok/s | speedup | τ | identical "
        "| HF generate tok/s | ours plain / HF |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, m, p, s, x, tau, same, hf, _n in rows:
        print(
            f"| {kind} | {m} | {p:.2f} | {s:.2f} | {x:.2f}x | {tau:.2f} | {same} | {hf:.2f} "
            f"| {p / hf:.2f} |"
        )


if __name__ == "__main__":
    main()
