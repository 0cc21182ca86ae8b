"""``specdec data generate``: self-distilled training data from the target."""

from __future__ import annotations

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

data_app = typer.Typer(help="Training data for speculators.", no_args_is_help=True)


@data_app.command("generate")
def generate(
    prompts: Annotated[
        Path,
        typer.Option(
            "--prompts",
            help="JSONL with a 'prompt' (or 'turns') per line, e.g. "
            "shared/data/train/mix/prompts_mix.jsonl. Never an eval set.",
        ),
    ],
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
    threads: ThreadsOpt = None,
    model: ModelOpt = None,
    gguf: GgufOpt = None,
    dtype: DtypeOpt = "float32",
) -> None:
    """Have the target answer training prompts; store prompt + response token ids."""

    from specdec.cli.common import load_target
    from specdec.training.data import generate_data

    with user_errors():
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
            progress=tqdm,
        )
    err_console.print(
        f"{manifest.records} sequences in {out} ({len(manifest.shards)} shards; "
        f"{manifest.skipped_long_prompts} prompts over {max_prompt_tokens} tokens skipped)"
    )
