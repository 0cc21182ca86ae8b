"""Batches of self-distilled records: right-padded, with the response positions trained on, and
each epoch's plan of which records share a batch."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.training.data import Record


@dataclass(frozen=True)
class Batch:
    """Right-padded sequences and the positions trained on."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] bool: the next token is a response token
    next_tokens: torch.Tensor  # [P] the token after each loss position (the target's own)
    tokens: int  # real (unpadded) tokens


def collate(records: Sequence[Record], pad_id: int) -> Batch:
    """Pad ``records`` on the right; loss positions are those whose next token is a response
    token, i.e. positions ``prompt_len - 1 .. len - 2``.

    >>> b = collate([Record((5, 6, 7, 8), 2, 0), Record((5, 9, 4), 2, 1)], pad_id=0)
    >>> b.input_ids.tolist(), b.loss_mask.int().tolist(), b.next_tokens.tolist()
    ([[5, 6, 7, 8], [5, 9, 4, 0]], [[0, 1, 1, 0], [0, 1, 0, 0]], [7, 8, 4])
    """
    width = max(len(r.tokens) for r in records)
    ids = torch.full((len(records), width), pad_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(records), width), dtype=torch.long)  # [B, T]
    loss = torch.zeros((len(records), width), dtype=torch.bool)  # [B, T]
    for i, r in enumerate(records):
        n = len(r.tokens)
        ids[i, :n] = torch.tensor(r.tokens, dtype=torch.long)
        mask[i, :n] = 1
        loss[i, max(r.prompt_len - 1, 0) : n - 1] = True
    next_tokens = ids[:, 1:][loss[:, :-1]]  # [P]
    return Batch(ids, mask, loss, next_tokens, sum(len(r.tokens) for r in records))


def batch_plan(
    lengths: Sequence[int], batch_tokens: int, seed: int, epoch: int, pool: int = 64
) -> list[list[int]]:
    """One epoch's batches of record indices, deterministic in ``(seed, epoch)``.

    Records are shuffled, then sorted by length within pools of ``pool`` records so that a
    batch pads little; a batch holds as many records as fit in ``batch_tokens`` padded tokens
    (at least one). The batches are shuffled again.

    >>> batch_plan([3, 3, 3, 3], batch_tokens=6, seed=0, epoch=0)
    [[0, 3], [1, 2]]
    >>> sorted(i for b in batch_plan([5, 1, 9, 2, 7], 10, 1, 3) for i in b)
    [0, 1, 2, 3, 4]
    """
    rng = random.Random(f"{seed}/{epoch}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches: list[list[int]] = []
    for start in range(0, len(order), pool):
        chunk = sorted(order[start : start + pool], key=lambda i: -lengths[i])
        current: list[int] = []
        for i in chunk:
            # sorted by length, so the first record of a batch sets its padded width
            if current and lengths[current[0]] * (len(current) + 1) > batch_tokens:
                batches.append(current)
                current = []
            current.append(i)
        if current:
            batches.append(current)
    rng.shuffle(batches)
    return batches
