"""The value objects across the speculator seam: what a speculator sees before it drafts
(:class:`DraftContext`) and what verification made of its draft (:class:`Feedback`).

They sit below both :mod:`specdec.speculators` (which drafts from them) and
:mod:`specdec.grammar` (which rewrites feedback for pruned trees), so neither imports the
other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.config import SamplingConfig
from specdec.control.budget import CostModel
from specdec.tree import DraftTree
from specdec.verify import Acceptance


class DraftConstraint(Protocol):
    """The request's grammar as a speculator may see it (implemented by
    :class:`specdec.grammar.GrammarConstraint`): the engine prunes drafts it forbids and drafts
    the tokens it forces, so a speculator may ignore it."""

    def advance(self, tokens: list[int]) -> None: ...


@dataclass(frozen=True)
class DraftContext:
    """Everything a speculator may look at: committed tokens (the last one is the tree's root),
    where the prompt ends, the request's sampling settings and private RNG, and (for
    speculators that declare ``needs_hidden_states``) the target's hidden states (final, or the
    speculator's ``feature_layers`` concatenated) at the positions that produced the tokens
    committed last; the last row produced the root. ``costs`` prices verification for tree
    speculators that size their own trees: the engine's measured cost model for greedy requests,
    its frozen prior for sampled ones (whose output must not depend on timing); ``fixed_length``
    says the engine wants exactly ``budget`` tokens (``adaptive=False``), so a chain speculator
    that would stop itself (:meth:`Speculator.chain_cap`) must not. ``constraint``
    is the request's grammar constraint, if any: the engine prunes drafts it forbids and drafts
    the tokens it forces, so a speculator may ignore it (or consult it to draft better)."""

    tokens: list[int]
    prompt_len: int
    sampling: SamplingConfig
    generator: torch.Generator
    features: torch.Tensor | None = None  # [M, H]
    costs: CostModel | None = None
    constraint: DraftConstraint | None = None
    fixed_length: bool = False  # the engine drafts exactly the budget (adaptive=False)
    remaining: int | None = None  # tokens the request may still generate (None: unknown)

    def tree_cost(self, nodes: int) -> float:
        """Verification cost of a tree of ``nodes`` nodes (root included) in plain steps.

        >>> from specdec.config import SamplingConfig
        >>> DraftContext([1], 1, SamplingConfig(), torch.Generator()).tree_cost(11)
        1.6
        """
        costs = self.costs or _PRIOR
        return costs.ratio(nodes, tree=True)


@dataclass(frozen=True)
class Feedback:
    """What verification made of the last proposal. ``logits`` are the target's logits at every
    tree node from that same pass (lookahead reads its Jacobi updates from them, so they cost no
    extra forward)."""

    tree: DraftTree
    acceptance: Acceptance
    logits: torch.Tensor | None = None  # [N, V]


_PRIOR = CostModel.prior()
