"""Medusa's typical acceptance (Cai et al. 2024, §2.3.1): explicitly LOSSY, opt-in only.

A drafted token x is accepted when the target finds it "typical enough":
``p(x) > min(epsilon, alpha * exp(-H(p)))``, with p the temperature-shaped target distribution
and H its entropy. It accepts more than rejection sampling at high temperature, but the output
no longer follows p exactly, so the engine's statistics mark such requests ``lossless: false``.
Greedy requests (temperature 0) are unaffected: the rule falls back to exact greedy match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from specdec.config import SamplingConfig
from specdec.errors import ConfigError
from specdec.tree import DraftTree
from specdec.verify.rules import Acceptance, GreedyRule
from specdec.verify.sampling import probs_from_logits, sample


def typical_threshold(p: torch.Tensor, epsilon: float, alpha: float) -> float:
    """``min(epsilon, alpha * exp(-H(p)))`` for one distribution.  p: [V]

    >>> round(typical_threshold(torch.tensor([0.5, 0.5]), 0.09, 0.3), 4)
    0.09
    >>> round(typical_threshold(torch.full((1000,), 1e-3), 0.09, 0.3), 6)
    0.0003
    """
    logp = torch.log(p.clamp_min(1e-30))
    entropy = float(-(p * logp).sum())
    return min(epsilon, alpha * float(torch.exp(torch.tensor(-entropy))))


@dataclass(frozen=True)
class TypicalAcceptanceRule:
    """Walk the tree taking the first child whose token is typical under p; the step's extra
    token is sampled from p at the last accepted node."""

    epsilon: float = 0.09
    alpha: float = 0.3
    lossless: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not (0.0 < self.epsilon < 1.0) or not (0.0 < self.alpha <= 1.0):
            raise ConfigError(
                f"typical acceptance needs 0 < epsilon < 1 and 0 < alpha <= 1, got "
                f"epsilon={self.epsilon}, alpha={self.alpha}"
            )

    def accept(
        self,
        tree: DraftTree,
        logits: torch.Tensor,  # [N, V]
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> Acceptance:
        if sampling.greedy:
            return GreedyRule().accept(tree, logits, sampling, generator)
        p_all = probs_from_logits(logits, sampling)  # [N, V]
        node, path = 0, [0]
        while True:
            p = p_all[node]
            bar = typical_threshold(p, self.epsilon, self.alpha)
            nxt = next((c for c in tree.children[node] if float(p[tree.tokens[c]]) > bar), None)
            if nxt is None:
                break
            node = nxt
            path.append(node)
        accepted = [tree.tokens[i] for i in path[1:]]
        return Acceptance(path=tuple(path), tokens=(*accepted, sample(p_all[node], generator)))
