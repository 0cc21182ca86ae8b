"""Self-speculation (``self``): the target drafts for itself with a subset of its layers.

The draft shares the target's modules (no weight copy, the target's config untouched; see
:mod:`specdec.target.early_exit`) and drafts a chain over its own KV cache with
:class:`DraftModelSpeculator` (greedy argmax, or sampled with q for rejection sampling). The chain
stops early after a token whose draft probability is below ``min_confidence`` (Draft & Verify's
dynamic draft length); the adaptive budget still caps its length.

``self_draft`` spec strings (layer numbers 0-based, ranges inclusive):

* ``exit:N`` -- early exit: the first N layers, then the final norm and LM head;
* ``skip:A-B[,C...]`` -- every layer but these (Draft & Verify / SWIFT layer skipping);
* ``keep:A-B[,C...]`` -- exactly these layers (must include 0);
* ``adapter:DIR`` -- a trained exit from ``specdec train self`` (first L layers + adapter);
* any of them may end in ``@T``: stop drafting below confidence T (0 <= T < 1).

Without ``self_draft`` the choice saved by ``specdec calibrate self`` for this target is used
(``~/.cache/specdec/self/<identity digest>.json``), else :func:`default_spec` (with a note in
the speculator's description and a log warning).

Why no LayerSkip-style shared KV: the draft's KV entries could replace the target's only for a
*prefix* of layers fed the same hidden states, i.e. for early exits, and only for draft tokens
the target later accepts. Untrained early exits of the bundled model rarely agree with it
(docs/self_speculation.md); the useful drafts are the trained exit (its shared-prefix KV is at
most L=8 of 30 layers, and writing it into the target's cache costs a copy per step, while the
target recomputes those 8 layers for all k+1 tokens in one batched pass that costs little more
than a one-token pass) and skip sets (whose kept layers past the first skipped one see other
inputs than in the target, so their KV differs). The saving is at most a few percent of a
verification pass, below our run-to-run noise, so we keep the simpler separate draft cache.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from torch import nn
from transformers import PreTrainedModel

from specdec.errors import CheckpointError, ConfigError
from specdec.speculators.draft_model import DraftModelSpeculator
from specdec.speculators.spec import SpeculatorOptions, option, register
from specdec.target import LoadedModel, ModelRunner
from specdec.target.early_exit import decoder_layers, layer_subset_model
from specdec.target.loading import calibration_file, identity_mismatch

log = logging.getLogger(__name__)


def default_spec(num_layers: int) -> str:
    """The draft used when nothing is calibrated: an early exit at 2/3 of the depth with a high
    confidence stop, the fastest training-free choice measured on the bundled model, though
    still slower than plain decoding there (docs/self_speculation.md). Calibrate, and train an
    exit, instead.

    >>> default_spec(30)
    'exit:20@0.7'
    """
    return f"exit:{max(1, min(num_layers - 1, round(num_layers * 2 / 3)))}@0.7"


KINDS = ("exit", "skip", "keep", "adapter")


@dataclass(frozen=True)
class SelfDraftSpec:
    """A parsed ``self_draft``: which layers (or which adapter) and the confidence stop."""

    kind: str  # exit | skip | keep | adapter
    layers: tuple[int, ...] = ()  # kept layers, ascending (empty for adapters until loaded)
    adapter: str | None = None
    min_confidence: float = 0.0

    def __str__(self) -> str:
        return self.text

    @property
    def text(self) -> str:
        if self.kind == "adapter":
            body = f"adapter:{self.adapter}"
        elif self.kind == "exit":
            body = f"exit:{len(self.layers)}"
        else:
            body = f"keep:{format_ranges(self.layers)}"
        return body + (f"@{self.min_confidence:g}" if self.min_confidence else "")


def format_ranges(layers: tuple[int, ...] | list[int]) -> str:
    """
    >>> format_ranges([0, 1, 2, 5, 7, 8])
    '0-2,5,7-8'
    """
    parts: list[str] = []
    i = 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        parts.append(str(layers[i]) if i == j else f"{layers[i]}-{layers[j]}")
        i = j + 1
    return ",".join(parts)


def _ranges(text: str, spec: str, total: int) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, dash, b = part.strip().partition("-")
        try:
            lo, hi = int(a), int(b) if dash else int(a)
        except ValueError:
            raise ConfigError(
                f"bad self_draft {spec!r}: {part!r} is not a layer number or range A-B"
            ) from None
        if not 0 <= lo <= hi < total:
            raise ConfigError(
                f"bad self_draft {spec!r}: layers must satisfy 0 <= A <= B < {total} (the "
                f"target has {total} layers), got {part!r}"
            )
        out.extend(range(lo, hi + 1))
    return sorted(set(out))


def parse_self_draft(spec: str, num_layers: int) -> SelfDraftSpec:
    """Parse a ``self_draft`` string for a target with ``num_layers`` decoder layers.

    >>> parse_self_draft("skip:2-4@0.6", 6)
    SelfDraftSpec(kind='skip', layers=(0, 1, 5), adapter=None, min_confidence=0.6)
    >>> parse_self_draft("exit:2", 6).layers
    (0, 1)
    """
    kind, colon, rest = spec.partition(":")
    if not colon or kind not in KINDS or not rest:
        raise ConfigError(
            f"bad self_draft {spec!r}: expected exit:N, skip:A-B[,C...], keep:A-B[,C...] or "
            "adapter:DIR, optionally followed by @T (stop drafting below confidence T)"
        )
    body, at, thr = rest.rpartition("@")
    if not at:
        body, thr = rest, ""
    conf = 0.0
    if thr:
        try:
            conf = float(thr)
        except ValueError:
            raise ConfigError(f"bad self_draft {spec!r}: @{thr} is not a number") from None
        if not 0.0 <= conf < 1.0:
            raise ConfigError(f"bad self_draft {spec!r}: the confidence stop must be in [0, 1)")
    if kind == "adapter":
        return SelfDraftSpec("adapter", adapter=body, min_confidence=conf)
    if kind == "exit":
        try:
            n = int(body)
        except ValueError:
            raise ConfigError(f"bad self_draft {spec!r}: exit:N needs an integer N") from None
        if not 1 <= n < num_layers:
            raise ConfigError(
                f"bad self_draft {spec!r}: exit:N needs 1 <= N < {num_layers} (the target's "
                "layer count)"
            )
        return SelfDraftSpec("exit", tuple(range(n)), min_confidence=conf)
    listed = _ranges(body, spec, num_layers)
    keep = [i for i in range(num_layers) if i not in listed] if kind == "skip" else listed
    if not keep or keep[0] != 0:
        raise ConfigError(f"bad self_draft {spec!r}: layer 0 must be kept")
    if len(keep) == num_layers:
        raise ConfigError(f"bad self_draft {spec!r}: it keeps every layer, so it drafts nothing")
    return SelfDraftSpec(kind, tuple(keep), min_confidence=conf)


# -- the saved calibration ---------------------------------------------------------------------


def calibration_path(target: LoadedModel) -> Path:
    """Where ``specdec calibrate self`` saves its choice for ``target``."""
    return calibration_file(target, "self")


def save_calibration(target: LoadedModel, spec: str, details: dict[str, Any]) -> Path:
    path = calibration_path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps({"self_draft": spec, "target": target.identity(), **details}, indent=2)
    )
    os.replace(tmp, path)
    return path


def saved_choice(target: LoadedModel) -> str | None:
    """The calibrated ``self_draft`` for ``target``, or ``None``."""
    path = calibration_path(target)
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        spec = saved["self_draft"]
    except (ValueError, KeyError, OSError):
        log.warning("ignoring unreadable self-speculation calibration %s", path)
        return None
    return str(spec)


# -- building the draft ------------------------------------------------------------------------


def build_self_draft(target: LoadedModel, spec: SelfDraftSpec) -> tuple[PreTrainedModel, str]:
    """The draft model for ``spec`` (sharing ``target``'s modules) and a description."""
    total = len(decoder_layers(target.model))
    if spec.kind != "adapter":
        model = layer_subset_model(target.model, spec.layers)
        return model, f"{len(spec.layers)} of the target's {total} layers ({spec.text})"
    from specdec.heads.self_exit import PrefixHead, head_rows, load_self_exit

    assert spec.adapter is not None
    adapter = load_self_exit(spec.adapter)
    problem = identity_mismatch(adapter.config.target, target.identity())
    if problem:
        raise CheckpointError(
            f"the self-exit adapter {spec.adapter} was trained for another target ({problem}); "
            "train one for this model with `specdec train self`"
        )
    cfg = adapter.config
    if not 1 <= cfg.layer < total:
        raise CheckpointError(f"the adapter exits after layer {cfg.layer}; the target has {total}")
    adapter.to(next(target.model.parameters()).dtype)
    head = None
    if cfg.draft_vocab:
        head = PrefixHead(head_rows(target.model, cfg.draft_vocab), cfg.vocab_size)
    final = nn.Sequential(adapter, target.model.model.norm)
    model = layer_subset_model(target.model, range(cfg.layer), final_norm=final, lm_head=head)
    return model, f"trained exit after {cfg.layer} of {total} layers ({spec.text})"


class SelfSpeculator(DraftModelSpeculator):
    name: ClassVar[str] = "self"


@dataclass(frozen=True, kw_only=True)
class SelfOptions(SpeculatorOptions):
    primary = "layers"
    layers: str | None = option(
        None,
        help="exit:N, skip:A-B, keep:A-B or adapter:DIR, optionally @T (stop below confidence "
        "T); bracket lists with commas: [skip:2-4,7]. Default: `specdec calibrate self`'s choice",
    )


@register("self", SelfOptions)
def _build(target: LoadedModel, options: SelfOptions) -> SelfSpeculator:
    """layer-skip self-speculation: a subset of the target's own layers drafts"""
    total = len(decoder_layers(target.model))
    text = options.layers
    note = ""
    if not text:
        text = saved_choice(target)
        if text is None:
            text = default_spec(total)
            note = "; not calibrated, using the default (run `specdec calibrate self`)"
            log.warning("self-speculation is not calibrated for this model; using %s", text)
        else:
            note = "; calibrated"
    spec = parse_self_draft(text, total)
    model, description = build_self_draft(target, spec)
    return SelfSpeculator(ModelRunner(model), description + note, spec.min_confidence)
