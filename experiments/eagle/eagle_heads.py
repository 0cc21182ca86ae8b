"""Compare EAGLE drafters for one target on the same positions, without a benchmark run: the
simulated τ of greedy chain drafting (1 + Σ_j P(steps 0..j all right), as training reports it)
on held-out self-distilled answers and on the target's own answers to evaluation questions
(Spec-Bench mt_bench by default, never trained on).

Each ``--held-out DIRS`` names data directories (comma-separated, as ``train eagle --data``
takes them); its held-out answers are the 5% split ``train eagle`` (seed 0) keeps out of
training on exactly those directories, so a head is scored on answers its run never saw.

    python experiments/eagle/eagle_heads.py \\
        --head old=/tmp/old-head --head new=src/.../eagle3-... \\
        --held-out data/sharegpt-smol \\
        --eval-questions ../shared/data/eval/spec_bench/question.jsonl \\
        --work /tmp/w/heads --out docs/eagle-heads
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from bench.data_scaling import eval_records  # noqa: E402
from specdec.heads.eagle_io import load_eagle  # noqa: E402
from specdec.target import load_model  # noqa: E402
from specdec.training.data import load_data_dirs  # noqa: E402
from specdec.training.eagle import (  # noqa: E402
    EagleTrainConfig,
    evaluate,
    extract_sequence_features,
    readout_for,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", action="append", required=True, help="NAME=DIR, repeatable")
    ap.add_argument("--held-out", action="append", default=[], help="DIR[,DIR...], repeatable")
    ap.add_argument("--eval-questions", help="Spec-Bench question.jsonl")
    ap.add_argument("--eval-group", default="mt_bench")
    ap.add_argument("--eval-count", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--work", required=True, help="features and answers cache")
    ap.add_argument("--out", required=True, help="directory for results.json and report.md")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    heads = dict(h.split("=", 1) for h in args.head)
    loaded = load_model()
    config = EagleTrainConfig(context=args.context)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sets: dict[str, object] = {}
    for spec in args.held_out:
        dirs = spec.split(",")
        _, held = load_data_dirs(dirs, loaded).split_for_training(config.held_out, config.seed)
        name = "held out of " + "+".join(Path(d).name for d in dirs)
        cache = work / ("heldout-" + "-".join(Path(d).name for d in dirs))
        sets[name] = extract_sequence_features(loaded, held, config, cache, tqdm, name)
    if args.eval_questions:
        records = eval_records(loaded, args, args.max_new_tokens)
        name = f"{args.eval_group} answers ({len(records)})"
        cache = work / f"eval-{args.eval_group}-eagle3"
        sets[name] = extract_sequence_features(loaded, records, config, cache, tqdm, name)
    rows = []
    for hname, hdir in heads.items():
        head = load_eagle(hdir, loaded)
        readout = readout_for(head, config, [])
        for sname, feats in sets.items():
            acc, tau = evaluate(head, feats, readout, config)  # type: ignore[arg-type]
            rows.append({"head": hname, "set": sname, "tau": round(tau, 4),
                         "step_accuracy": [round(a, 4) for a in acc]})  # fmt: skip
            tqdm.write(f"{hname} on {sname}: τ {tau:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=1))
    lines = [
        "# EAGLE heads on the same positions",
        "",
        "Simulated τ of greedy chain drafting, 3 steps deep (P(step j right | earlier right)).",
        "",
        "```",
        "python " + " ".join(sys.argv),
        "```",
        "",
        "| head | positions | chain τ | per step |",
        "|---|---|---:|---|",
    ]
    for r in rows:
        per = " / ".join(f"{a:.3f}" for a in r["step_accuracy"])
        lines.append(f"| {r['head']} | {r['set']} | {r['tau']:.3f} | {per} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
