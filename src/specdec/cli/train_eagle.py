"""``specdec train eagle``: an EAGLE-1 or EAGLE-3 drafter on self-distilled data."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from tqdm import tqdm

from specdec.cli.common import (
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


def _layers(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise typer.BadParameter(
            f"--aux-layers must be comma-separated integers, got {text!r}"
        ) from None


def _init_dir(text: str | None) -> str | None:
    if text != "bundled":
        return text
    from specdec.heads.bundled import EAGLE3_SMOLLM2

    return str(EAGLE3_SMOLLM2)


def eagle(
    data: DataDirsOpt,
    out: Annotated[Path, typer.Option("--out", help="Drafter directory to write.")],
    variant: Annotated[
        str, typer.Option("--variant", help="eagle3 (fused low/mid/high features) | eagle1.")
    ] = "eagle3",
    aux_layers: Annotated[
        str | None,
        typer.Option(
            "--aux-layers",
            help="EAGLE-3: target hidden-state indices to fuse, e.g. 2,15,27 (default: "
            "2, L/2, L-3 as vLLM).",
        ),
    ] = None,
    draft_vocab: Annotated[
        int,
        typer.Option(
            "--draft-vocab",
            help="EAGLE-3: the N most frequent response tokens form the draft vocabulary "
            "(0 = full).",
        ),
    ] = 8192,
    ttt_steps: Annotated[
        int, typer.Option("--ttt-steps", help="Training-time-test unroll steps.")
    ] = 3,
    epochs: Annotated[float, typer.Option("--epochs")] = 6.0,
    max_steps: MaxStepsOpt = None,
    lr: Annotated[float, typer.Option("--lr")] = 1e-3,
    batch: Annotated[int, typer.Option("--batch", help="Sequences per step.")] = 8,
    context: Annotated[
        int, typer.Option("--context", help="Prompt tokens kept before each response.")
    ] = 192,
    speculative_tokens: Annotated[
        int, typer.Option("--speculative-tokens", help="Default draft depth recorded.")
    ] = 5,
    verifier: Annotated[
        str | None,
        typer.Option(
            "--verifier",
            help="Target name written into the export for vLLM (default: the Hub id of the "
            "bundled model, else the target's path).",
        ),
    ] = None,
    init: Annotated[
        str | None,
        typer.Option(
            "--init",
            help="Continue this drafter (a directory, or `bundled` for the shipped head) "
            "instead of starting from the target's rows: its weights and draft vocabulary; "
            "train it on the answers it has not seen, usually at a lower --lr.",
        ),
    ] = None,
    eval_every: Annotated[int, typer.Option("--eval-every")] = 100,
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
    """Train an EAGLE drafter for the target (frozen) on its own outputs; writes the
    speculators format vLLM loads. Multi-GPU: `accelerate launch -m specdec.cli.main train
    eagle ...`."""
    from specdec.cli.common import load_target
    from specdec.training.data import load_data_dirs
    from specdec.training.eagle import EagleTrainConfig, train_eagle

    with user_errors():
        config = EagleTrainConfig(
            variant=variant,
            aux_layers=_layers(aux_layers),
            draft_vocab=draft_vocab,
            ttt_steps=ttt_steps,
            epochs=epochs,
            max_steps=max_steps,
            lr=lr,
            batch_sequences=batch,
            context=context,
            speculative_tokens=speculative_tokens,
            eval_every=eval_every,
            seed=seed,
            precision=precision,
            init_from=_init_dir(init),
        )
        loaded = load_target(model, gguf, dtype, threads, device=device)
        dataset = select_categories(
            load_data_dirs(data_dirs(data), loaded), categories, exclude_categories
        )
        result = train_eagle(
            loaded,
            dataset,
            out,
            config,
            resume=resume,
            progress=tqdm,
            verifier_name=verifier,
        )
    per_step = " ".join(f"{a:.3f}" for a in result.step_accuracy)
    err_console.print(
        f"saved {out} after {result.steps} steps in {result.seconds:.0f} s "
        f"(features {result.feature_seconds:.0f} s; {result.train_positions} train / "
        f"{result.held_out_positions} held-out positions; draft vocabulary covers "
        f"{result.draft_vocab_coverage:.1%} of labels)\nheld-out simulated τ "
        f"{result.simulated_tau:.2f}; chain acceptance per step {per_step}"
    )
