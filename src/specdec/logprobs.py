"""Log-probabilities of committed tokens, read from the verification pass.

Verification already computes the target's logits at every node of the tree, so the logits
that chose each committed token (its parent node's row) cost nothing extra. The distribution
is the one the token was drawn from: the target's logits after the grammar mask (when there is
one) and, for sampled requests, after the same temperature / top-k / top-p shaping sampling
uses (:func:`specdec.verify.probs_from_logits`), so a token outside the nucleus has log-prob
-inf. Greedy requests (temperature 0) report the masked softmax at temperature 1: the argmax's
one-hot would say nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.config import SamplingConfig
from specdec.verify import probs_from_logits


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token's log-probability and the ``top`` most likely alternatives
    (token id, log-prob), most likely first (empty unless ``top_logprobs`` was asked)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(
    logits: torch.Tensor,  # [M, V]: row i produced tokens[i]
    tokens: Sequence[int],
    sampling: SamplingConfig,
    top: int = 0,
) -> list[TokenLogprob]:
    """Per-token log-probabilities (see the module docstring).

    >>> lp = token_logprobs(torch.tensor([[0.0, 0.0, -1e9]]), [1], SamplingConfig(), top=2)[0]
    >>> round(lp.logprob, 4), [(t, round(v, 4)) for t, v in lp.top]
    (-0.6931, [(0, -0.6931), (1, -0.6931)])
    """
    if sampling.greedy:
        lp = torch.log_softmax(logits.double(), dim=-1)  # [M, V]
    else:
        lp = torch.log(probs_from_logits(logits.double(), sampling))  # [M, V]
    ids = torch.tensor(list(tokens), dtype=torch.long, device=lp.device)
    chosen = lp.gather(-1, ids[:, None])[:, 0].tolist()  # [M]
    if top > 0:
        values, indices = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)  # [M, top]
        alts = [
            tuple(zip(row_i, row_v, strict=True))
            for row_i, row_v in zip(indices.tolist(), values.tolist(), strict=True)
        ]
    else:
        alts = [() for _ in tokens]
    return [TokenLogprob(int(t), float(c), a) for t, c, a in zip(tokens, chosen, alts, strict=True)]
