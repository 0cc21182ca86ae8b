"""``specdec calibrate self | cost``: per-model measurements the speculators start from."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from specdec.cli.common import DtypeOpt, GgufOpt, ModelOpt, ThreadsOpt, err_console, user_errors

calibrate_app = typer.Typer(
    help="Measure and save per-model choices for speculators.", no_args_is_help=True
)


@calibrate_app.command("self")
def calibrate_self(
    prompts: Annotated[
        Path,
        typer.Option("--prompts", help="JSONL of TRAINING prompts (evaluation sets are refused)."),
    ],
    category: Annotated[
        str | None,
        typer.Option("--category", help="Only prompts of this category (e.g. summarization)."),
    ] = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts", help="Prompts per candidate.")] = 3,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 48,
    num_draft_tokens: Annotated[
        int, typer.Option("--num-draft-tokens", "-k", help="Most tokens drafted per step.")
    ] = 6,
    candidate: Annotated[
        list[str] | None,
        typer.Option(
            "--candidate",
            help="Layers to try, as `--speculator self:layers=...` takes them (e.g. exit:8, "
            "skip:10-25; repeatable; default: early exits and middle skip windows derived "
            "from the layer count).",
        ),
    ] = None,
    adapter: Annotated[
        list[Path] | None,
        typer.Option("--adapter", help="A trained exit from `specdec train self` (repeatable)."),
    ] = None,
    thresholds: Annotated[
        str,
        typer.Option(
            "--thresholds", help="Confidence stops tried on the two fastest drafts (comma list)."
        ),
    ] = "0.3,0.5,0.7",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    save: Annotated[bool, typer.Option("--save/--no-save", help="Save the choice.")] = True,
    threads: ThreadsOpt = None,
    model: ModelOpt = None,
    gguf: GgufOpt = None,
    dtype: DtypeOpt = "auto",
) -> None:
    """Measure candidate drafts (greedy, paired with plain decoding) and save the fastest.

    Stage 1 measures every layer choice without a confidence stop; stage 2 adds each threshold
    to the two fastest. `--speculator self` without layers= then uses the saved choice."""
    from rich.table import Table
    from tqdm import tqdm

    from specdec.cli.common import load_target
    from specdec.errors import ConfigError
    from specdec.speculators.self_spec import save_calibration
    from specdec.training.self_calibration import default_candidates, measure, pick_prompts

    with user_errors():
        try:
            stops = [float(t) for t in thresholds.split(",") if t.strip()]
        except ValueError:
            raise ConfigError(
                f"--thresholds must be a comma list of numbers, got {thresholds!r}"
            ) from None
        loaded = load_target(model, gguf, dtype, threads)
        chosen = pick_prompts(prompts, num_prompts, category, seed)
        specs = list(candidate or default_candidates(int(loaded.config.num_hidden_layers)))
        specs += [f"adapter:{a.resolve()}" for a in adapter or []]
        kw = dict(max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens, progress=tqdm)
        rows = measure(loaded, specs, chosen, **kw)  # type: ignore[arg-type]
        top = [r.spec for r in sorted(rows, key=lambda r: -r.speedup)[:2]]
        staged = [f"{s}@{t:g}" for s in top for t in stops if t > 0]
        rows += measure(loaded, staged, chosen, **kw)  # type: ignore[arg-type]
    rows.sort(key=lambda r: -r.speedup)
    table = Table(title=f"self-speculation on {len(chosen)} training prompts (greedy)")
    for col in ("layers", "speedup", "tok/s", "plain tok/s", "τ", "acceptance"):
        table.add_column(col, justify="left" if col == "layers" else "right")
    for r in rows:
        table.add_row(
            r.spec,
            f"{r.speedup:.2f}x",
            f"{r.tokens_per_s:.1f}",
            f"{r.plain_tokens_per_s:.1f}",
            f"{r.mean_accepted:.2f}",
            f"{r.acceptance_rate:.2f}",
        )
    err_console.print(table)
    best = rows[0]
    if best.speedup < 1.0:
        err_console.print(
            f"note: no candidate beat plain decoding here (best {best.spec}, "
            f"{best.speedup:.2f}x); plain decoding (--speculator none) is faster on this "
            "machine"
        )
    if save:
        details = {
            "speedup": round(best.speedup, 3),
            "tokens_per_s": round(best.tokens_per_s, 2),
            "mean_accepted": round(best.mean_accepted, 3),
            "prompts": len(chosen),
            "category": category,
            "max_new_tokens": max_new_tokens,
            "measured": [
                {"spec": r.spec, "speedup": round(r.speedup, 3), "tau": round(r.mean_accepted, 3)}
                for r in rows
            ],
        }
        path = save_calibration(loaded, best.spec, details)
        err_console.print(f"saved self layers {best.spec} for this model in {path}")


@calibrate_app.command("cost")
def calibrate_cost(
    max_nodes: Annotated[
        int, typer.Option("--max-nodes", help="Largest chain/tree measured (1..64).")
    ] = 64,
    repeats: Annotated[int, typer.Option("--repeats", help="Passes per size (median).")] = 5,
    prefix_len: Annotated[
        int, typer.Option("--prefix-len", help="Tokens in the cache while timing.")
    ] = 200,
    save: Annotated[bool, typer.Option("--save/--no-save", help="Save the measurement.")] = True,
    threads: ThreadsOpt = None,
    model: ModelOpt = None,
    gguf: GgufOpt = None,
    dtype: DtypeOpt = "auto",
) -> None:
    """Measure the target's verification cost T(n), n = 1..64, for chains and trees, and save
    it for this model, dtype, device and CPU thread count. The adaptive draft length and
    `--speculator auto` start from these ratios T(n)/T(1) and keep refining them from the steps
    they time."""
    from rich.table import Table
    from tqdm import tqdm

    from specdec.cli.common import load_target
    from specdec.control.calibration import measure_verify_costs, save_cost_calibration
    from specdec.errors import ConfigError

    with user_errors():
        if not 1 <= max_nodes <= 64:
            raise ConfigError(f"--max-nodes must be in 1..64, got {max_nodes}")
        if repeats < 1:
            raise ConfigError(f"--repeats must be >= 1, got {repeats}")
        loaded = load_target(model, gguf, dtype, threads)
        calibration = measure_verify_costs(
            loaded,
            range(1, max_nodes + 1),
            repeats=repeats,
            prefix_len=prefix_len,
            progress=lambda it: tqdm(it, desc="timing verification passes", unit="pass"),
        )
    chain, tree = calibration.ratios(False), calibration.ratios(True)
    table = Table(
        title=f"verification cost over a {calibration.prefix_len}-token cache "
        f"({calibration.dtype}, {calibration.device}, {calibration.threads} threads)"
    )
    for col in ("n", "chain T(n) ms", "chain T(n)/T(1)", "tree T(n) ms", "tree T(n)/T(1)"):
        table.add_column(col, justify="right")
    shown = sorted({1, 2, 4, 8, 16, 24, 32, 48, 64, max_nodes} & set(chain))
    for n in shown:
        table.add_row(
            str(n),
            f"{calibration.chain[n] * 1e3:.1f}",
            f"{chain[n]:.2f}",
            f"{calibration.tree[n] * 1e3:.1f}",
            f"{tree[n]:.2f}",
        )
    err_console.print(table)
    if save:
        path = save_cost_calibration(loaded, calibration)
        err_console.print(f"saved the verification cost for this model in {path}")


@calibrate_app.command("vocab")
def calibrate_vocab(
    files: Annotated[
        list[Path] | None,
        typer.Argument(help="Text like the traffic the draft serves (.txt, .json, .jsonl)."),
    ] = None,
    sharegpt: Annotated[
        int,
        typer.Option(
            "--sharegpt",
            help="Also count the answers of this many ShareGPT conversations (scripts/"
            "install.sh installs the file; conversations overlapping an eval set are skipped).",
        ),
    ] = 0,
    eval_dir: Annotated[
        Path | None,
        typer.Option("--eval-dir", help="shared/data/eval, for the --sharegpt overlap filter."),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Write the ranking into this directory instead of the cache."),
    ] = None,
    model: ModelOpt = None,
    gguf: GgufOpt = None,
) -> None:
    """Count token frequencies for the model's tokenizer and save the ranking that
    `draft:...,vocab=N` keeps the N most frequent tokens of (a draft that scores fewer tokens
    reads less of its LM head per drafted token)."""
    import itertools

    import numpy as np
    from tqdm import tqdm

    from specdec.cli.common import load_target
    from specdec.errors import ConfigError
    from specdec.speculators.draft_vocab import (
        count_tokens,
        ranking_from_counts,
        save_ranking,
        texts_from_files,
    )

    with user_errors():
        if not files and sharegpt <= 0:
            raise ConfigError("give text files to count over, --sharegpt N, or both")
        # only the tokenizer and the vocabulary size count: stock fp32 skips repacking the
        # weights (oneDNN's float32 default would repack all of them for nothing)
        loaded = load_target(model, gguf, "float32-stock", None)
        vocab_size = int(loaded.config.vocab_size)
        del loaded.model
        texts: itertools.chain[str] = itertools.chain(texts_from_files(files or []))
        if sharegpt > 0:
            from specdec.cli.data import DEFAULT_EVAL_DIR
            from specdec.training.sources import EvalOverlap, sharegpt_answers, sharegpt_file

            overlap = EvalOverlap.from_eval_dir(eval_dir or DEFAULT_EVAL_DIR)
            texts = itertools.chain(texts, sharegpt_answers(sharegpt_file(), overlap, sharegpt))
        progress = tqdm(texts, desc="counting", unit="text")
        counts = count_tokens(loaded.tokenizer, progress, vocab_size)
        if counts.sum() == 0:
            raise ConfigError("the texts hold no tokens; nothing to rank")
        ranking = ranking_from_counts(counts)
        path = save_ranking(loaded.tokenizer, ranking, out)
    total = counts.sum()
    order = np.sort(counts)[::-1]
    cover = {n: float(order[:n].sum() / total) for n in (8192, 16384, 32768, 65536)}
    shown = ", ".join(f"{n}: {c:.2%}" for n, c in cover.items())
    err_console.print(f"{int(total):,} tokens counted; share covered by the top N: {shown}")
    err_console.print(f"saved the token ranking in {path}")
