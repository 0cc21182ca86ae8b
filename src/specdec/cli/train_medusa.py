"""``specdec train medusa``: Medusa-1 heads on self-distilled data."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from tqdm import tqdm

from specdec.cli.common import (
    BatchOpt,
    CategoriesOpt,
    DataDirsOpt,
    DeviceOpt,
    DtypeOpt,
    ExcludeCategoriesOpt,
    GgufOpt,
    MaxStepsOpt,
    ModelOpt,
    PrecisionOpt,
    ResumeOpt,
    ThreadsOpt,
    data_dirs,
    err_console,
    select_categories,
    user_errors,
)


def medusa(
    data: DataDirsOpt,
    out: Annotated[Path, typer.Option("--out", help="Checkpoint directory to write.")],
    heads: Annotated[int, typer.Option("--heads", help="Number of Medusa heads.")] = 4,
    layers: Annotated[int, typer.Option("--layers", help="Residual blocks per head.")] = 1,
    draft_vocab: Annotated[
        int,
        typer.Option(
            "--draft-vocab",
            help="Project onto the N most frequent response tokens (0 = full vocabulary). "
            "Smaller heads draft faster; tokens outside it cannot be drafted.",
        ),
    ] = 8192,
    epochs: Annotated[float, typer.Option("--epochs")] = 4.0,
    soft_weight: Annotated[
        float,
        typer.Option(
            "--soft-weight",
            help="Share of each head's loss taken against the target's full next-token "
            "distribution (read from the cached features) rather than the greedy label alone.",
        ),
    ] = 0.0,
    max_steps: MaxStepsOpt = None,
    lr: Annotated[float, typer.Option("--lr")] = 1e-3,
    batch: BatchOpt = 256,
    eval_every: Annotated[int, typer.Option("--eval-every")] = 200,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    resume: ResumeOpt = False,
    precision: PrecisionOpt = "auto",
    categories: CategoriesOpt = None,
    exclude_categories: ExcludeCategoriesOpt = None,
    threads: ThreadsOpt = None,
    model: ModelOpt = None,
    gguf: GgufOpt = None,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
) -> None:
    """Train Medusa heads for the target (frozen) on its own outputs."""

    from specdec.cli.common import load_target
    from specdec.training.data import load_data_dirs
    from specdec.training.medusa import MedusaTrainConfig, train_medusa

    with user_errors():
        config = MedusaTrainConfig(
            num_heads=heads,
            num_layers=layers,
            draft_vocab=draft_vocab,
            epochs=epochs,
            soft_weight=soft_weight,
            max_steps=max_steps,
            lr=lr,
            batch_positions=batch,
            eval_every=eval_every,
            seed=seed,
            precision=precision,
        )
        loaded = load_target(model, gguf, dtype, threads, device=device)
        dataset = select_categories(
            load_data_dirs(data_dirs(data), loaded), categories, exclude_categories
        )
        result = train_medusa(loaded, dataset, out, config, resume=resume, progress=tqdm)
    top = "  ".join(
        f"head {k + 1}: top-1 {t:.3f} ({a[0]:.3f} after a right chain)"
        for k, (t, a) in enumerate(zip(result.top1, result.accuracy, strict=True))
    )
    err_console.print(
        f"saved {out} after {result.steps} steps in {result.seconds:.0f} s "
        f"(features {result.feature_seconds:.0f} s; {result.train_positions} train / "
        f"{result.held_out_positions} held-out positions; draft vocabulary covers "
        f"{result.draft_vocab_coverage:.1%} of labels)\nheld-out accuracy: {top}\n"
        f"held-out simulated tau {result.simulated_tau:.3f} with the {result.tree_nodes}-node "
        "calibrated tree"
    )
