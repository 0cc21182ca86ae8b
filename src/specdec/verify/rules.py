"""Acceptance rules: which drafted nodes the target keeps, and the one token it adds.

Output tokens of a step = accepted drafts + one recovered token (on rejection) or one bonus token
(when the walk reaches a leaf). Both rules here are lossless:

* :class:`GreedyRule` keeps the longest root-to-node path whose every token equals the target's
  argmax at its parent, so the output is exactly what plain greedy decoding would produce.
* :class:`RejectionSamplingRule` is speculative sampling (Leviathan et al. 2023; Chen et al.
  2023, arXiv 2302.01318), generalised to several children per node as in SpecInfer's multi-draft
  verification: try each child x in turn, accept with probability min(1, p(x)/q(x)), otherwise
  replace p by norm(max(p - q, 0)) and try the next child; if none is accepted, sample from what
  is left of p. A deterministic draft (q = one-hot) is the special case where acceptance is p(x)
  and a rejected token is removed from p. Each child is tested against its own q row, so this is
  exact when children are drafted independently from q, deterministic and distinct, or drawn
  without replacement with each child's row the renormalised q it was drawn from (the draft
  model's trees; tests/test_draft_trees.py), provided no child's presence depends on its own
  token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from specdec.config import SamplingConfig
from specdec.tree import DraftTree
from specdec.verify.sampling import probs_from_logits, sample


@dataclass(frozen=True)
class Acceptance:
    """What one verification step commits.

    ``path`` holds the accepted node indices from the root (node 0, always kept) down;
    ``tokens`` the tokens to append to the output: the accepted drafts plus one more token.
    """

    path: tuple[int, ...]
    tokens: tuple[int, ...]

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


class AcceptanceRule(Protocol):
    lossless: ClassVar[bool]

    def accept(
        self,
        tree: DraftTree,
        logits: torch.Tensor,
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> Acceptance: ...


class GreedyRule:
    """Exact match against the target's argmax."""

    lossless: ClassVar[bool] = True

    def accept(
        self,
        tree: DraftTree,
        logits: torch.Tensor,  # [N, V]
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> Acceptance:
        # the step's one device-to-host transfer: N argmax ids
        target = logits.argmax(dim=-1).tolist()  # [N]
        node, path = 0, [0]
        while True:
            want = target[node]
            nxt = next((c for c in tree.children[node] if tree.tokens[c] == want), None)
            if nxt is None:
                break
            node = nxt
            path.append(node)
        accepted = [tree.tokens[i] for i in path[1:]]
        return Acceptance(path=tuple(path), tokens=(*accepted, target[node]))


class RejectionSamplingRule:
    """Lossless speculative sampling over chains and trees (see module docstring)."""

    lossless: ClassVar[bool] = True

    def accept(
        self,
        tree: DraftTree,
        logits: torch.Tensor,  # [N, V]
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> Acceptance:
        p_all = probs_from_logits(logits, sampling)  # [N, V]
        q_all = tree.draft_probs
        node, path = 0, [0]
        while True:
            p = p_all[node]  # [V]
            accepted_child = None
            for child in tree.children[node]:
                x = tree.tokens[child]
                if q_all is None:
                    q_x = 1.0
                else:
                    q = q_all[child].to(p.device, p.dtype)  # [V]
                    q_x = float(q[x])
                u = float(
                    torch.rand(
                        (), generator=generator, dtype=torch.float64, device=generator.device
                    )
                )
                if q_x > 0.0 and u * q_x < float(p[x]):
                    accepted_child = child
                    break
                # Rejected: the residual norm(max(p - q, 0)) is what is left to sample from.
                if q_all is None:
                    residual = p.clone()
                    residual[x] = 0.0
                else:
                    residual = torch.clamp(p - q, min=0.0)
                total = float(residual.sum())
                if total > 0.0:
                    p = residual / total
            if accepted_child is None:
                token = sample(p, generator)
                accepted = [tree.tokens[i] for i in path[1:]]
                return Acceptance(path=tuple(path), tokens=(*accepted, token))
            node = accepted_child
            path.append(node)


def rule_for(sampling: SamplingConfig) -> AcceptanceRule:
    """Greedy requests use exact match, sampled ones rejection sampling; both lossless."""
    return GreedyRule() if sampling.greedy else RejectionSamplingRule()
