"""Medusa heads (Cai et al. 2024, arXiv 2401.10774) and their checkpoint formats.

Head k (k = 1..K) reads the target's last hidden state h_t (after the final norm, the input of
the LM head) and predicts the token at t + k + 1, one position beyond the target's own LM head:
``logits_k = W_k (h + SiLU(A_k h + b_k))`` with one residual block per layer. Each head owns its
modules (``nn.ModuleList`` of independent blocks; the reference code's ``[ResBlock()] * n`` shares
weights by accident).

A head may project onto a reduced draft vocabulary (the most frequent tokens of the training
data, as EAGLE-3 does): on a CPU a full 49k-row projection per head costs almost as much as
the 135M target's own step, 8k rows a sixth of that. ``token_map[i]`` is the target id of draft
id i.

Formats:
* ours: ``config.json`` (``specdec_model_type: "medusa"``) + ``medusa.safetensors``;
* the original Medusa release: ``config.json`` with ``medusa_num_heads`` / ``medusa_num_layers``
  + ``medusa_lm_head.safetensors`` (or ``.pt``), keys ``{head}.{layer}.linear.{weight,bias}`` and
  ``{head}.{num_layers}.weight``, optionally prefixed ``medusa_head.``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from specdec.errors import CheckpointError
from specdec.heads.state_io import load_checked, read_safetensors, read_torch_state

CONFIG = "config.json"
WEIGHTS = "medusa.safetensors"
MODEL_TYPE = "medusa"
IGNORE = -100  # label of a position without a target (past the end, outside the draft vocab)


@dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    vocab_size: int  # the target's
    num_heads: int = 4
    num_layers: int = 1
    draft_vocab_size: int | None = None  # None: the full vocabulary, no token map
    target: dict[str, Any] = field(default_factory=dict)  # the target's identity
    # held-out accuracy[h][r] = P(rank-r candidate of head h is right | the rank-0 candidates of
    # heads 0..h-1 were), so a tree path's probability is their product (see candidate_hits)
    accuracy: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 0:
            raise CheckpointError(
                f"a Medusa config needs num_heads >= 1 and num_layers >= 0, got "
                f"{self.num_heads} and {self.num_layers}"
            )
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise CheckpointError(
                f"draft_vocab_size {self.draft_vocab_size} is outside 1..{self.vocab_size}"
            )

    @property
    def out_size(self) -> int:
        return self.draft_vocab_size or self.vocab_size


class ResBlock(nn.Module):
    """h + SiLU(A h + b); A starts at zero, so an untrained block is the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.act(self.linear(h))


