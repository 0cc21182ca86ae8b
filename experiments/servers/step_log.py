"""Every step of the batched scheduler on the Qwen 1.5B with 16 requests at once (the peer
bench's 16-client level, in process): its time, rows, prompt tokens and drafts, to see which
steps make the p99 inter-token latency.

    python experiments/servers/step_log.py out.json [spec] [chunk] [slowdown] [model]
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import vllm_interop as vi  # noqa: E402

from specdec import GenerationConfig, SpeculativeEngine  # noqa: E402
from specdec.batch.scheduler import BatchScheduler  # noqa: E402
from specdec.cores import apply_thread_plan  # noqa: E402
from specdec.target.loading import load_named  # noqa: E402

out = sys.argv[1]
spec = sys.argv[2] if len(sys.argv) > 2 else "prompt-lookup"
chunk = int(sys.argv[3]) if len(sys.argv) > 3 else 64
slowdown = float(sys.argv[4]) if len(sys.argv) > 4 else 2.0
model = sys.argv[5] if len(sys.argv) > 5 else "qwen2.5-coder-1.5b"
apply_thread_plan(None)
engine = SpeculativeEngine.from_pretrained(load_named(model), speculator=spec)
tok = engine.tokenizer
prompts = [p["prompt"] for p in vi.select_prompts(8)]
sched = BatchScheduler(engine, max_batch=16, chunk=chunk, slowdown=slowdown)
config = GenerationConfig(max_new_tokens=128, ignore_eos=True)
for i in range(16):
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompts[i % 8]}],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )
    sched.add(ids, config)
steps = []
while not sched.idle:
    events = sched.step()
    r = sched.last
    steps.append({
        "seconds": r.seconds, "verify": r.verify_seconds, "rows": r.rows,
        "batch": r.batch_size, "prefill": r.prefill_tokens, "draft": r.draft_length,
        "emitted": sum(len(e.token_ids) for _, e in events),
    })
json.dump(steps, open(out, "w"))
emitting = sorted((s for s in steps if s["batch"] > 0), key=lambda s: -s["seconds"])
print(len(steps), "steps; slowest steps that emitted tokens:")
for s in emitting[:10]:
    print(s)
