"""Medusa: K heads on the target's last hidden state draft a token tree in one shot.

Head k's ranked candidates fill depth k of a static topology (a preset, a JSON file, or one
calibrated from the checkpoint's held-out per-head accuracies for a node budget). The tree's
tokens are deterministic (q = one-hot, siblings distinct), so both lossless rules apply:
greedy tree walk and multi-draft rejection sampling. Drafting costs one small matmul per head
and no extra target pass: the hidden state comes from the verification pass that just ran.

With ``tree=calibrated`` (the default) the node count is chosen per step: the prefix of the
calibrated tree that maximises expected tokens per unit of verification time, priced by the
engine's cost model (``context.costs``: measured for greedy requests, the frozen prior for
sampled ones).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from specdec.control.budget import CostModel
from specdec.errors import CheckpointError
from specdec.heads.medusa import MedusaHeads, load_medusa
from specdec.speculators.base import DraftContext, Speculator
from specdec.speculators.spec import SpeculatorOptions, option, register
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
_PRIOR = CostModel.prior()


@dataclass(frozen=True, kw_only=True)
class MedusaOptions(SpeculatorOptions):
    primary = "dir"
    dir: str = option(help="Medusa checkpoint directory (`specdec train medusa`)")
    tree: str | None = option(
        None,
        help="calibrated (default: sized per step from the heads' measured accuracies and the "
        "measured verification cost), calibrated:NODES, a preset (chain, sparse-8/16/32/64) or "
        "a JSON file of paths",
    )


class MedusaSpeculator(Speculator):
    name: ClassVar[str] = "medusa"
    needs_hidden_states: ClassVar[bool] = True
    drafts_trees: ClassVar[bool] = True

    def __init__(self, heads: MedusaHeads, topology: Topology, *, sized: bool = False) -> None:
        """``sized``: draft, each step, the prefix of ``topology`` that pays best at the
        context's verification costs (``topology`` is then the full calibrated tree)."""
        self.heads = heads.eval()
        self.topology = topology
        self.gains = prefix_gains(topology, head_accuracy(heads)) if sized else None
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
        topology = self.topology
        if self.gains is not None:
            topology = topology[: best_prefix(self.gains, context.tree_cost)]
        h = context.features[-1].to(torch.float32)  # [H]
        logits = self.heads(h)  # [K, V_draft]
        candidates = []
        for d, k in enumerate(self._ranks):
            top = torch.topk(logits[d], k).indices  # [k]
            candidates.append(self.heads.to_target_ids(top).tolist())
        return tree_from_topology(root, topology, candidates, budget)

    def current_topology(self, costs: CostModel | None = None) -> Topology:
        """The tree a step drafts at ``costs`` (default: the prior)."""
        if self.gains is None:
            return self.topology
        cost = (costs or _PRIOR).ratio
        return self.topology[: best_prefix(self.gains, lambda n: cost(n, tree=True))]


def head_accuracy(heads: MedusaHeads) -> list[list[float]]:
    """The checkpoint's measured per-head, per-rank accuracies, or a generic profile."""
    num_heads = heads.config.num_heads
    return heads.config.accuracy[:num_heads] or generic_profile()[:num_heads]


def resolve_topology(spec: str | None, heads: MedusaHeads) -> Topology:
    """``calibrated[:N]`` (from the checkpoint's measured accuracies), a preset, or a file.
    Plain ``calibrated`` gives the full calibrated tree, which :func:`sized_per_step` says is
    cut per step to the size that pays (see :func:`best_prefix`)."""
    sizer = topology_sizer(spec)
    if sizer is not None:
        return sizer(head_accuracy(heads))
    return load_topology(spec or "calibrated", heads.config.num_heads)


def sized_per_step(spec: str | None) -> bool:
    """Whether the tree ``spec`` names is sized per step (plain ``calibrated``)."""
    return (spec or "calibrated") == "calibrated"


def topology_sizer(spec: str | None) -> Sizer | None:
    """How ``spec`` turns measured accuracies into a tree, for a speculator whose accuracies
    change (the online learner); None for a preset or a file, which fix the tree.

    >>> topology_sizer("sparse-8") is None, len(topology_sizer("calibrated:5")([[0.5] * 4] * 4))
    (True, 5)
    """
    m = re.fullmatch(r"calibrated(?::(\d+))?", spec or "calibrated")
    if not m:
        return None
    nodes = int(m.group(1)) if m.group(1) else MAX_TREE_NODES
    return lambda accuracy: calibrated_topology(accuracy, nodes)


def prefix_gains(topology: Topology, accuracy: list[list[float]]) -> tuple[float, ...]:
    """Expected accepted drafts of each prefix: ``gains[n - 1]`` for the first ``n`` nodes."""
    return tuple(expected_accepted(topology[:n], accuracy) for n in range(1, len(topology) + 1))


def best_prefix(gains: tuple[float, ...], tree_cost: Callable[[int], float]) -> int:
    """The node count n (>= 1) maximising expected tokens per verification cost,
    ``(1 + gains[n - 1]) / tree_cost(n + 1)`` (the tree verified holds the root too).

    >>> best_prefix((0.9, 1.6, 1.7), lambda n: 1 + 0.1 * (n - 1))  # 1.73, 2.17, 2.08
    2
    """
    best_n, best_rate = 1, 0.0
    for n, gain in enumerate(gains, start=1):
        rate = (1.0 + gain) / tree_cost(n + 1)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


def best_sized_topology(
    accuracy: list[list[float]],
    max_nodes: int = MAX_TREE_NODES,
    costs: CostModel | None = None,
) -> Topology:
    """The calibrated tree whose size maximises expected tokens per unit of verification time
    at ``costs`` (default: the prior); what a sized Medusa tree drafts at those costs.

    >>> len(best_sized_topology([[0.9] * 4] * 4)) > len(best_sized_topology([[0.2] * 4] * 4))
    True
    """
    full = calibrated_topology(accuracy, max_nodes)
    cost = (costs or _PRIOR).ratio
    return full[: best_prefix(prefix_gains(full, accuracy), lambda n: cost(n, tree=True))]


def check_heads_fit(heads: MedusaHeads, target: LoadedModel) -> None:
    cfg = target.config
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


@register("medusa", MedusaOptions)
def _build(target: LoadedModel, options: MedusaOptions) -> MedusaSpeculator:
    """K heads on the target's last hidden state draft a token tree in one shot"""
    heads = load_medusa(options.dir).to(target.device)  # beside the features it reads
    check_heads_fit(heads, target)
    topology = resolve_topology(options.tree, heads)
    return MedusaSpeculator(heads, topology, sized=sized_per_step(options.tree))
