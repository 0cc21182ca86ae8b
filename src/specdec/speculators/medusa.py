"""Medusa: K heads on the target's last hidden state draft a token tree in one shot.

Head k's ranked candidates fill depth k of a static topology (a preset, a JSON file, or one
calibrated from the checkpoint's held-out per-head accuracies for a node budget). The tree's
tokens are deterministic (q = one-hot, siblings distinct), so both lossless rules apply:
greedy tree walk and multi-draft rejection sampling. Drafting costs one small matmul per head
and no extra target pass: the hidden state comes from the verification pass that just ran.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import ClassVar

import torch

from specdec.config import SpeculationConfig
from specdec.errors import CheckpointError, ConfigError
from specdec.heads.medusa import MedusaHeads, load_medusa
from specdec.speculators.base import DraftContext, Feedback, register
from specdec.target import LoadedModel
from specdec.target.loading import identity_mismatch
from specdec.tree import DraftTree
from specdec.tree.topology import (
    Topology,
    calibrated_topology,
    expected_accepted,
    generic_profile,
    load_topology,
    tree_from_topology,
)

MAX_TREE_NODES = 64
# Builds a tree from per-depth, per-rank accuracies (see topology_sizer).
Sizer = Callable[[list[list[float]]], Topology]
# Verification cost of an n-node tree relative to one decode step, T(n)/T(1) ~ 1 + slope * n,
# fitted on this CPU (fp32 oneDNN path; bench/tree_cost.py measures it on yours).
TREE_COST_SLOPE = 0.04


class MedusaSpeculator:
    name: ClassVar[str] = "medusa"
    produces_q: ClassVar[bool] = False
    needs_hidden_states: ClassVar[bool] = True
    drafts_trees: ClassVar[bool] = True

    def __init__(self, heads: MedusaHeads, topology: Topology) -> None:
        self.heads = heads.eval()
        self.topology = topology
        depth = max(len(p) for p in topology)
        # how many ranked candidates each depth needs  [depth]
        self._ranks = [1 + max((p[d] for p in topology if len(p) > d), default=0)
                       for d in range(depth)]  # fmt: skip

    def reset(self) -> None:
        pass

    @torch.inference_mode()
    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        root = context.tokens[-1]
        if budget < 1 or context.features is None or len(context.features) == 0:
            return DraftTree.root_only(root)
        h = context.features[-1].to(torch.float32)  # [H]
        logits = self.heads(h)  # [K, V_draft]
        candidates = []
        for d, k in enumerate(self._ranks):
            top = torch.topk(logits[d], k).indices  # [k]
            candidates.append(self.heads.to_target_ids(top).tolist())
        return tree_from_topology(root, self.topology, candidates, budget)

    def observe(self, feedback: Feedback) -> None:
        pass


def resolve_topology(spec: str | None, heads: MedusaHeads) -> Topology:
    """``calibrated[:N]`` (from the checkpoint's measured accuracies), a preset, or a file.

    Plain ``calibrated`` also picks the node count: the N whose tree maximises expected tokens
    per verification cost, ``(1 + E[accepted](N)) / (1 + TREE_COST_SLOPE * N)``.
    """
    spec = spec or "calibrated"
    num_heads = heads.config.num_heads
    sizer = topology_sizer(spec)
    if sizer is not None:
        return sizer(heads.config.accuracy[:num_heads] or generic_profile()[:num_heads])
    return load_topology(spec, num_heads)


def topology_sizer(spec: str | None) -> Sizer | None:
    """How ``spec`` turns measured accuracies into a tree, for a speculator whose accuracies
    change (the online learner); None for a preset or a file, which fix the tree.

    >>> topology_sizer("sparse-8") is None, len(topology_sizer("calibrated:5")([[0.5] * 4] * 4))
    (True, 5)
    """
    m = re.fullmatch(r"calibrated(?::(\d+))?", spec or "calibrated")
    if not m:
        return None
    if m.group(1):
        nodes = int(m.group(1))
        return lambda accuracy: calibrated_topology(accuracy, nodes)
    return best_sized_topology


def best_sized_topology(accuracy: list[list[float]], max_nodes: int = MAX_TREE_NODES) -> Topology:
    """The calibrated tree whose size maximises expected tokens per unit of verification time.

    >>> len(best_sized_topology([[0.9] * 4] * 4)) > len(best_sized_topology([[0.2] * 4] * 4))
    True
    """
    full = calibrated_topology(accuracy, max_nodes)
    best_n, best_rate = 1, 0.0
    for n in range(1, len(full) + 1):
        rate = (1.0 + expected_accepted(full[:n], accuracy)) / (1.0 + TREE_COST_SLOPE * n)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return full[:best_n]


def check_heads_fit(heads: MedusaHeads, target: LoadedModel) -> None:
    cfg = target.model.config
    if heads.config.hidden_size != cfg.hidden_size:
        raise CheckpointError(
            f"these Medusa heads read hidden states of size {heads.config.hidden_size}, the "
            f"target's are {cfg.hidden_size}: they were trained for another model"
        )
    if heads.config.vocab_size != cfg.vocab_size:
        raise CheckpointError(
            f"these Medusa heads predict {heads.config.vocab_size} tokens, the target has "
            f"{cfg.vocab_size}: they were trained for another model"
        )
    if heads.config.target:
        problem = identity_mismatch(heads.config.target, target.identity())
        if problem:
            raise CheckpointError(
                f"these Medusa heads were trained for another target ({problem}); train heads "
                "for this model with `specdec train medusa`"
            )


@register("medusa")
def _build(target: LoadedModel, config: SpeculationConfig) -> MedusaSpeculator:
    if not config.medusa:
        raise ConfigError("method 'medusa' needs --medusa DIR (a trained Medusa checkpoint)")
    heads = load_medusa(config.medusa)
    check_heads_fit(heads, target)
    return MedusaSpeculator(heads, resolve_topology(config.tree, heads))
