"""``specdec export vllm SPEC``: print the ``vllm serve`` command that runs SPEC in vLLM, writing
the checkpoint it needs (see :mod:`specdec.export.vllm` for what maps to what)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from specdec.cli.common import (
    DtypeOpt,
    GgufOpt,
    ModelOpt,
    announce_conversion,
    err_console,
    load_target,
    user_errors,
)

export_app = typer.Typer(
    help="Take a speculator to another serving engine.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@export_app.command("vllm")
def vllm(
    spec: Annotated[
        str,
        typer.Argument(
            help="Speculator spec, e.g. prompt-lookup:max_ngram=4, suffix, draft:model=DIR, "
            "medusa:DIR, eagle:dir=DIR,tree=5x4x24 (k=N caps the tokens drafted per step)."
        ),
    ],
    target: Annotated[
        str | None,
        typer.Option(
            "--target",
            help="Target name vLLM loads (Hub id or directory). Default: the --model directory; "
            "for a GGUF file, a model pack or the bundled model, the safetensors directory "
            "specdec converts it into (the weights it verifies).",
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Directory for the checkpoint vLLM needs (medusa, eagle, draft layers:N). "
            "Default: next to the source checkpoint, NAME-vllm.",
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of the command.")
    ] = False,
    model: ModelOpt = None,
    gguf: GgufOpt = None,
    dtype: DtypeOpt = "float32",
) -> None:
    """Print the `vllm serve` command that runs SPEC in vLLM; write the checkpoint it needs.

    Names what does not carry over, and refuses speculators vLLM has no counterpart for."""
    from transformers.utils import logging as hf_logging

    from specdec.export.vllm import LocalTarget, default_target_name, export_vllm

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # load_target turns it on for a one-time conversion
    with user_errors():
        note = None
        if target is None:
            announce_conversion(model, gguf)  # a GGUF target is served from its converted copy
            target, note = default_target_name(model, gguf)
        local = LocalTarget(
            model, gguf, dtype, loader=lambda: load_target(model, gguf, dtype, pin=False)
        )
        result = export_vllm(spec, target=target, local=local, out=out)
    if as_json:
        document = result.as_dict()
        if note:
            document["notes"].insert(0, note)
        typer.echo(json.dumps(document, indent=2))
        return
    typer.echo(result.command)
    for line in ([note] if note else []) + list(result.notes):
        err_console.print(f"note: {line}", highlight=False, soft_wrap=True)
    for path in result.written:
        err_console.print(f"wrote {path}", highlight=False, soft_wrap=True)
    for line in result.not_carried:
        err_console.print(f"not carried over: {line}", highlight=False, soft_wrap=True)
