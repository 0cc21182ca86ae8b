"""Per-step log of draft-model speculation: drafted length (tree nodes and depth), accepted,
draft and verify seconds, for the adaptive budget and fixed K, on prompts of a question file.

    taskset -c 0 nice -n 5 .venv/bin/python experiments/draft-model/bench-draft-trees/step_log.py \
        --model qwen2.5-coder-1.5b --draft 'draft:qwen2.5-coder-0.5b' \
        --questions experiments/draft-model/bench-draft-trees/questions.jsonl --ids 9001,161 \
        --modes adaptive,fixed5,fixed3,plain -n 96 --threads 1 > steps.jsonl

One target and one draft are loaded once; each mode is a request on the same engine (the
engine's cost model carries over between requests, as in a server). Writes one JSON line per
step and a summary line per (prompt, mode).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from specdec import SpeculativeEngine
from specdec.speculators import DraftModelSpeculator
from specdec.speculators.draft_model import TreeShape
from specdec.target import ModelRunner, load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True, help="speculator spec")
    ap.add_argument("--questions", required=True)
    ap.add_argument("--ids", required=True)
    ap.add_argument("--modes", default="adaptive,fixed5,plain")
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", action="store_true", help="print every step, not only summaries")
    ap.add_argument("--trees", default="", help="tree shapes to run as modes too (auto,2x2,...)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    questions = {}
    with open(args.questions) as f:
        for line in f:
            q = json.loads(line)
            questions[str(q["question_id"])] = q["turns"][0]
    engine = SpeculativeEngine.from_pretrained(loaded, speculator=args.draft)
    chain = spec = engine.speculator
    trees = {}
    for shape in filter(None, args.trees.split(",")):  # same draft weights, a runner each
        trees[f"tree={shape}"] = DraftModelSpeculator(
            ModelRunner(chain.runner.model),
            tree=TreeShape.parse(shape),
            cost_prior=chain.cost_prior,
        )
    costs = engine.cost_model
    log: list[dict] = []
    log_tree: list = []
    original_step = engine.step

    def step(req):  # wraps SpeculativeEngine.step, reading what it recorded
        d0, v0 = req.stats.draft_seconds, req.stats.verify_seconds
        n0 = req.stats.drafted_tokens
        log_tree.clear()
        acc = original_step(req)
        log.append(
            {
                "depth": req.stats.drafted_tokens - n0,
                "accepted": acc.num_accepted,
                "draft_s": round(req.stats.draft_seconds - d0, 4),
                "verify_s": round(req.stats.verify_seconds - v0, 4),
                "catch_up_s": round(spec.catch_up_seconds(), 4),
                "unit": round(costs.unit or 0.0, 4),
                "draft_per_token": round(costs.draft_seconds_per_token, 4),
                "alphas": [round(a, 2) for a in getattr(req.budget, "estimates", list)()],
                "nodes": len(log_tree[-1]) if log_tree else 0,
            }
        )
        return acc

    engine.step = step

    def recording(propose):
        def wrapped(context, budget):
            tree = propose(context, budget)
            log_tree.append(tree)
            return tree

        return wrapped

    for s in (chain, *trees.values()):
        s.propose = recording(s.propose)
    for qid in args.ids.split(","):
        prompt = questions[qid]
        for mode in [*args.modes.split(","), *trees]:
            log.clear()
            spec = trees.get(mode, chain)
            engine.speculator, engine.speculators = spec, (spec,)
            engine.adaptive = mode == "adaptive"
            if mode.startswith("fixed"):
                engine.num_draft_tokens = int(mode[5:])
            else:
                engine.num_draft_tokens = 5
            t0 = time.perf_counter()
            result = engine.generate(prompt, max_new_tokens=args.n, speculate=mode != "plain")
            wall = time.perf_counter() - t0
            st = result.stats
            if args.steps:
                for i, row in enumerate(log):
                    print(json.dumps({"q": qid, "mode": mode, "step": i, **row}))
            print(
                json.dumps(
                    {
                        "q": qid,
                        "mode": mode,
                        "summary": True,
                        "tokens": st.new_tokens,
                        "seconds": round(wall, 2),
                        "tok_s": round(st.new_tokens / wall, 3),
                        "prefill_s": round(st.prefill_seconds, 2),
                        "tau": round(st.mean_accepted, 2),
                        "cost_prior": round(spec.cost_prior, 3),
                        "draft_s": round(st.draft_seconds, 2),
                        "verify_s": round(st.verify_seconds, 2),
                        "steps": st.target_forwards,
                        "acc_by_pos": [round(a, 2) for a in st.acceptance_by_position],
                        "text_head": result.text[:60],
                    }
                ),
                flush=True,
            )
            sys.stdout.flush()


if __name__ == "__main__":
    main()
