"""A/B of ``auto``'s catch-up pricing: as now (a draft's catch-up priced as one forward plus a
token-weighted cost per token beyond it, over the tokens recent requests had left) against as
before (a per-token average over catch-ups, priced over the request's limit), on a prompt set
run in order, as ``specdec bench`` runs it: two ``auto`` engines over one loaded target, the
second with the earlier pricing bound onto its controller, plus plain decoding and llama.cpp's
plain decoding of the same file, each prompt by all four in turn (order rotating per prompt).

    taskset -c 0,1 .venv/bin/python experiments/auto/catch_up_ab.py \\
        bench-out/pair28.jsonl OUT.jsonl [MODEL] [SPEC] [MAX_NEW]

MODEL default qwen2.5-coder-1.5b; SPEC default auto:arms=[prompt-lookup,draft:qwen2.5-coder-0.5b];
MAX_NEW default 128. Two threads. Prints per-group geometric-mean ratios to llama.cpp plain.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import torch

from specdec import SpeculativeEngine
from specdec.bench.harness import encode_questions
from specdec.bench.workloads import load_questions
from specdec.config import GenerationConfig
from specdec.control.controller import Controller
from specdec.target import llamacpp, load_model

DEFAULT_SPEC = "auto:arms=[prompt-lookup,draft:qwen2.5-coder-0.5b]"


def before(controller: Controller) -> None:
    """Bind the earlier pricing onto ``controller``: the request's limit as the tokens left,
    and a catch-up's cost as an average per token over catch-ups (each pass one observation)."""

    def observe_catch_up(arm: str, tokens: int, seconds: float) -> None:
        if tokens < 1 or not seconds > 0:
            return
        st = controller.state[arm]
        unit, d = seconds / tokens, controller.costs.decay
        old = st.catch_up_seconds
        # the average per token, held as the sums the controller reads it from
        st.catch_up_excess = unit if old is None else d * old + (1 - d) * unit
        st.catch_up_tokens = 1.0

    controller.expected_left = lambda generated, remaining: remaining  # type: ignore[method-assign]
    controller._pass_overhead = lambda spec: 0.0  # type: ignore[method-assign]
    controller.observe_catch_up = observe_catch_up  # type: ignore[method-assign]


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def main() -> None:
    data, out = Path(sys.argv[1]), Path(sys.argv[2])
    model = sys.argv[3] if len(sys.argv) > 3 else "qwen2.5-coder-1.5b"
    spec = (
        sys.argv[4] if len(sys.argv) > 4 else "auto:arms=[prompt-lookup,draft:qwen2.5-coder-0.5b]"
    )
    max_new = int(sys.argv[5]) if len(sys.argv) > 5 else 128
    torch.set_num_threads(2)
    loaded = load_model(model)
    questions = load_questions(data).questions
    prompts = encode_questions(loaded, questions, None)
    engines = {
        "auto": SpeculativeEngine.from_pretrained(loaded, speculator=spec),
        "auto-before": SpeculativeEngine.from_pretrained(loaded, speculator=spec),
    }
    plain = SpeculativeEngine.from_pretrained(loaded, speculator="none")
    old = engines["auto-before"].arms
    assert old is not None
    before(old._shared)
    stop = frozenset(loaded.eos_token_ids)
    config = GenerationConfig(max_new_tokens=max_new)

    def ours(engine: SpeculativeEngine, ids: list[int]) -> dict:
        events = list(engine.stream_ids(ids, config))
        last = events[-1].stats
        tokens = [t for event in events for t in event.token_ids]
        return {"tokens": tokens, "seconds": last.seconds, "choices": last.choices}

    def llama(ids: list[int]) -> dict:
        got = llamacpp.plain_greedy(Path(loaded.source), ids, max_new, stop, 2)
        return {"tokens": got.token_ids, "seconds": got.seconds, "choices": None}

    runs = {
        "llamacpp": llama,
        "none": lambda ids: ours(plain, ids),
        "auto": lambda ids: ours(engines["auto"], ids),
        "auto-before": lambda ids: ours(engines["auto-before"], ids),
    }
    names = list(runs)
    records = []
    with out.open("w") as f:
        for i, (q, ids) in enumerate(zip(questions, prompts, strict=True)):
            order = names[i % len(names) :] + names[: i % len(names)]
            row = {}
            for name in order:
                row[name] = runs[name](ids)
            for name in names:
                r = row[name]
                rec = {
                    "question_id": q.question_id,
                    "group": q.group,
                    "method": name,
                    "new_tokens": len(r["tokens"]),
                    "seconds": r["seconds"],
                    "identical": r["tokens"] == row["none"]["tokens"],
                    "choices": r["choices"],
                }
                records.append(rec)
                f.write(json.dumps(rec) + "\n")
            print(q.group, q.question_id, {n: round(row[n]["seconds"], 2) for n in names},
                  flush=True)  # fmt: skip
    ratios: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    by_q = defaultdict(dict)
    for r in records:
        by_q[r["question_id"]][r["method"]] = r
    for rs in by_q.values():
        ref = rs["llamacpp"]
        ref_rate = ref["new_tokens"] / ref["seconds"]
        for name in names[1:]:
            rate = rs[name]["new_tokens"] / rs[name]["seconds"]
            ratios[name][rs[name]["group"]].append(rate / ref_rate)
            ratios[name]["all"].append(rate / ref_rate)
    groups = sorted({r["group"] for r in records}) + ["all"]
    print("ratio to llama.cpp plain (geo-mean) | " + " | ".join(groups))
    for name in names[1:]:
        cells = [geomean(ratios[name][g]) for g in groups]
        same = sum(r["identical"] for r in records if r["method"] == name)
        print(
            f"{name} | "
            + " | ".join(f"{c:.2f}" for c in cells)
            + f" | identical {same}/{len(by_q)}"
        )


if __name__ == "__main__":
    main()
