"""SmolLM2-135M (the bundled model) drafting for Qwen2.5-Coder-1.5B across tokenizers: specdec's
text-chained draft against Hugging Face's universal assisted generation with the same draft,
the same-vocabulary 0.5B draft and plain decoding, per prompt, interleaved, on one target object
(default numerics). transformers 5.25's UAG would raise where its assistant is handed a pass
of no new tokens; the baseline re-reads one token there (``bench.methods``), and any prompt
that still fails is counted and left out of its ratios.

    python experiments/crossvocab/crossvocab_vs_uag.py bench-out/pair28.jsonl 128 out.jsonl
    python experiments/crossvocab/crossvocab_vs_uag.py bench-out/pair28.jsonl 128 out.jsonl gemma-3-270m
    python experiments/crossvocab/crossvocab_vs_uag.py bench-out/pair28.jsonl 128 out.jsonl qwen2.5-coder-1.5b auto

With ``auto`` last: ``auto`` over prompt lookup and the same cross-vocabulary draft in place of
the 0.5B draft (what a user of that draft would run; HF's UAG has no such second arm).
"""

import json
import math
import sys
import time

from specdec.bench.methods import build_runners, parse_methods
from specdec.cores import apply_thread_plan
from specdec.target import load_model
from specdec.target.loading import default_gguf_path

apply_thread_plan(None)
data, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model = sys.argv[4] if len(sys.argv) > 4 else "qwen2.5-coder-1.5b"
with_auto = len(sys.argv) > 5 and sys.argv[5] == "auto"
target = load_model(model)
smol = default_gguf_path()
labels = ["none", f"draft:model={smol}", f"hf-assisted:draft={smol}"]
names = ["plain", "cross-vocab draft", "HF UAG"]
if with_auto:
    labels.append(f"auto:arms=[prompt-lookup,draft:model={smol}]")
    names.append("auto (prompt lookup + cross-vocab draft)")
elif model == "qwen2.5-coder-1.5b":  # the same-vocabulary draft, where the target has one
    labels.append("draft:qwen2.5-coder-0.5b")
    names.append("0.5B draft")
runners = build_runners(target, parse_methods(",".join(labels)), 5)
rows = []
for line in open(data):
    q = json.loads(line)
    msgs = [{"role": "user", "content": q["turns"][0]}]
    if target.tokenizer.chat_template is None:  # a base model (Gemma 3 270M's pack): the text
        ids = target.tokenizer(q["turns"][0])["input_ids"]
    else:
        ids = target.tokenizer.apply_chat_template(
            msgs, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    row = {"id": q["question_id"], "category": q["category"]}
    for name, runner in zip(names, runners, strict=True):
        try:
            t0 = time.perf_counter()
            r = runner.run(ids, n)
            row[name] = {"tok_s": len(r.token_ids) / r.seconds, "ids": r.token_ids}
        except Exception as error:  # noqa: BLE001 - HF's UAG bug, recorded
            row[name] = {"error": f"{type(error).__name__}: {str(error)[:120]}"}
        del t0
    rows.append(row)
    print(q["question_id"], {k: round(v["tok_s"], 1) if "tok_s" in v else "ERR" for k, v in row.items() if isinstance(v, dict)}, flush=True)
with open(out, "w") as f:
    for row in rows:
        f.write(json.dumps(row) + "\n")


def geo(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


for name in names[1:]:
    ok = [r for r in rows if "tok_s" in r[name]]
    same = sum(r[name]["ids"] == r["plain"]["ids"] for r in ok)
    vs_plain = geo([r[name]["tok_s"] / r["plain"]["tok_s"] for r in ok])
    print(f"{name}: ran {len(ok)}/{len(rows)}, identical {same}/{len(ok)}, vs plain {vs_plain:.2f}x")
both = [r for r in rows if "tok_s" in r["HF UAG"]]
print("cross-vocab / HF UAG on the prompts UAG ran:",
      round(geo([r["cross-vocab draft"]["tok_s"] / r["HF UAG"]["tok_s"] for r in both]), 2))
code = [r for r in both if r["category"] == "code"]
print("  code:", round(geo([r["cross-vocab draft"]["tok_s"] / r["HF UAG"]["tok_s"] for r in code]), 2))
if with_auto:
    a = names[-1]
    print(f"{a} / HF UAG:", round(geo([r[a]["tok_s"] / r["HF UAG"]["tok_s"] for r in both]), 2))
    print("  code:", round(geo([r[a]["tok_s"] / r["HF UAG"]["tok_s"] for r in code]), 2))
