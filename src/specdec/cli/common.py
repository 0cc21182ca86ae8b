"""Pieces shared by the CLI commands: model options, error reporting, engine construction."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console

from specdec.errors import SpecDecError

if TYPE_CHECKING:
    from specdec.training.data import SelfDistilledData

err_console = Console(stderr=True)

ModelOpt = Annotated[
    Path | None,
    typer.Option("--model", help="Local Hugging Face model directory (default: bundled model)."),
]
GgufOpt = Annotated[Path | None, typer.Option("--gguf", help="GGUF file to load as the target.")]
MethodOpt = Annotated[
    str,
    typer.Option(
        "--method",
        "-m",
        help="Speculator: none | prompt-lookup | draft | medusa | eagle | lookahead | suffix "
        "| self | auto (a controller picks one per step).",
    ),
]
LookaheadOpt = Annotated[
    str | None,
    typer.Option(
        "--lookahead",
        help="W,N,G for --method lookahead: window W, n-gram size N, G pool n-grams verified "
        "per step (default: measured on a CPU).",
    ),
]
SuffixCacheOpt = Annotated[
    Path | None,
    typer.Option(
        "--suffix-cache",
        help="File --method suffix loads at start and saves to, so the cache of earlier "
        "outputs survives restarts.",
    ),
]
SelfDraftOpt = Annotated[
    str | None,
    typer.Option(
        "--self-draft",
        help="Layers --method self drafts with (e.g. exit:8, skip:10-25, adapter:DIR); "
        "default: the choice `specdec calibrate self` saved for this model.",
    ),
]
EagleOpt = Annotated[
    str | None,
    typer.Option(
        "--eagle",
        help="EAGLE drafter directory for --method eagle (from `specdec train eagle`, or a "
        "speculators / EAGLE-authors checkpoint for this model).",
    ),
]
EagleTreeOpt = Annotated[
    str | None,
    typer.Option(
        "--eagle-tree",
        help="DEPTH,TOPK,TOTAL of EAGLE-2's dynamic tree (default 5,4,24; the node count is "
        "then sized per step by expected gain against verification cost).",
    ),
]
AutoArmsOpt = Annotated[
    str | None,
    typer.Option(
        "--arms",
        help="Speculators --method auto chooses from, e.g. prompt-lookup+suffix (default: "
        "prompt lookup, suffix, lookahead, and medusa/draft/self when --medusa/--draft/"
        "--self-draft is given).",
    ),
]
OsdOpt = Annotated[
    str | None,
    typer.Option(
        "--osd",
        help="Directory where --method osd (Medusa heads that keep learning from the requests "
        "served, started from --medusa) keeps its adapted state; with --method auto it adds "
        "that speculator.",
    ),
]
MedusaOpt = Annotated[
    str | None,
    typer.Option("--medusa", help="Medusa checkpoint directory for --method medusa."),
]
TreeOpt = Annotated[
    str | None,
    typer.Option(
        "--tree",
        help="Tree topology for tree speculators: calibrated[:NODES] (default, from the "
        "checkpoint's measured head accuracies), a preset (chain, sparse-8/16/32/64) or a "
        "JSON file of paths.",
    ),
]
TypicalOpt = Annotated[
    bool,
    typer.Option(
        "--typical",
        help="Medusa's typical acceptance for sampled requests: faster, but LOSSY (output no "
        "longer follows the target's distribution exactly). Greedy is unaffected.",
    ),
]
DraftOpt = Annotated[
    str | None,
    typer.Option("--draft", help="Draft for --method draft: a model directory or layers:N."),
]
KOpt = Annotated[int, typer.Option("--num-draft-tokens", "-k", help="Tokens drafted per step.")]
DtypeOpt = Annotated[
    str,
    typer.Option(
        "--dtype",
        help="float32 (default, oneDNN fast path) | float32-stock | fp16-weights | bfloat16 "
        "| float64.",
    ),
]

AdaptiveOpt = Annotated[
    bool,
    typer.Option(
        "--adaptive/--fixed",
        help="Adaptive: draft per step the length (<= K) that maximises measured tokens/s, "
        "nothing when drafting does not pay. Fixed: always draft K.",
    ),
]

ResumeOpt = Annotated[
    bool, typer.Option("--resume", help="Continue from the last checkpoint in --out.")
]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", help="torch threads.")]
# shared by the trainers
DataOpt = Annotated[
    Path, typer.Option("--data", help="Self-distilled data from `specdec data generate`.")
]
MaxStepsOpt = Annotated[
    int | None, typer.Option("--max-steps", help="Stop after N optimiser steps (smoke runs).")
]
BatchOpt = Annotated[int, typer.Option("--batch", help="Token positions per step.")]
CategoriesOpt = Annotated[
    str | None,
    typer.Option(
        "--categories",
        help="Train only on records whose prompt has one of these comma-separated categories "
        "(the prompt file's `category` field, e.g. chat,roleplay).",
    ),
]
ExcludeCategoriesOpt = Annotated[
    str | None,
    typer.Option(
        "--exclude-categories",
        help="Leave out records of these comma-separated categories (e.g. translation,code).",
    ),
]


def select_categories(
    dataset: SelfDistilledData, include: str | None, exclude: str | None
) -> SelfDistilledData:
    """``dataset`` restricted by the ``--categories`` / ``--exclude-categories`` options."""

    def names(text: str | None) -> list[str]:
        return [x.strip() for x in (text or "").split(",") if x.strip()]

    return dataset.select(names(include), names(exclude))


T = TypeVar("T")


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn specdec's typed errors into one line on stderr and exit code 2, no traceback."""
    try:
        yield
    except SpecDecError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        err_console.print("interrupted")
        raise typer.Exit(130) from None


def load_target(
    model: Path | None, gguf: Path | None, dtype: str, threads: int | None = None
) -> Any:
    """Load the target alone (training, data generation), announcing a one-time conversion;
    ``threads`` sets torch's thread count first."""
    from specdec.target import load_model

    if threads:
        import torch

        torch.set_num_threads(threads)
    _announce_conversion(model, gguf)
    return load_model(model, gguf=gguf, dtype=dtype)


def _announce_conversion(model: Path | None, gguf: Path | None) -> None:
    from transformers.utils import logging as hf_logging

    from specdec.target import loading

    hf_logging.set_verbosity_error()
    converting = False
    if model is None:
        gguf_path = gguf if gguf is not None else loading.default_gguf_path()
        if gguf_path.is_file() and not loading.is_converted(gguf_path):
            converting = True
            err_console.print(
                f"Converting {gguf_path.name} to safetensors once (about 30 s); cached under "
                f"{loading.cache_root()}"
            )
    # transformers' own bar shows the one-time conversion; the per-load bar is noise
    if converting:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()


def load_engine(
    model: Path | None,
    gguf: Path | None,
    method: str,
    draft: str | None,
    num_draft_tokens: int,
    dtype: str,
    adaptive: bool = True,
    **options: Any,
) -> Any:
    """Build the engine, telling the user about the one-time GGUF conversion."""
    from specdec.engine import SpeculativeEngine

    _announce_conversion(model, gguf)
    return SpeculativeEngine.from_pretrained(
        model,
        gguf=gguf,
        method=method,
        draft=draft,
        num_draft_tokens=num_draft_tokens,
        dtype=dtype,
        adaptive=adaptive,
        **options,
    )


def run_guarded(fn: Callable[[], T]) -> T:
    with user_errors():
        return fn()


def is_tty() -> bool:
    return sys.stdout.isatty()
