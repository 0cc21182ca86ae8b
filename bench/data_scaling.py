"""How trained speculators improve with self-distilled data: Medusa heads (``--method medusa``)
or EAGLE-3 drafters (``--method eagle3``).

Trains on growing prefixes of one data directory (its order mixes every category, so a
prefix is a smaller sample of the same mix) and measures every checkpoint on the same held-out
records: every ``--hold-every``-th record, a set that stays put as ``specdec data generate``
appends answers. Per size it records the held-out top-1 of each head, the chained accuracies
the calibrated tree is sized from, that tree's size, and the simulated τ of a greedy walk over
it (1 + mean accepted drafts, from the heads' actual candidates). A log-linear fit of τ against
the number of answers says roughly how much data a τ target needs. Sizes already trained in
``--work`` are reused, so the curve can be extended after generating more data.

EAGLE-3 rows report the drafter's held-out per-step chain accuracies and the simulated τ of
greedy *chain* drafting ``--ttt-steps`` deep (a tree serves more); its runs share one feature
cache in ``--work``, so the target's pass over each answer is paid once for the whole curve.

    taskset -c 1 .venv/bin/python bench/data_scaling.py --data /work/data/sd-main \\
        --sizes 70,140,280,560 --hold-among 600 --epochs 2 --threads 1 --work /work/data/scaling \\
        --out bench-out/data-scaling
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.bench.workloads import load_questions, spread
from specdec.errors import SpecDecError
from specdec.heads.eagle_io import load_eagle
from specdec.heads.medusa import load_medusa
from specdec.request import encode_prompt
from specdec.speculators.medusa import best_sized_topology
from specdec.target import LoadedModel, load_model
from specdec.training.data import Record, SelfDistilledData, load_data
from specdec.training.eagle import (
    EagleTrainConfig,
    extract_sequence_features,
    readout_for,
    train_eagle,
)
from specdec.training.eagle import evaluate as eagle_evaluate
from specdec.training.medusa import (
    Features,
    MedusaTrainConfig,
    extract_features,
    simulated_tau,
    train_medusa,
)


@dataclass(frozen=True)
class Curve:
    """One learning curve: the target, the data, the training pool (prefixes of it are the
    sizes), the fixed held-out answers and the command line."""

    loaded: LoadedModel
    data: SelfDistilledData
    pool: list[Record]
    held: list[Record]
    sizes: list[int]
    args: argparse.Namespace


def astuple_shallow(c: Curve) -> tuple:
    return tuple(getattr(c, f.name) for f in fields(c))


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
    ap.add_argument("--method", choices=("medusa", "eagle3"), default="medusa")
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--ttt-steps", type=int, default=3, help="eagle3: chain depth trained/measured")
    ap.add_argument("--context", type=int, default=192, help="eagle3: prompt tokens kept")
    ap.add_argument("--soft-weight", type=float, default=0.0, help="see `train medusa`")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", default="data-scaling-runs", help="checkpoints, one per size")
    ap.add_argument("--out", default="bench-out/data-scaling")
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
    run = eagle_rows if args.method == "eagle3" else medusa_rows
    rows = run(Curve(loaded, data, pool, held, sizes, args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    write_report(out, rows, args, len(held), len(data.records))
    return 0


def checkpoints(
    curve: Curve, prefix: str, label: str, train: Callable[[SelfDistilledData, Path], object]
) -> Iterator[tuple[int, Path]]:
    """(size, checkpoint) per size, training the sizes ``--work`` does not hold yet."""
    for n in curve.sizes:
        ckpt = Path(curve.args.work) / f"{prefix}{n}"
        if not (ckpt / "config.json").is_file():
            tqdm.write(f"training {label} on {n} answers ({len(curve.held)} held out)")
            train(SelfDistilledData(curve.data.manifest, curve.pool[:n]), ckpt)
        yield n, ckpt


def medusa_rows(curve: Curve) -> list[dict]:
    loaded, data, pool, held, _, args = astuple_shallow(curve)
    config = MedusaTrainConfig(epochs=args.epochs, soft_weight=args.soft_weight)
    bench = None
    if args.eval_questions:
        bench = eval_features(loaded, args, data.manifest.max_new_tokens, config.num_heads)
    rows: list[dict] = []

    def train(subset: SelfDistilledData, ckpt: Path) -> object:
        return train_medusa(
            loaded, subset, ckpt, config, progress=tqdm, held_out_records=held,
            feature_cache=Path(args.work) / "medusa-features.safetensors",
        )  # fmt: skip

    for n, ckpt in checkpoints(curve, "answers-", "Medusa heads", train):
        cfg_file = ckpt / "config.json"
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
    return rows


def eagle_rows(curve: Curve) -> list[dict]:
    loaded, data, pool, held, _, args = astuple_shallow(curve)
    config = EagleTrainConfig(
        epochs=args.epochs, ttt_steps=args.ttt_steps, context=args.context, eval_every=10**9
    )
    work = Path(args.work)
    shared = work / "eagle3-features.safetensors"
    bench = None
    if args.eval_questions:
        records = eval_records(loaded, args, data.manifest.max_new_tokens)
        bench = extract_sequence_features(
            loaded, records, config, work / f"eval-{args.eval_group}-eagle3.safetensors", tqdm
        )
    rows: list[dict] = []

    def train(subset: SelfDistilledData, ckpt: Path) -> object:
        return train_eagle(
            loaded, subset, ckpt, config, progress=tqdm, held_out_records=held,
            feature_cache=shared,
        )  # fmt: skip

    for n, ckpt in checkpoints(curve, "eagle3-answers-", "EAGLE-3", train):
        cfg_file = ckpt / "config.json"
        info = json.loads(cfg_file.read_text())["specdec"]["extra"]["training"]
        acc = info["held_out_step_accuracy"]
        rows.append(
            {
                "answers": n,
                "train_positions": info["train_positions"],
                "held_out_positions": info["held_out_positions"],
                "top1": acc,
                "tau": info["held_out_simulated_tau"],
                "seconds": info["seconds"],
            }
        )
        if bench is not None:
            head = load_eagle(ckpt, loaded)
            readout = readout_for(head, config, pool[:n])
            step_acc, tau = eagle_evaluate(head, bench, readout, config)
            rows[-1]["eval_tau"] = round(tau, 4)
            rows[-1]["eval_step_accuracy"] = [round(a, 4) for a in step_acc]
        tqdm.write(f"{n} answers: simulated tau {rows[-1]['tau']:.3f}")
    return rows


def eval_records(
    loaded: LoadedModel, args: argparse.Namespace, max_new_tokens: int
) -> list[Record]:
    """The target's own greedy answers to evaluation questions (first turns), the positions a
    benchmark of that group would draft on; cached in ``--work``."""
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
    return records


def eval_features(
    loaded: LoadedModel, args: argparse.Namespace, max_new_tokens: int, num_heads: int
) -> Features:
    """Medusa features of :func:`eval_records` (cached in ``--work``)."""
    return extract_features(
        loaded,
        eval_records(loaded, args, max_new_tokens),
        num_heads,
        Path(args.work) / f"eval-{args.eval_group}-features.safetensors",
    )


def table(rows: list[dict], method: str, eval_group: str | None) -> list[str]:
    """The markdown table: Medusa's per-head and chained top-1 and tree size, or EAGLE-3's
    per-step chain accuracies (held out, and on the evaluation answers)."""
    fmt = lambda xs: " / ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    if method == "eagle3":
        head = ["answers", "train positions", "P(step j right | earlier right), held out"]
        cells = [lambda r: fmt(r["top1"])]
        if eval_group:
            head.append(f"same, {eval_group} answers")
            cells.append(lambda r: fmt(r["eval_step_accuracy"]))
    else:
        head = ["answers", "train positions", "top-1 per head", "top-1 after a right chain"]
        head.append("tree nodes")
        cells = [lambda r: fmt(r["top1"]), lambda r: fmt(r["chained_top1"])]
        cells.append(lambda r: str(r["tree_nodes"]))
    head.append("simulated τ (held out)")
    cells.append(lambda r: f"{r['tau']:.3f}")
    if eval_group:
        head.append(f"simulated τ ({eval_group} answers)")
        cells.append(lambda r: f"{r['eval_tau']:.3f}")
    head.append("train s")
    cells.append(lambda r: f"{r['seconds']:.0f}")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    for r in rows:
        values = [str(r["answers"]), str(r["train_positions"]), *(c(r) for c in cells)]
        lines.append("| " + " | ".join(values) + " |")
    return lines


def write_report(
    out: Path, rows: list[dict], args: argparse.Namespace, n_held: int, n_all: int
) -> None:
    xs = [float(r["answers"]) for r in rows]
    taus = [r["tau"] for r in rows]
    evaluated = f" simulated τ ({args.eval_group} answers)" if "eval_tau" in rows[0] else ""
    if args.method == "eagle3":
        what, unit = "EAGLE-3 drafters", "step"
        how = (
            "8192-token draft vocabulary. τ is simulated on the held-out positions: 1 + the "
            f"expected accepted drafts of greedy chain drafting {args.ttt_steps} deep (the "
            "per-step columns are P(step j right | the steps before it right))."
        )
    else:
        what, unit = "Medusa heads", "head"
        how = (
            "4 heads, 8192-token draft vocabulary. τ is simulated on the held-out positions: "
            "1 + mean drafts a greedy walk over the cost-sized calibrated tree accepts."
        )
    lines = [
        f"# {what} against the amount of self-distilled data",
        "",
        f"Data: `{args.data}` ({n_all} answers); every {args.hold_every}th answer held out "
        f"({n_held} answers, the same for every row); {args.epochs:g} epochs per run; {how}",
        "",
        "Command:",
        "",
        "```",
        "python bench/data_scaling.py " + " ".join(sys.argv[1:]),
        "```",
        "",
    ]
    lines += table(rows, args.method, args.eval_group if evaluated else None)
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
        ax2.plot(xs, [r["top1"][k] for r in rows], "o-", label=f"{unit} {k + 1}")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("self-distilled answers")
    ax2.set_ylabel("held-out top-1" if unit == "head" else "held-out P(step right | earlier right)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out / "data_scaling.png", dpi=120)


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except SpecDecError as e:  # bad paths, data from another model, ...: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
