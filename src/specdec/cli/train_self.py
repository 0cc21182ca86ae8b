"""``specdec train self``: a trained exit (adapter after layer L) for self-speculation."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from tqdm import tqdm

from specdec.cli.common import (
    BatchOpt,
    CategoriesOpt,
    DataDirsOpt,
    DtypeOpt,
    ExcludeCategoriesOpt,
    GgufOpt,
    MaxStepsOpt,
    ModelOpt,
    ResumeOpt,
    ThreadsOpt,
    data_dirs,
    err_console,
    select_categories,
    user_errors,
)


def self_exit(
    data: DataDirsOpt,
    layer: Annotated[int, typer.Option("--layer", help="Exit after this many target layers.")],
    out: Annotated[Path, typer.Option("--out", help="Adapter directory to write.")],
    rank: Annotated[
        int, typer.Option("--rank", help="Rank of the adapter's map (0 = full H x H).")
    ] = 0,
    draft_vocab: Annotated[
        int,
        typer.Option(
            "--draft-vocab",
            help="Score only token ids below N (a view of the target's LM head, no copy; "
            "0 = full vocabulary). Fewer rows draft faster; other tokens are never drafted.",
        ),
    ] = 16384,
    epochs: Annotated[float, typer.Option("--epochs")] = 2.0,
    max_steps: MaxStepsOpt = None,
    lr: Annotated[float, typer.Option("--lr")] = 2e-3,
    batch: BatchOpt = 256,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    resume: ResumeOpt = False,
    categories: CategoriesOpt = None,
    exclude_categories: ExcludeCategoriesOpt = None,
    threads: ThreadsOpt = None,
    model: ModelOpt = None,
    gguf: GgufOpt = None,
    dtype: DtypeOpt = "float32",
) -> None:
    """Train an exit adapter (target frozen) to match the target's distribution (KL).

    Use it with `--speculator self:adapter:OUT`, or let `specdec calibrate self`
    compare it with layer-skip drafts."""
    from specdec.cli.common import load_target
    from specdec.training.data import load_data_dirs
    from specdec.training.self_exit import SelfExitTrainConfig, train_self_exit

    with user_errors():
        config = SelfExitTrainConfig(
            layer=layer,
            rank=rank,
            draft_vocab=draft_vocab,
            epochs=epochs,
            max_steps=max_steps,
            lr=lr,
            batch_positions=batch,
            seed=seed,
        )
        loaded = load_target(model, gguf, dtype, threads)
        dataset = select_categories(
            load_data_dirs(data_dirs(data), loaded), categories, exclude_categories
        )
        result = train_self_exit(loaded, dataset, out, config, resume=resume, progress=tqdm)
    err_console.print(
        f"saved {out} after {result.steps} steps in {result.seconds:.0f} s "
        f"({result.train_positions} train / {result.held_out_positions} held-out positions); "
        f"held-out agreement with the target {result.agreement:.3f}; adapter "
        f"{result.adapter_bytes / 1e6:.2f} MB"
    )
