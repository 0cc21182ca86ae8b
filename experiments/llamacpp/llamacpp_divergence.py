"""Where a speculative run over llama.cpp (``--dtype gguf``) first differs from plain decoding,
and how close the plain run's top two candidates were there.

llama.cpp picks other kernels for passes of other sizes, so a k-token verification pass can
round differently from the one-token passes of plain decoding, and a near-tie can then go the
other way. This prints, for each given prompt of ``experiments/llamacpp/llamacpp_compare.py``'s
set, the first differing position and the plain run's top-2 log-probability margin there:

    .venv/bin/python experiments/llamacpp/llamacpp_divergence.py --ids 242,481,9004,9006 --threads 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_compare import load_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ids", required=True, help="comma-separated prompt ids")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-k", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specdec import SpeculativeEngine
    from specdec.target import load_model

    wanted = {int(x) for x in args.ids.split(",")}
    prompts = [p for p in load_prompts(3, 10) if int(p["id"]) in wanted]
    target = load_model(args.target, dtype="gguf")
    engine = SpeculativeEngine.from_pretrained(
        target,
        speculator=f"auto:arms=[prompt-lookup,draft:model={args.draft},dtype=gguf]",
        num_draft_tokens=args.k,
    )
    tok = target.tokenizer
    print("| prompt | group | first differing token | plain's top-2 margin there (nats) |")
    print("|---|---|---|---|")
    for p in prompts:
        text = tok.apply_chat_template(
            [{"role": "user", "content": p["text"]}], add_generation_prompt=True, tokenize=False
        )
        kw = {"max_new_tokens": args.n, "chat": False}
        plain = engine.generate(text, speculate=False, logprobs=True, top_logprobs=2, **kw)
        spec = engine.generate(text, **kw)
        pairs = list(zip(plain.token_ids, spec.token_ids, strict=False))
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        if first is None:
            print(f"| {p['id']} | {p['group']} | none ({len(pairs)} equal) | - |")
            continue
        assert plain.logprobs is not None
        top = plain.logprobs[first].top
        margin = top[0][1] - top[1][1] if len(top) == 2 else float("nan")
        print(f"| {p['id']} | {p['group']} | {first} of {len(pairs)} | {margin:.4f} |", flush=True)


if __name__ == "__main__":
    main()
