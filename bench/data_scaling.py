"""How Medusa heads improve with self-distilled data: the learning curve behind issue 5's target.

Trains heads on growing prefixes of one data directory (its order mixes every category, so a
prefix is a smaller sample of the same mix) and measures every checkpoint on the same held-out
records: every ``--hold-every``-th record, a set that stays put as ``specdec data generate``
appends answers. Per size it records the held-out top-1 of each head, the chained accuracies
the calibrated tree is sized from, that tree's size, and the simulated τ of a greedy walk over
it (1 + mean accepted drafts, from the heads' actual candidates). A log-linear fit of τ against
the number of answers says roughly how much data a τ target needs. Sizes already trained in
``--work`` are reused, so the curve can be extended after generating more data.

    taskset -c 1 .venv/bin/python bench/data_scaling.py --data /work/data/sd-main \\
        --sizes 70,140,280,560 --hold-among 600 --epochs 2 --threads 1 --work /work/data/scaling \\
        --out docs/data-scaling
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.bench.workloads import load_questions, spread
from specdec.errors import SpecDecError
from specdec.heads.medusa import load_medusa
from specdec.request import encode_prompt
from specdec.speculators.medusa import best_sized_topology
from specdec.target import LoadedModel, load_model
from specdec.training.data import Record, SelfDistilledData, load_data
from specdec.training.medusa import (
    Features,
    MedusaTrainConfig,
    extract_features,
    simulated_tau,
    train_medusa,
)


def fit_log_linear(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, b) of y = a + b * log2(x), least squares."""
    lx = [math.log2(x) for x in xs]
    mx, my = sum(lx) / len(lx), sum(ys) / len(ys)
    var = sum((v - mx) ** 2 for v in lx)
    b = sum((v - mx) * (y - my) for v, y in zip(lx, ys, strict=True)) / var if var else 0.0
    return my - b * mx, b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="self-distilled data directory")
    ap.add_argument("--sizes", default="70,140,280,560", help="training answers per run")
    ap.add_argument("--hold-every", type=int, default=20, help="every N-th record is held out")
    ap.add_argument(
        "--hold-among",
        type=int,
        default=0,
        help="hold out only among the first N records (0 = all), so runs on data that has "
        "grown since are measured on the same answers",
    )
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--soft-weight", type=float, default=0.0, help="see `train medusa`")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", default="data-scaling-runs", help="checkpoints, one per size")
    ap.add_argument("--out", default="docs/data-scaling")
    ap.add_argument("--tau-target", type=float, default=2.0)
    ap.add_argument(
        "--eval-questions",
        help="also measure every checkpoint on the target's greedy answers to these questions "
        "(a Spec-Bench question.jsonl; measured, never trained on)",
    )
    ap.add_argument("--eval-group", default="mt_bench", help="task group of --eval-questions")
    ap.add_argument("--eval-count", type=int, default=16, help="questions, evenly spread")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model()
    data = load_data(args.data, loaded)
    among = args.hold_among or len(data.records)
    held = data.records[: among : args.hold_every]
    pool = [r for i, r in enumerate(data.records) if i >= among or i % args.hold_every]
    sizes = sorted({min(int(s), len(pool)) for s in args.sizes.split(",")})
    config = MedusaTrainConfig(epochs=args.epochs, soft_weight=args.soft_weight)
    bench = None
    if args.eval_questions:
        bench = eval_features(loaded, args, data.manifest.max_new_tokens, config.num_heads)
    rows = []
    for n in sizes:
        ckpt = Path(args.work) / f"answers-{n}"
        cfg_file = ckpt / "config.json"
        if not cfg_file.is_file():
            tqdm.write(f"training on {n} answers ({len(held)} held out)")
            subset = SelfDistilledData(data.manifest, pool[:n])
            train_medusa(loaded, subset, ckpt, config, progress=tqdm, held_out_records=held)
        cfg = json.loads(cfg_file.read_text())
        info = cfg["training"]
        rows.append(
            {
                "answers": n,
                "train_positions": info["train_positions"],
                "held_out_positions": info["held_out_positions"],
                "top1": info["held_out_top1"],
                "chained_top1": [round(a[0], 4) for a in cfg["accuracy"]],
                "tree_nodes": info["calibrated_tree_nodes"],
                "tau": info["held_out_simulated_tau"],
                "seconds": info["seconds"],
            }
        )
        if bench is not None:
            heads = load_medusa(ckpt)
            tree = best_sized_topology(heads.config.accuracy)
            rows[-1]["eval_tau"] = round(simulated_tau(heads, bench, tree), 4)
        tqdm.write(f"{n} answers: simulated tau {rows[-1]['tau']:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    write_report(out, rows, args, len(held), len(data.records))
    return 0


def eval_features(
    loaded: LoadedModel, args: argparse.Namespace, max_new_tokens: int, num_heads: int
) -> Features:
    """Features of the target's own greedy answers to evaluation questions (first turns), the
    positions a benchmark of that group would draft on; answers and features are cached in
    ``--work``."""
    questions = [
        q for q in load_questions(args.eval_questions).questions if q.group == args.eval_group
    ]
    picked = [questions[i] for i in spread(len(questions), args.eval_count)]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    answers_file = work / f"eval-{args.eval_group}-{len(picked)}.json"
    answers = json.loads(answers_file.read_text()) if answers_file.is_file() else {}
    records = []
    for i, q in enumerate(tqdm(picked, desc=f"{args.eval_group} answers", unit="question")):
        ids = encode_prompt(loaded.tokenizer, q.prompt, chat=True)
        key = str(q.question_id)
        if key not in answers:
            with torch.inference_mode():
                out = loaded.model.generate(
                    input_ids=torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False
                )
            answers[key] = out[0].tolist()
            answers_file.write_text(json.dumps(answers))
        records.append(Record(tuple(answers[key]), len(ids), i))
    return extract_features(
        loaded, records, num_heads, work / f"eval-{args.eval_group}-features.safetensors"
    )


def write_report(
    out: Path, rows: list[dict], args: argparse.Namespace, n_held: int, n_all: int
) -> None:
    xs = [float(r["answers"]) for r in rows]
    taus = [r["tau"] for r in rows]
    evaluated = f" simulated τ ({args.eval_group} answers)" if "eval_tau" in rows[0] else ""
    lines = [
        "# Medusa heads against the amount of self-distilled data",
        "",
        f"Data: `{args.data}` ({n_all} answers); every {args.hold_every}th answer held out "
        f"({n_held} answers, the same for every row); {args.epochs:g} epochs per run; 4 heads, "
        "8192-token draft vocabulary. τ is simulated on the held-out positions: 1 + mean drafts "
        "a greedy walk over the cost-sized calibrated tree accepts.",
        "",
        "Command:",
        "",
        "```",
        "python bench/data_scaling.py " + " ".join(sys.argv[1:]),
        "```",
        "",
        "| answers | train positions | top-1 per head | top-1 after a right chain | tree nodes "
        f"| simulated τ (held out) |{evaluated}{' |' if evaluated else ''} train s |",
        f"|---:|---:|---|---|---:|---:|{'---:|' if evaluated else ''}---:|",
    ]
    for r in rows:
        extra = f" {r['eval_tau']:.3f} |" if evaluated else ""
        lines.append(
            f"| {r['answers']} | {r['train_positions']} | "
            f"{' / '.join(f'{x:.3f}' for x in r['top1'])} | "
            f"{' / '.join(f'{x:.3f}' for x in r['chained_top1'])} | {r['tree_nodes']} | "
            f"{r['tau']:.3f} |{extra} {r['seconds']:.0f} |"
        )
    lines.append("")
    for name, key in (("held out", "tau"), (evaluated.strip(), "eval_tau")):
        if not name or len(rows) < 2:
            continue
        a, b = fit_log_linear(xs, [r[key] for r in rows])
        need = 2 ** ((args.tau_target - a) / b) if b > 0 else math.inf
        lines.append(
            f"- {name}: τ ≈ {a:.3f} + {b:.3f} · log2(answers), +{b:.3f} per doubling; "
            + (
                f"τ {args.tau_target:g} at about {need:,.0f} answers (a log-linear fit "
                "extrapolated past its data: an order of magnitude, not a promise)."
                if math.isfinite(need)
                else "not growing with the data; no extrapolation."
            )
        )
    lines += [
        "",
        "![simulated τ and head-1 accuracy against answers](data_scaling.png)",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(xs, taus, "o-", label="measured (held out)")
    if len(rows) > 1:
        a, b = fit_log_linear(xs, taus)
        grid = [
            min(xs) * 2 ** (i / 4) for i in range(int(4 * math.log2(max(xs) * 8 / min(xs))) + 1)
        ]
        ax1.plot(
            grid, [a + b * math.log2(x) for x in grid], "--", label="log-linear fit (held out)"
        )
    if evaluated:
        ax1.plot(xs, [r["eval_tau"] for r in rows], "s-", label=f"{args.eval_group} answers")
    ax1.axhline(args.tau_target, color="grey", lw=0.8)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("self-distilled answers")
    ax1.set_ylabel("simulated τ (tokens per verification)")
    ax1.legend()
    for k in range(len(rows[0]["top1"])):
        ax2.plot(xs, [r["top1"][k] for r in rows], "o-", label=f"head {k + 1}")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("self-distilled answers")
    ax2.set_ylabel("held-out top-1")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out / "data_scaling.png", dpi=120)


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except SpecDecError as e:  # bad paths, data from another model, ...: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
