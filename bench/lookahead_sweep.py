"""Choose lookahead's W, N, G on this machine: greedy decoding of training prompts (never eval
prompts) with each setting, interleaved with plain decoding per prompt, reporting tokens/s ratios
and tau. Outputs must equal plain decoding's (checked). Usage:

    taskset -c 0 .venv/bin/python bench/lookahead_sweep.py --prompts 6 --max-new-tokens 96 \
        --settings 4,3,4 5,4,5 3,3,3
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from specdec import GenerationConfig, SpeculativeEngine
from specdec.target import load_model

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
PROMPTS = SHARED / "data/train/vicuna_bench/question.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--settings", nargs="+", default=["4,3,4"])
    ap.add_argument("--methods", nargs="*", default=[], help="extra engine methods to compare")
    ap.add_argument("--file", type=Path, default=PROMPTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(None)
    rows = [json.loads(line) for line in args.file.read_text().splitlines() if line.strip()]
    texts = [r["turns"][0] if "turns" in r else r.get("prompt", r.get("text")) for r in rows]
    texts = texts[:: max(1, len(texts) // args.prompts)][: args.prompts]
    engines = {"none": SpeculativeEngine.from_pretrained(loaded)}
    for s in args.settings:
        engines[f"lookahead {s}"] = SpeculativeEngine.from_pretrained(
            loaded, method="lookahead", lookahead=s
        )
    for m in args.methods:
        engines[m] = SpeculativeEngine.from_pretrained(loaded, method=m)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    secs = {k: [] for k in engines}
    taus = {k: [] for k in engines}
    same = {k: 0 for k in engines}
    warm = engines["none"].encode(texts[0], True)
    for e in engines.values():
        list(e.stream_ids(warm, GenerationConfig(max_new_tokens=8)))
    for text in tqdm(texts, desc="prompts"):
        ids = engines["none"].encode(text, True)
        ref = None
        for name, eng in engines.items():
            out: list[int] = []
            for ev in eng.stream_ids(ids, config):
                out.extend(ev.token_ids)
                stats = ev.stats
            ref = out if ref is None else ref
            same[name] += out == ref
            secs[name].append(stats.seconds / max(1, stats.new_tokens))
            taus[name].append(stats.mean_accepted)
    base = statistics.mean(secs["none"])
    print("| method | speedup | tau | identical |")
    print("|---|---|---|---|")
    for name in engines:
        print(
            f"| {name} | {base / statistics.mean(secs[name]):.2f}x | "
            f"{statistics.mean(taus[name]):.2f} | {same[name]}/{len(texts)} |"
        )


if __name__ == "__main__":
    main()