class MedusaHead(nn.Module):
    def __init__(self, hidden_size: int, out_size: int, num_layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResBlock(hidden_size) for _ in range(num_layers))
        self.proj = nn.Linear(hidden_size, out_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return self.proj(h)


class MedusaHeads(nn.Module):
    """K independent heads over the target's last hidden state."""

    def __init__(self, config: MedusaConfig, token_map: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(
            MedusaHead(config.hidden_size, config.out_size, config.num_layers)
            for _ in range(config.num_heads)
        )
        if config.draft_vocab_size is not None:
            if token_map is None or token_map.shape != (config.draft_vocab_size,):
                raise CheckpointError("a reduced-vocabulary Medusa checkpoint needs its token_map")
            self.register_buffer("token_map", token_map.to(torch.long), persistent=True)
        else:
            self.token_map = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of every head over the draft vocabulary.  # [..., K, V_draft]"""
        return torch.stack([head(hidden) for head in self.heads], dim=-2)

    def init_from_lm_head(self, lm_head_weight: torch.Tensor) -> None:
        """Start each projection at the target's LM head (rows of the draft vocabulary): with
        zero-initialised blocks every head begins by predicting what the target predicts next,
        a far better start than random for the next-but-one token."""
        w = lm_head_weight.detach().to(torch.float32)  # [V, H]
        if self.token_map is not None:
            w = w[self.token_map]
        for head in self.heads:
            assert isinstance(head, MedusaHead)
            head.proj.weight.data.copy_(w)

    def to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids as draft-vocabulary ids; IGNORE for tokens outside the draft
        vocabulary and for IGNORE labels."""
        ids = target_ids.clamp_min(0)
        if self.token_map is None:
            out = ids.clone()
        else:
            to_draft = torch.full((self.config.vocab_size,), IGNORE, dtype=torch.long)  # [V]
            to_draft[self.token_map] = torch.arange(len(self.token_map))
            out = to_draft[ids]
        out[target_ids == IGNORE] = IGNORE
        return out

    def loss(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor,
        soft: torch.Tensor | None = None,
        soft_weight: float = 0.0,
    ) -> torch.Tensor:
        """Weighted sum over heads of the cross-entropy of head k against ``labels[:, k]``
        (target token ids, IGNORE where unknown); a head without any label adds zero.

        With ``soft`` (the target's own distribution over the draft vocabulary at the position
        that predicts the label) a ``soft_weight`` share of each head's loss is the
        cross-entropy against it: the target's runner-up tokens say which mistakes are near
        misses, information the single greedy label lacks when answers are few.
        hidden [B, H], labels [B, K], weights [K], soft [B, K, V_draft] probabilities."""
        draft = self.to_draft_ids(labels)  # [B, K]
        logits = self(hidden)  # [B, K, V_draft]
        has = labels != IGNORE  # [B, K]
        losses = []
        for k in range(self.config.num_heads):
            if not bool(has[:, k].any()):
                losses.append(logits.new_zeros(()))
                continue
            loss = (
                nn.functional.cross_entropy(logits[:, k], draft[:, k], ignore_index=IGNORE)
                if bool((draft[:, k] != IGNORE).any())
                else logits.new_zeros(())
            )
            if soft is not None and soft_weight > 0:
                logp = torch.log_softmax(logits[has[:, k], k], dim=-1)  # [b, V_draft]
                distil = -(soft[has[:, k], k] * logp).sum(-1).mean()
                loss = (1.0 - soft_weight) * loss + soft_weight * distil
            losses.append(loss)
        return (weights * torch.stack(losses)).sum()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.token_map is None else self.token_map[draft_ids]

    def rank_hits(
        self, hidden: torch.Tensor, labels: torch.Tensor, ranks: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``candidate_hits`` of these heads' top-``ranks`` candidates at ``hidden`` [B, H]
        (inputs anywhere: moved to the heads' device; the hits come back on the CPU)."""
        device = next(self.parameters()).device
        with torch.inference_mode():
            top = torch.topk(self(hidden.to(device).float()), ranks, dim=-1).indices  # [B, K, R]
            hits = candidate_hits(self.to_target_ids(top), labels.to(device))
            return hits[0].cpu(), hits[1].cpu(), hits[2].cpu()

    # -- checkpoint I/O -----------------------------------------------------------------------
    def save(self, out_dir: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(out / WEIGHTS))
        cfg = {"specdec_model_type": MODEL_TYPE, **asdict(self.config), **(extra or {})}
        (out / CONFIG).write_text(json.dumps(cfg, indent=2))


def candidate_hits(
    top_ids: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which ranked candidates were right, and where a head's accuracy counts.

    Returns ``match`` [B, K, R] (head k's rank-r candidate is the label), ``valid`` [B, K]
    (head k has a label) and ``chained`` [B, K] (valid, and every shallower head's rank-0
    candidate was right). Heads' errors are strongly correlated (a head that got t+2 right
    usually sees an easy continuation), so accuracies counted over ``chained`` rows multiply
    along a tree path to that path's probability, while unconditional ones underestimate a
    4-deep chain of trained heads by about a fifth and size trees too shallow.
    top_ids [B, K, R] target ids, labels [B, K] (IGNORE where unknown).
    """
    valid = labels != IGNORE  # [B, K]
    match = (top_ids == labels[..., None]) & valid[..., None]  # [B, K, R]
    right0 = match[..., 0]  # [B, K]
    before = torch.ones_like(valid)
    before[:, 1:] = torch.cumprod(right0[:, :-1].long(), dim=1).bool()
    return match, valid, valid & before


def load_medusa(path: str | os.PathLike[str]) -> MedusaHeads:
    """Load our format or the original Medusa release's, with errors that name the problem."""
    d = Path(path)
    if not d.is_dir():
        raise CheckpointError(
            f"Medusa checkpoint {str(d)!r} does not exist; train one with `specdec train medusa`"
        )
    cfg_path = d / CONFIG
    if not cfg_path.is_file():
        raise CheckpointError(f"{d} has no {CONFIG}; it is not a Medusa checkpoint")
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {cfg_path}: {e}") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path} is not a JSON object")
    if raw.get("specdec_model_type") == MODEL_TYPE:
        return _load_ours(d, raw)
    if "medusa_num_heads" in raw:
        return _load_original(d, raw)
    raise CheckpointError(
        f"{cfg_path} is neither a specdec Medusa config (specdec_model_type) nor an original "
        "Medusa config (medusa_num_heads)"
    )


def _load_ours(d: Path, raw: dict[str, Any]) -> MedusaHeads:
    fields = {k: raw[k] for k in MedusaConfig.__dataclass_fields__ if k in raw}
    try:
        config = MedusaConfig(**fields)
    except TypeError as e:
        raise CheckpointError(f"{d / CONFIG} is incomplete: {e}") from e
    if not (d / WEIGHTS).is_file():
        raise CheckpointError(f"{d} lacks {WEIGHTS}")
    state = read_safetensors(d / WEIGHTS)
    heads = MedusaHeads(config, state.get("token_map"))
    load_checked(heads, state, d / WEIGHTS)
    return heads


_ORIGINAL_BLOCK = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.linear\.(weight|bias)$")
_ORIGINAL_PROJ = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.weight$")


def _load_original(d: Path, raw: dict[str, Any]) -> MedusaHeads:
    num_heads = int(raw["medusa_num_heads"])
    num_layers = int(raw.get("medusa_num_layers", 1))
    st, pt = d / "medusa_lm_head.safetensors", d / "medusa_lm_head.pt"
    if st.is_file():
        state = read_safetensors(st)
        where = st
    elif pt.is_file():
        state = read_torch_state(pt)
        where = pt
    else:
        raise CheckpointError(f"{d} lacks medusa_lm_head.safetensors (or .pt)")
    ours: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if m := _ORIGINAL_BLOCK.match(key):
            h, j, kind = m.groups()
            ours[f"heads.{h}.blocks.{j}.linear.{kind}"] = value
        elif (m := _ORIGINAL_PROJ.match(key)) and int(m.group(2)) == num_layers:
            ours[f"heads.{m.group(1)}.proj.weight"] = value
        else:
            raise CheckpointError(f"{where}: unexpected key {key!r} for a Medusa checkpoint")
    proj = ours.get("heads.0.proj.weight")
    if proj is None:
        raise CheckpointError(f"{where} has no projection for head 0")
    config = MedusaConfig(
        hidden_size=int(proj.shape[1]),
        vocab_size=int(proj.shape[0]),
        num_heads=num_heads,
        num_layers=num_layers,
    )
    heads = MedusaHeads(config)
    load_checked(heads, ours, where)
    return heads
