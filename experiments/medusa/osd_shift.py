"""Distribution shift: static Medusa heads vs the same heads learning online (method ``osd``).

Both serve the same stream of requests, interleaved request by request on the same target:
first one domain, then another (default: German-to-English translation, then code tasks, all
from the TRAINING prompt files, never the evaluation sets). The static heads never change; the
online ones distil the target's committed outputs in a background thread. Writes per-request
records (JSONL), a markdown table of τ and tokens/s per block of requests, and a PNG of both
against requests served. Greedy, so both outputs are checked identical to each other.

    taskset -c 0 .venv/bin/python experiments/medusa/osd_shift.py --medusa /work/data/medusa-smol \\
        --per-domain 40 --max-new-tokens 64 --threads 1 --out experiments/medusa/osd-shift
"""

from __future__ import annotations

import argparse
import html
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from specdec import SpeculativeEngine
from specdec.config import GenerationConfig
from specdec.heads.medusa import load_medusa
from specdec.speculators.medusa import resolve_topology, topology_sizer
from specdec.speculators.osd import OnlineConfig, OnlineMedusaSpeculator
from specdec.speculators.spec import options_for
from specdec.target import HFTarget, load_model

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "train"


def translation_prompts(n: int, rng: random.Random) -> list[str]:
    lines = (DATA / "wmt_de_en_opennmt_toy" / "train.de.txt").read_text().splitlines()
    picked = rng.sample([x for x in lines if 40 < len(x) < 300], n)
    return [f"Translate German to English: {html.unescape(x)}" for x in picked]


def code_prompts(n: int, rng: random.Random) -> list[str]:
    items = json.loads((DATA / "gpteacher" / "codegen-instruct.json").read_text())
    picked = rng.sample([x for x in items if len(x["instruction"]) < 400], n)
    return [(x["instruction"] + ("\n\n" + x["input"] if x["input"] else "")) for x in picked]


DOMAINS = {"translation": translation_prompts, "code": code_prompts}


