"""Where a step of SmolLM2-135M drafting for Qwen2.5-Coder-1.5B through text goes: per
prompt, plain decoding and the cross-vocabulary draft (default numerics, 2 threads), with the
draft's forwards, the text mapping (target tokens -> draft tokens, draft tokens -> target
tokens) and verification timed apart, and acceptance by position.

    python experiments/crossvocab/profile_pair.py bench-out/pair28.jsonl 128 out.json [ids...]
"""

import json
import sys
import time

from specdec import GenerationConfig, SpeculativeEngine
from specdec.cores import apply_thread_plan
from specdec.speculators.cross_vocab import CrossVocabSpeculator
from specdec.target import load_model
from specdec.target.loading import default_gguf_path

apply_thread_plan(None)
data, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
only = {int(x) for x in sys.argv[4:]}
target = load_model("qwen2.5-coder-1.5b")
engine = SpeculativeEngine.from_pretrained(target, speculator=f"draft:model={default_gguf_path()}")
spec = engine.speculator
assert isinstance(spec, CrossVocabSpeculator), type(spec)
clock = {"sync": 0.0, "map": 0.0, "forward": 0.0}


def timed(obj, name, key):
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            clock[key] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


timed(spec, "sync", "sync")
timed(spec, "map_draft", "map")
timed(spec.runner, "forward", "forward")
rows = []
for line in open(data):
    q = json.loads(line)
    if only and q["question_id"] not in only:
        continue
    msgs = [{"role": "user", "content": q["turns"][0]}]
    ids = target.tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    config = GenerationConfig(max_new_tokens=n)
    row = {"id": q["question_id"], "category": q["category"]}
    for name, speculate in (("plain", False), ("cross", True)):
        for k in clock:
            clock[k] = 0.0
        *_, last = engine.stream_ids(ids, config, speculate=speculate)
        s = last.stats
        row[name] = {
            "tok_s": s.new_tokens / s.seconds,
            "seconds": s.seconds,
            "prefill": s.prefill_seconds,
            "draft": s.draft_seconds,
            "verify": s.verify_seconds,
            "forwards": s.target_forwards,
            "tau": s.mean_accepted,
            "drafted_at": s.drafted_at,
            "accepted_at": s.accepted_at,
            **{f"t_{k}": v for k, v in clock.items()},
        }
    rows.append(row)
    c, p = row["cross"], row["plain"]
    print(
        q["question_id"], q["category"], f"plain {p['tok_s']:.1f} cross {c['tok_s']:.1f}",
        f"tau {c['tau']:.2f} steps {c['forwards']} draft {c['draft']:.2f}s "
        f"(fwd {c['t_forward']:.2f} map {c['t_map']:.2f} sync {c['t_sync']:.2f}) "
        f"verify {c['verify']:.2f}s prefill {c['prefill']:.2f}s of {c['seconds']:.2f}s; "
        f"plain verify {p['verify']:.2f}s/{p['forwards']}",
        flush=True,
    )
json.dump(rows, open(out, "w"))
