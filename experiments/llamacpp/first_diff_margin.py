"""Where a speculative output of ``experiments/llamacpp/llamacpp_compare.py`` left our plain
decoding: the plain run's top-2 log-probability gap at the first differing token. A near-tie
there means the k-token and one-token passes rounded differently, not a verification error.

    python experiments/llamacpp/first_diff_margin.py \
        experiments/llamacpp/data/compare-epyc-gguf-target.jsonl --dtype gguf
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from llamacpp_compare import load_prompts  # noqa: E402

from specdec import SpeculativeEngine  # noqa: E402
from specdec.target import load_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--dtype", default="gguf")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in args.results.read_text().splitlines()]
    prompts = {p["id"]: p for p in load_prompts(per_group=10, code=10)}
    loaded = load_model(args.target, dtype=args.dtype)
    engine = SpeculativeEngine.from_pretrained(loaded)
    for row in rows:
        for mode, run in row.items():
            if not mode.startswith("ours") or not isinstance(run, dict):
                continue
            if run.get("identical") is not False:
                continue
            ours, plain_ids = run["token_ids"], row["ours"]["token_ids"]
            i = next(j for j, (a, b) in enumerate(zip(ours, plain_ids, strict=False)) if a != b)
            messages = [{"role": "user", "content": prompts[row["id"]]["text"]}]
            text = loaded.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            plain = engine.generate(
                text, max_new_tokens=i + 1, chat=False, speculate=False, logprobs=True,
                top_logprobs=2,
            )  # fmt: skip
            assert plain.logprobs is not None
            top = plain.logprobs[i].top
            gap = top[0][1] - top[1][1]
            print(f"{row['id']} {row['group']} {mode}: first difference at token {i}, plain "
                  f"top-2 {top}, gap {gap:.4f}, speculative chose {ours[i]}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