def run(engine: SpeculativeEngine, ids: list[int], n: int) -> tuple[list[int], float, float]:
    config = GenerationConfig(max_new_tokens=n)
    tokens: list[int] = []
    stats = None
    for event in engine.stream_ids(ids, config):
        tokens.extend(event.token_ids)
        stats = event.stats
    assert stats is not None
    return tokens, stats.mean_accepted, stats.tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--medusa", required=True, help="static Medusa heads (the starting point)")
    ap.add_argument(
        "--domains",
        default="translation,code",
        help="comma-separated domains in serving order, each optionally NAME:REQUESTS",
    )
    ap.add_argument("--per-domain", type=int, default=40, help="requests of a domain without :N")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block", type=int, default=10, help="requests per table row")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    defaults = OnlineConfig()
    ap.add_argument("--lr", type=float, default=defaults.lr, help="online learning rate")
    ap.add_argument("--warmup", type=int, default=defaults.warmup, help="online LR warm-up steps")
    ap.add_argument(
        "--steps-per-round",
        type=int,
        default=defaults.steps_per_round,
        help="optimiser steps per batch of new traffic",
    )
    ap.add_argument(
        "--fixed-tree",
        action="store_true",
        help="the online heads keep the static heads' tree instead of resizing it from their "
        "measured accuracies (isolates what the weights alone gain)",
    )
    ap.add_argument("--out", type=Path, default=Path("osd-shift"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    plan = [(d.partition(":")[0], int(d.partition(":")[2] or args.per_domain)) for d in
            args.domains.split(",")]  # fmt: skip
    unknown = [d for d, _ in plan if d not in DOMAINS]
    if unknown:
        ap.error(f"unknown domain(s) {', '.join(unknown)}; known: {', '.join(DOMAINS)}")
    stream = [(d, p) for d, n in plan for p in DOMAINS[d](n, rng)]
    loaded = load_model(None)
    static = SpeculativeEngine.from_pretrained(
        loaded, speculator=options_for("medusa", dir=args.medusa)
    )
    heads = load_medusa(args.medusa)
    learner = OnlineMedusaSpeculator(
        heads,
        resolve_topology(None, heads),
        OnlineConfig(lr=args.lr, warmup=args.warmup, steps_per_round=args.steps_per_round),
        state_dir=args.out / "osd-state",
        sizer=None if args.fixed_tree else topology_sizer(None),
        sized=True,  # as the static engine: each step cuts the tree to what pays
    )
    online = SpeculativeEngine(HFTarget(loaded), loaded.tokenizer, learner, loaded=loaded)
    static.generate("Name three colours.", max_new_tokens=8)  # warm-up, outside the stream
    records = []
    with (args.out / "results.jsonl").open("w") as sink:
        for i, (domain, prompt) in enumerate(stream):
            ids = static.encode(prompt, chat=True)
            row = {"request": i, "domain": domain}
            outs = {}
            for name, engine in (("static", static), ("adaptive", online)):
                t0 = time.perf_counter()
                outs[name], row[f"{name}_tau"], row[f"{name}_tps"] = run(
                    engine, ids, args.max_new_tokens
                )
                row[f"{name}_seconds"] = time.perf_counter() - t0
            row["identical"] = outs["static"] == outs["adaptive"]
            row["osd_version"] = learner.version
            row["osd_steps"] = learner.trainer.steps
            row["static_nodes"] = len(static.speculator.current_topology(static.cost_model))
            row["adaptive_nodes"] = len(learner.current_topology)
            records.append(row)
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            print(
                f"{i:4d} {domain:12s} τ static {row['static_tau']:.2f} adaptive "
                f"{row['adaptive_tau']:.2f} | tok/s {row['static_tps']:.1f} "
                f"{row['adaptive_tps']:.1f} | weights v{row['osd_version']} | tree "
                f"{row['static_nodes']} / {row['adaptive_nodes']} nodes",
                flush=True,
            )
    learner.close()
    write_report(records, args)


def trained_on(heads_dir: str) -> str:
    """What the static heads were trained on, from their saved training record."""
    cfg = json.loads((Path(heads_dir) / "config.json").read_text()).get("training", {})
    text = f"{cfg.get('records', '?')} self-distilled answers to `{cfg.get('data', '?')}`"
    if cfg.get("categories"):
        text += f" (categories {', '.join(cfg['categories'])} only)"
    if cfg.get("exclude_categories"):
        text += f" (without {', '.join(cfg['exclude_categories'])})"
    return text


def write_report(records: list[dict], args: argparse.Namespace) -> None:
    lines = [
        "# Distribution shift: static vs online-distilled Medusa heads",
        "",
        "Command:",
        "",
        "```",
        " ".join(["python", *sys.argv]),
        "```",
        "",
        f"Heads `{args.medusa}`, trained on {trained_on(args.medusa)}; online learning rate "
        f"{args.lr:g} (warm-up {args.warmup} steps, {args.steps_per_round} steps per round of "
        f"new traffic; tree "
        + (
            "fixed to the static heads'"
            if args.fixed_tree
            else "resized from the online heads' measured accuracies at each publication"
        )
        + f"); requests served in order: {args.domains} "
        f"({args.per_domain} where no count is given), "
        f"{args.max_new_tokens} new tokens, greedy, {args.threads} torch thread(s); static and "
        "adaptive interleaved per request on the same target. The online trainer is a "
        "background thread of the same process: on a CPU shared with decoding its steps slow "
        "both runs' tokens/s, so τ is the comparison timing does not confound. Outputs "
        "identical: "
        f"{sum(r['identical'] for r in records)}/{len(records)}.",
        "",
        "| requests | domain | τ static | τ adaptive | τ ratio | tok/s static | tok/s adaptive "
        "| online steps | tree nodes static / adaptive |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for start in range(0, len(records), args.block):
        block = records[start : start + args.block]
        mean = {
            k: statistics.mean(r[k] for r in block) for k in block[0] if k.endswith(("tau", "tps"))
        }
        lines.append(
            f"| {start + 1}-{start + len(block)} | {block[0]['domain']} | "
            f"{mean['static_tau']:.2f} | {mean['adaptive_tau']:.2f} | "
            f"{mean['adaptive_tau'] / mean['static_tau']:.2f} | {mean['static_tps']:.2f} | "
            f"{mean['adaptive_tps']:.2f} | {block[-1]['osd_steps']} | "
            f"{block[-1].get('static_nodes', '?')} / {block[-1].get('adaptive_nodes', '?')} |"
        )
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    xs = [r["request"] + 1 for r in records]
    w = max(1, args.block // 2)
    for ax, key, label in (
        (axes[0], "tau", "τ (tokens per target pass)"),
        (axes[1], "tps", "tokens/s"),
    ):
        for name in ("static", "adaptive"):
            ys = [r[f"{name}_{key}"] for r in records]
            smooth = [statistics.mean(ys[max(0, i - w + 1) : i + 1]) for i in range(len(ys))]
            ax.plot(xs, smooth, label=f"{name} (moving mean of {w})")
        for i in range(1, len(records)):
            if records[i]["domain"] != records[i - 1]["domain"]:
                ax.axvline(i + 0.5, color="grey", linestyle=":")
        ax.set_ylabel(label)
        ax.legend()
    axes[1].set_xlabel("requests served")
    fig.tight_layout()
    fig.savefig(args.out / "osd_shift.png", dpi=120)


if __name__ == "__main__":
    main()
