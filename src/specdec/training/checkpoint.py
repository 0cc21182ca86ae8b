"""The one checkpoint format of every trainer: ``OUT/checkpoint/`` holding the trained module
(``module.safetensors``), the optimiser, sampler and torch RNG state (``state.pt``) and a readable
record (``state.json``: step, history and what the run was: trainer, target, data, settings).

Why a directory replaced whole: an interrupted save must leave the previous checkpoint, never
half of each, so the new one is written next to it and swapped in by renames. Why the record is
checked before anything is loaded: resuming with another target, other data or other settings
would silently train a different model than the one the run started, so each of these is refused
with the difference named. Why the sampler and RNG state: a resumed run must see the same batches
as an uninterrupted one, or "resume" only approximates the run it continues.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdec.errors import CheckpointError, ConfigError
from specdec.target.loading import LoadedModel, identity_mismatch
from specdec.training.data import Record, SelfDistilledData

CHECKPOINT_DIR = "checkpoint"
FORMAT = "specdec-training/1"
# what may change between a run and its resumption: its length and its reporting cadence
FREE_SETTINGS = frozenset({"epochs", "max_steps", "eval_every", "checkpoint_every"})


@dataclass
class LoopState:
    """What a run has done so far; restored on resume."""

    step: int = 0
    tokens: int = 0  # training tokens seen, where a trainer counts them
    wall_seconds: float = 0.0  # over this run and any it resumed
    history: list[dict[str, float]] = field(default_factory=list)  # one entry per evaluation


def check_schedule(
    *, max_steps: int | None, epochs: float, lr: float, batch: int, held_out: float
) -> None:
    """The settings every trainer shares, validated with the CLI's option names."""
    if max_steps is not None and max_steps < 1:
        raise ConfigError(f"--max-steps must be >= 1, got {max_steps}")
    if epochs <= 0 or lr <= 0 or batch < 1:
        raise ConfigError("epochs, lr and batch size must be positive")
    if not 0.0 <= held_out < 1.0:
        raise ConfigError(f"held-out fraction must be in [0, 1), got {held_out}")


def data_fingerprint(data: SelfDistilledData, held_out: Sequence[Record] | None = None) -> str:
    """The data set (its manifest), the categories selected from it and, when the trainer was
    given one, the held-out set (it decides what is trained on)."""
    held = None if held_out is None else sorted(r.index for r in held_out)
    text = data.manifest.to_json() + json.dumps([data.selection, held], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def run_identity(
    trainer: str,
    loaded: LoadedModel,
    data: SelfDistilledData,
    config: Any,
    *,
    held_out: Sequence[Record] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The record that a resumed run must match: trainer, target, data and the settings in the
    dataclass ``config`` (all but its :data:`FREE_SETTINGS`); ``extra`` is recorded as is."""
    settings = {k: v for k, v in asdict(config).items() if k not in FREE_SETTINGS}
    return {
        "trainer": trainer,
        "target": loaded.identity(),
        "data_fingerprint": data_fingerprint(data, held_out),
        "settings": json.loads(json.dumps(settings)),  # tuples as the record reads them back
        **extra,
    }


class CheckpointStore:
    """``OUT/checkpoint/`` for the run described by ``meta`` (see :func:`run_identity`)."""

    def __init__(self, out: Path, meta: dict[str, Any]) -> None:
        self.out = out
        self.dir = out / CHECKPOINT_DIR
        self.meta = {"format": FORMAT, **meta}

    def exists(self) -> bool:
        return self.dir.exists()

    def check_start(self, resume: bool) -> None:
        """Refuse to resume nothing, and to start over (and so overwrite) a resumable run."""
        if resume and not (self.dir / "state.json").is_file():
            raise CheckpointError(
                f"{self.out} holds no checkpoint to resume; run without --resume to start a new "
                "training"
            )
        if not resume and self.exists():
            raise CheckpointError(
                f"{self.out} holds an interrupted training run; pass --resume to continue it, or "
                "choose another --out"
            )

    def save(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: dict[str, Any],
        state: LoopState,
    ) -> None:
        from safetensors.torch import save_model

        self.out.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".checkpoint.", dir=self.out))
        try:
            save_model(module, str(tmp / "module.safetensors"))
            tensors = {
                "optimizer": optimizer.state_dict(),
                "sampler": sampler,
                "torch_rng": torch.get_rng_state(),
            }
            torch.save(tensors, tmp / "state.pt")
            record = {**self.meta, **asdict(state)}
            (tmp / "state.json").write_text(json.dumps(record, indent=2), encoding="utf-8")
            old = self.out / ".checkpoint.old"
            shutil.rmtree(old, ignore_errors=True)
            if self.dir.exists():
                self.dir.rename(old)
            tmp.chmod(0o755)
            tmp.rename(self.dir)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def load(
        self, module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[LoopState, dict[str, Any]]:
        """Check the record against this run, then restore ``module``, ``optimizer`` and the
        torch RNG in place; returns the loop state and the sampler's state."""
        from safetensors.torch import load_model

        where = self.dir / "state.json"
        try:
            saved = json.loads(where.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"cannot resume from {where} ({type(e).__name__}: {e}); delete {self.dir} to "
                "start over"
            ) from e
        self._check(saved)
        try:
            load_model(module, str(self.dir / "module.safetensors"))
            tensors = torch.load(self.dir / "state.pt", map_location="cpu", weights_only=True)
            optimizer.load_state_dict(tensors["optimizer"])
            torch.set_rng_state(tensors["torch_rng"])
            state = LoopState(
                step=int(saved["step"]),
                tokens=int(saved["tokens"]),
                wall_seconds=float(saved["wall_seconds"]),
                history=list(saved["history"]),
            )
            return state, dict(tensors["sampler"])
        except Exception as e:  # truncated files raise assorted errors
            raise CheckpointError(
                f"cannot resume from {self.dir} (truncated or corrupt?): {type(e).__name__}: "
                f"{e}; delete it to start over"
            ) from e

    def _check(self, saved: dict[str, Any]) -> None:
        here = self.meta
        if saved.get("format") != FORMAT or saved.get("trainer") != here["trainer"]:
            raise CheckpointError(
                f"{self.dir} is not a {FORMAT} checkpoint of the {here['trainer']} trainer "
                f"(it says {saved.get('format')!r}, {saved.get('trainer')!r}); use another --out"
            )
        problem = identity_mismatch(saved.get("target", {}), here["target"])
        if problem:
            raise CheckpointError(
                f"the checkpoint in {self.out} was trained for another target ({problem}); use "
                "another --out or the same --model"
            )
        if saved.get("data_fingerprint") != here["data_fingerprint"]:
            raise CheckpointError(
                f"the checkpoint in {self.out} was trained on other data (or other categories "
                "of it); resume with the same --data and categories, or use another --out"
            )
        old = saved.get("settings", {})
        new = here["settings"]
        diff = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        if diff:
            shown = ", ".join(f"{k}={old.get(k)!r} (now {new.get(k)!r})" for k in diff)
            raise CheckpointError(
                f"the checkpoint in {self.out} was trained with other settings ({shown}); resume "
                "with those, or use another --out"
            )

    def discard(self) -> None:
        """Drop the checkpoint once the run's result is saved (trainers that do not keep it)."""
        shutil.rmtree(self.dir, ignore_errors=True)
