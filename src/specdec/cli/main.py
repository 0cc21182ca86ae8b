"""Entry point: ``specdec generate | serve | bench ...``."""

from __future__ import annotations

import typer

from specdec.cli.bench import BenchCommand, bench
from specdec.cli.calibrate import calibrate_app
from specdec.cli.common import SpecHelpCommand, speculators
from specdec.cli.data import data_app
from specdec.cli.export import export_app
from specdec.cli.generate import generate
from specdec.cli.serve import serve
from specdec.cli.train import train_app

app = typer.Typer(
    name="specdec",
    help="Lossless speculative decoding for Hugging Face causal language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command(cls=SpecHelpCommand)(generate)
app.command(cls=SpecHelpCommand)(serve)
app.command(cls=BenchCommand)(bench)
app.command()(speculators)
app.add_typer(data_app, name="data")
app.add_typer(train_app, name="train")
app.add_typer(calibrate_app, name="calibrate")
app.add_typer(export_app, name="export")


@app.callback()
def _root() -> None:
    """Lossless speculative decoding for Hugging Face causal language models."""


def main() -> None:
    app()


if __name__ == "__main__":
    main()
