"""``specdec train draft``: distil a small draft model from the target (DistillSpec)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from tqdm import tqdm

from specdec.cli.common import (
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

if TYPE_CHECKING:
    from specdec.training.data import SelfDistilledData


def draft(
    data: DataDirsOpt,
    out: Annotated[
        Path,
        typer.Option("--out", help="Output: a Hugging Face model directory (+ checkpoint/)."),
    ],
    layers: Annotated[
        int, typer.Option("--layers", help="Decoder layers of the draft (< the target's).")
    ] = 4,
    hidden: Annotated[
        int | None,
        typer.Option(
            "--hidden",
            help="Hidden size (default: the target's, initialised from its first layers; "
            "another size starts from random weights).",
        ),
    ] = None,
    epochs: Annotated[
        int | None,
        typer.Option("--epochs", help="Passes over the data (default 1, or as --max-steps needs)."),
    ] = None,
    max_steps: MaxStepsOpt = None,
    lr: Annotated[float, typer.Option("--lr", help="Peak AdamW learning rate.")] = 3e-4,
    batch_tokens: Annotated[
        int, typer.Option("--batch-tokens", help="Padded tokens per batch.")
    ] = 2048,
    ce_weight: Annotated[
        float,
        typer.Option("--ce-weight", help="Weight of cross entropy on the target's tokens vs KL."),
    ] = 0.0,
    teacher_topk: Annotated[
        int,
        typer.Option(
            "--teacher-topk",
            help="0: the target's full distribution from a forward per batch (exact). K: run "
            "the target once and cache its top K tokens per position (faster over epochs).",
        ),
    ] = 0,
    train_embeddings: Annotated[
        bool | None,
        typer.Option(
            "--train-embeddings/--freeze-embeddings",
            help="Train the embeddings and LM head too (default: only for a random-init draft).",
        ),
    ] = None,
    held_out: Annotated[
        float, typer.Option("--held-out", help="Fraction of sequences held out for evaluation.")
    ] = 0.05,
    eval_every: Annotated[int, typer.Option("--eval-every", help="Steps between evals.")] = 100,
    checkpoint_every: Annotated[
        int, typer.Option("--checkpoint-every", help="Steps between checkpoints.")
    ] = 200,
    seed: Annotated[int, typer.Option("--seed", help="Batch order and random init.")] = 0,
    resume: ResumeOpt = False,
    categories: CategoriesOpt = None,
    exclude_categories: ExcludeCategoriesOpt = None,
    threads: ThreadsOpt = None,
    model: ModelOpt = None,
    gguf: GgufOpt = None,
    dtype: DtypeOpt = "float32",
) -> None:
    """Distil a small draft model (the target's architecture, fewer layers) from the target by
    matching its token distributions on self-distilled data (KL(p || q), DistillSpec)."""

    from specdec.cli.common import load_target
    from specdec.training.distill import train_draft

    with user_errors():
        loaded = load_target(model, gguf, dtype, threads)
        dirs = data_dirs(data)
        source: Path | SelfDistilledData
        if len(dirs) == 1 and not (categories or exclude_categories):
            source = dirs[0]  # a path: the run records its manifest
        else:
            from specdec.training.data import load_data_dirs

            dataset = load_data_dirs(dirs, loaded)
            source = select_categories(dataset, categories, exclude_categories)
        result = train_draft(
            loaded,
            source,
            out,
            layers=layers,
            hidden=hidden,
            epochs=epochs,
            max_steps=max_steps,
            lr=lr,
            batch_tokens=batch_tokens,
            ce_weight=ce_weight,
            teacher_topk=teacher_topk,
            train_embeddings=train_embeddings,
            held_out=held_out,
            eval_every=eval_every,
            checkpoint_every=checkpoint_every,
            seed=seed,
            resume=resume,
            progress=tqdm,
        )
    first, last = result.initial, result.final
    err_console.print(
        f"{result.steps} steps ({result.epochs:.2f} epochs, {result.tokens} tokens) in "
        f"{result.wall_seconds:.0f} s; held-out agreement with the target's argmax "
        f"{first.agreement:.3f} -> {last.agreement:.3f}, KL {first.kl:.3f} -> {last.kl:.3f}",
        highlight=False,
    )
    err_console.print(
        f"draft saved in {out}; try `specdec generate --speculator draft:{out} --compare`",
        highlight=False,
    )
