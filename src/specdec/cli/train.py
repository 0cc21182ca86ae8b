"""``specdec train medusa | draft | self | eagle``: train speculators on self-distilled data."""

from __future__ import annotations

import typer

from specdec.cli.train_draft import draft
from specdec.cli.train_eagle import eagle
from specdec.cli.train_medusa import medusa
from specdec.cli.train_self import self_exit

train_app = typer.Typer(help="Train speculators for a target model.", no_args_is_help=True)
train_app.command("medusa")(medusa)
train_app.command("draft")(draft)
train_app.command("self")(self_exit)
train_app.command("eagle")(eagle)
