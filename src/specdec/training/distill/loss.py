"""The distillation losses: KL(p || q) against the teacher's full distribution, or against its
top k with the rest as one tail bucket, optionally mixed with cross entropy on its tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossParts:
    loss: torch.Tensor  # scalar that is optimised
    kl: float  # mean KL(p || q) per position
    ce: float  # mean cross entropy on the target's tokens


def distill_loss(
    student_logits: torch.Tensor,  # [P, V]
    teacher_logits: torch.Tensor,  # [P, V]
    next_tokens: torch.Tensor,  # [P]
    ce_weight: float = 0.0,
) -> LossParts:
    """``(1 - ce_weight) * KL(p || q) + ce_weight * CE``, means over positions, temperature 1.

    >>> t = torch.tensor([[2.0, 0.0, -1.0]])
    >>> parts = distill_loss(t.clone(), t, torch.tensor([0]))
    >>> round(parts.kl, 6), round(parts.ce, 4)
    (0.0, 0.1698)
    """
    log_q = F.log_softmax(student_logits.float(), dim=-1)  # [P, V]
    log_p = F.log_softmax(teacher_logits.float(), dim=-1)  # [P, V]
    kl = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
    ce = F.nll_loss(log_q, next_tokens)
    loss = kl if ce_weight == 0 else (1 - ce_weight) * kl + ce_weight * ce
    return LossParts(loss, float(kl.detach()), float(ce.detach()))


def topk_distill_loss(
    student_logits: torch.Tensor,  # [P, V]
    top_ids: torch.Tensor,  # [P, k] the teacher's k most likely tokens
    top_logp: torch.Tensor,  # [P, k] their log p
    next_tokens: torch.Tensor,  # [P]
    ce_weight: float = 0.0,
) -> LossParts:
    """:func:`distill_loss` with p known only on its top k tokens: the KL between p and q
    coarsened to k + 1 outcomes (the top k, and everything else as one tail bucket). It is a
    lower bound of KL(p || q), exact when q spreads its tail like p.

    >>> t = torch.tensor([[2.0, 0.0, -1.0, -3.0]])
    >>> top = t.log_softmax(-1).topk(2)  # p = (0.84, 0.11, 0.04, 0.01): top 2 and a tail
    >>> round(topk_distill_loss(t, top.indices, top.values, torch.tensor([0])).kl, 6)
    0.0
    """
    log_q = F.log_softmax(student_logits.float(), dim=-1)  # [P, V]
    log_q_top = log_q.gather(1, top_ids.long())  # [P, k]
    p_top = top_logp.float().exp()  # [P, k]
    p_tail = (1 - p_top.sum(-1)).clamp_min(0)  # [P]
    q_tail = (1 - log_q_top.exp().sum(-1)).clamp_min(1e-12)  # [P]
    kl_rows = (
        (p_top * (top_logp.float() - log_q_top)).sum(-1)
        + torch.xlogy(p_tail, p_tail)
        - p_tail * q_tail.log()
    )  # [P]
    kl = kl_rows.mean()
    ce = F.nll_loss(log_q, next_tokens)
    loss = kl if ce_weight == 0 else (1 - ce_weight) * kl + ce_weight * ce
    return LossParts(loss, float(kl.detach()), float(ce.detach()))
