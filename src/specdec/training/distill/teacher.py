"""Forward passes at the loss positions, for the student and the (frozen) teacher, and the
teacher's cached top-k distributions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specdec.errors import UnsupportedModelError
from specdec.training.data import Record
from specdec.training.distill.batches import Batch, batch_plan, collate
from specdec.training.progress import NullBar, ProgressFactory


def response_logits(model: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """Logits at the batch's loss positions only: the decoder runs over every position, the LM
    head (the costliest matrix of a small model with a large vocabulary) only where needed."""
    decoder = model.get_decoder()
    hidden = decoder(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
    ).last_hidden_state  # [B, T, H]
    head = model.get_output_embeddings()
    if head is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no output embeddings (LM head)")
    return head(hidden[batch.loss_mask]).float()  # [P, V]


def teacher_logits(target: PreTrainedModel, batch: Batch) -> torch.Tensor:
    # no_grad rather than inference_mode: the result is saved for the student's backward
    with torch.no_grad():
        return response_logits(target, batch)  # [P, V]


@dataclass(frozen=True)
class TopKCache:
    """The teacher's top-k tokens and log-probabilities at every loss position of each record."""

    ids: list[torch.Tensor]  # per record [R, k] int32
    logp: list[torch.Tensor]  # per record [R, k] float32
    mass: float  # mean probability the top k cover

    def gather(self, records: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows in the order of ``response_logits`` (record by record, positions in order)."""
        ids = torch.cat([self.ids[i] for i in records])  # [P, k]
        logp = torch.cat([self.logp[i] for i in records])  # [P, k]
        return ids, logp


def build_topk_cache(
    target: PreTrainedModel,
    records: Sequence[Record],
    k: int,
    *,
    batch_tokens: int,
    pad_id: int,
    progress: ProgressFactory = NullBar,
) -> TopKCache:
    """One no-grad pass of the target over ``records``, keeping the top ``k`` of p."""
    ids: list[torch.Tensor | None] = [None] * len(records)
    logp: list[torch.Tensor | None] = [None] * len(records)
    covered = 0.0
    positions = 0
    bar = progress(total=len(records), desc="teacher top-k", unit="seq")
    try:
        for idx in batch_plan([len(r.tokens) for r in records], batch_tokens, seed=0, epoch=0):
            batch = collate([records[i] for i in idx], pad_id)
            log_p = F.log_softmax(teacher_logits(target, batch), dim=-1)  # [P, V]
            top = log_p.topk(min(k, log_p.shape[-1]), dim=-1)  # [P, k]
            covered += float(top.values.exp().sum())
            positions += log_p.shape[0]
            start = 0
            for i in idx:
                n = len(records[i].response)
                ids[i] = top.indices[start : start + n].to(torch.int32)
                logp[i] = top.values[start : start + n].clone()
                start += n
            bar.update(len(idx))
    finally:
        bar.close()
    assert all(t is not None for t in ids) and all(t is not None for t in logp)
    return TopKCache(
        [t for t in ids if t is not None],
        [t for t in logp if t is not None],
        covered / max(positions, 1),
    )
