"""A trained exit for self-speculation: a small adapter after the target's first L layers.

The draft runs the target's layers 0..L-1, then ``h + U D norm(h)`` (a residual low-rank map, or
a full H x H map when ``rank == 0``), then the target's own final norm and LM head. Only the
adapter is trained (KL to the target's distribution); everything else is the target's modules,
shared, so the memory overhead is the adapter alone (a norm and 2 x H x rank weights, or H x H
at full rank; docs/self_speculation.md gives the bundled model's).

The draft may score only the first ``draft_vocab`` token ids: a zero-copy view of the target's
LM head rows (BPE vocabularies put frequent tokens first, so the low ids cover most response
tokens; docs/self_speculation.md). The rest get -inf, so they are never drafted and q is 0
there, which rejection sampling handles losslessly.

Format: ``config.json`` (``specdec_model_type: "self-exit"``, the target's identity) +
``adapter.safetensors``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from specdec.errors import CheckpointError

CONFIG = "config.json"
WEIGHTS = "adapter.safetensors"
MODEL_TYPE = "self-exit"


@dataclass(frozen=True)
class SelfExitConfig:
    layer: int  # the draft runs the target's layers 0..layer-1
    hidden_size: int
    vocab_size: int  # the target's
    rank: int = 0  # 0 = a full H x H map
    draft_vocab: int = 0  # score token ids < draft_vocab only; 0 = all
    target: dict[str, Any] = field(default_factory=dict)  # the target's identity
    agreement: float | None = None  # held-out top-1 agreement with the target

    def __post_init__(self) -> None:
        if self.layer < 1 or self.hidden_size < 1 or self.rank < 0:
            raise CheckpointError(
                f"a self-exit config needs layer >= 1 and rank >= 0, got {self.layer}, {self.rank}"
            )
        if not 0 <= self.draft_vocab <= self.vocab_size:
            raise CheckpointError(
                f"draft_vocab must be in 0..{self.vocab_size}, got {self.draft_vocab}"
            )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class SelfExitAdapter(nn.Module):
    """``h + up(down(norm(h)))`` (or ``h + proj(norm(h))`` at full rank); starts as identity."""

    def __init__(self, config: SelfExitConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.norm = RMSNorm(h)
        if config.rank:
            self.down = nn.Linear(h, config.rank, bias=False)
            self.up = nn.Linear(config.rank, h, bias=False)
            nn.init.zeros_(self.up.weight)
        else:
            self.proj = nn.Linear(h, h, bias=False)
            nn.init.zeros_(self.proj.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        x = self.norm(h)
        delta = self.up(self.down(x)) if self.config.rank else self.proj(x)
        return h + delta

    def num_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def save(self, out_dir: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().float().contiguous() for k, v in self.state_dict().items()}
        tmp = out / (WEIGHTS + ".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, out / WEIGHTS)
        cfg = {"specdec_model_type": MODEL_TYPE, **asdict(self.config), **(extra or {})}
        (out / CONFIG).write_text(json.dumps(cfg, indent=2))


def load_self_exit(directory: str | os.PathLike[str]) -> SelfExitAdapter:
    """Load an adapter saved by :meth:`SelfExitAdapter.save` (the caller checks the target)."""
    d = Path(directory)
    if not (d / CONFIG).is_file() or not (d / WEIGHTS).is_file():
        raise CheckpointError(
            f"{d} is not a self-exit adapter (needs {CONFIG} and {WEIGHTS}); train one with "
            "`specdec train self`"
        )
    try:
        raw = json.loads((d / CONFIG).read_text())
    except ValueError as e:
        raise CheckpointError(f"{d / CONFIG} is not valid JSON: {e}") from e
    if raw.get("specdec_model_type") != MODEL_TYPE:
        raise CheckpointError(f"{d} holds a {raw.get('specdec_model_type')!r}, not a self-exit")
    keys = {f for f in SelfExitConfig.__dataclass_fields__}
    config = SelfExitConfig(**{k: v for k, v in raw.items() if k in keys})
    adapter = SelfExitAdapter(config)
    try:
        adapter.load_state_dict(load_file(str(d / WEIGHTS)))
    except (SafetensorError, RuntimeError, OSError) as e:
        raise CheckpointError(f"cannot load {d / WEIGHTS}: {e}") from e
    adapter.eval()
    return adapter


class PrefixHead(nn.Module):
    """An LM head restricted to token ids ``< rows``, other logits -inf, so the output keeps the
    vocabulary size ``vocab``. ``weight`` is a view of the target's rows (not a parameter of
    this module, so it is neither copied nor saved)."""

    def __init__(self, weight: torch.Tensor, vocab: int) -> None:  # weight [rows, H]
        super().__init__()
        self.weight = weight
        self.vocab = vocab

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V]
        logits = F.linear(h, self.weight)  # [..., rows]
        pad = logits.new_full((*logits.shape[:-1], self.vocab - len(self.weight)), float("-inf"))
        return torch.cat([logits, pad], dim=-1)


def head_rows(model: nn.Module, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of ``model``'s LM head weight, without a copy where possible: the
    head's own weight, or the input embeddings when they are tied (the bundled model's head is
    a prepacked oneDNN linear whose weight is opaque)."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    if getattr(head, "bias", None) is not None:
        raise CheckpointError("a draft vocabulary needs an LM head without bias")
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.detach()[:rows]
    if getattr(model.config, "tie_word_embeddings", False):
        emb = model.get_input_embeddings().weight  # type: ignore[operator]
        return emb.detach()[:rows]
    from specdec.target.numerics import dense_weight

    return dense_weight(head)[:rows].clone()  # a copy: rows x H floats
