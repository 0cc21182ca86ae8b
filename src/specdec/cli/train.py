"""``specdec train medusa | draft``: train speculators on self-distilled data."""

from __future__ import annotations

import typer

from specdec.cli.train_draft import draft
from specdec.cli.train_medusa import medusa

train_app = typer.Typer(help="Train speculators for a target model.", no_args_is_help=True)
train_app.command("medusa")(medusa)
train_app.command("draft")(draft)
