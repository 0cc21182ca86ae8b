"""Distil a small draft model from the target (DistillSpec, Zhou et al. 2023, arXiv 2310.08461).

The student is the target's own architecture with fewer layers (and optionally a narrower hidden
size), trained on self-distilled data (the target's answers, :mod:`specdec.training.data`) to
match the target's next-token distribution p at every response position.

Why KL(p || q) rather than cross entropy on the sampled tokens: speculative decoding accepts a
drafted token with probability sum_x min(p(x), q(x)) = 1 - TV(p, q) (sampling) or when the
draft's argmax is the target's argmax (greedy). Both depend on the whole of q matching p, and
DistillSpec shows that training on the teacher's distribution (on the teacher's own outputs)
raises acceptance more than cross entropy on one sampled token per position, which only sees
p through a single draw. Cross entropy on the target's (greedy) tokens can be mixed in with
``ce_weight``. The teacher distribution comes from a no-grad forward of the target per batch
(temperature 1), evaluated only at response positions; with ``teacher_topk=k`` the target
instead runs once over the training data and its k most likely tokens per position are cached
(the rest of p kept as one tail bucket), which saves the target's forward (about half the cost
of a step) on every later epoch. Held-out figures always use the exact, full p.

Initialisation: when the student keeps the target's hidden size it starts as the target's
embeddings, first ``layers`` decoder layers, final norm and LM head, which is exactly the
untrained early-exit draft (``--draft layers:N``); training starts from that draft's acceptance.
Its embeddings and LM head then stay frozen by default (``train_embeddings``): they are most
of its weights, and the layers learn to land in the space the target's head reads. A narrower
student starts from random weights and trains everything.

Output: an ordinary Hugging Face model directory (config.json, model.safetensors, tokenizer,
generation_config.json) that ``specdec generate --method draft --draft DIR`` and
``model.generate(assistant_model=...)`` load, plus ``specdec_training.json`` (the target's
identity, the data, the settings and the held-out agreement) and ``checkpoint/`` for
``resume=True``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from specdec.errors import CheckpointError, ConfigError, DataError, UnsupportedModelError
from specdec.target.loading import LoadedModel, identity_mismatch
from specdec.training.data import MANIFEST, Record, SelfDistilledData, load_data
from specdec.training.progress import NullBar, ProgressFactory

TRAINING_FILE = "specdec_training.json"
CHECKPOINT_DIR = "checkpoint"
FORMAT = "specdec-draft-distill/1"


# -- settings and results ---------------------------------------------------------------------


@dataclass(frozen=True)
class DistillConfig:
    """Settings of one distillation run.

    ``epochs`` and ``max_steps`` bound the run together: with only ``max_steps`` the data is
    repeated as often as needed; with neither, one epoch. Everything except the run length and
    the eval/checkpoint intervals must be unchanged to resume.
    """

    layers: int
    hidden: int | None = None
    epochs: int | None = None
    max_steps: int | None = None
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 50
    batch_tokens: int = 2048
    ce_weight: float = 0.0
    teacher_topk: int = 0  # 0: exact p from a target forward per batch; k: cached top-k of p
    train_embeddings: bool | None = None  # None: only when the student starts from random
    grad_clip: float = 1.0
    held_out: float = 0.05
    max_eval_records: int = 32
    eval_every: int = 100
    checkpoint_every: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (
                self.layers >= 1,
                f"--layers must be >= 1 (and below the target's), got {self.layers}",
            ),
            (self.hidden is None or self.hidden >= 1, f"hidden must be >= 1, got {self.hidden}"),
            (self.epochs is None or self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}"),
            (
                self.max_steps is None or self.max_steps >= 1,
                f"max_steps must be >= 1, got {self.max_steps}",
            ),
            (math.isfinite(self.lr) and self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}"),
            (self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}"),
            (self.batch_tokens >= 2, f"batch_tokens must be >= 2, got {self.batch_tokens}"),
            (0.0 <= self.ce_weight <= 1.0, f"ce_weight must be in [0, 1], got {self.ce_weight}"),
            (self.teacher_topk >= 0, f"teacher_topk must be >= 0, got {self.teacher_topk}"),
            (self.grad_clip > 0, f"grad_clip must be > 0, got {self.grad_clip}"),
            (0.0 < self.held_out < 1.0, f"held_out must be in (0, 1), got {self.held_out}"),
            (self.max_eval_records >= 1, "max_eval_records must be >= 1"),
            (self.eval_every >= 1, f"eval_every must be >= 1, got {self.eval_every}"),
            (self.checkpoint_every >= 1, "checkpoint_every must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def resume_settings(self) -> dict[str, Any]:
        """The settings a resumed run must share with the checkpoint."""
        free = {"epochs", "max_steps", "eval_every", "checkpoint_every"}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in free}


@dataclass(frozen=True)
class EvalPoint:
    """Held-out figures after ``step`` optimiser steps, over response positions."""

    step: int
    agreement: float  # P(argmax q == argmax p): greedy acceptance of a one-token draft
    kl: float  # mean KL(p || q) per position, nats
    positions: int


@dataclass(frozen=True)
class DistillResult:
    out_dir: Path
    steps: int  # optimiser steps done in total (this run and any it resumed)
    total_steps: int  # the run's planned length
    epochs: float  # passes over the training records
    tokens: int  # training tokens seen (without padding)
    wall_seconds: float  # over this run and any it resumed
    history: tuple[EvalPoint, ...]
    init: str  # how the student was initialised
    student_parameters: int
    resumed_from: int | None = None

    @property
    def initial(self) -> EvalPoint:
        return self.history[0]

    @property
    def final(self) -> EvalPoint:
        return self.history[-1]


# -- the student ------------------------------------------------------------------------------


def student_config(target: PretrainedConfig, layers: int, hidden: int | None) -> PretrainedConfig:
    """A deep copy of the target's config with ``layers`` layers (and hidden size ``hidden``).

    A narrower student keeps the head count and the MLP expansion ratio; the vocabulary, RoPE and
    every other setting are the target's. The target's config is not modified.
    """
    total = int(target.num_hidden_layers)
    if not 1 <= layers < total:
        raise ConfigError(
            f"--layers must be between 1 and {total - 1} (the target has {total} layers); "
            f"got {layers}"
        )
    cfg = copy.deepcopy(target)
    cfg.num_hidden_layers = layers
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:layers]
    width = int(target.hidden_size)
    if hidden is not None and hidden != width:
        heads = int(target.num_attention_heads)
        if hidden < 1 or hidden % heads:
            example = max(heads, (hidden // heads) * heads)
            raise ConfigError(
                f"--hidden {hidden} is not divisible by the target's {heads} attention heads; "
                f"use a multiple of {heads} (e.g. {example})"
            )
        head_dim = hidden // heads
        if head_dim % 2:
            raise ConfigError(
                f"--hidden {hidden} gives {head_dim}-wide attention heads, but rotary position "
                f"embeddings need an even head width; use a multiple of {2 * heads}"
            )
        cfg.hidden_size = hidden
        if getattr(cfg, "head_dim", None) is not None:
            cfg.head_dim = head_dim
        if getattr(cfg, "intermediate_size", None):
            cfg.intermediate_size = max(1, round(target.intermediate_size * hidden / width))
    cfg.architectures = list(getattr(target, "architectures", None) or []) or None
    cfg.dtype = torch.float32
    cfg._name_or_path = ""
    cfg.use_cache = True
    return cfg


def build_student(
    loaded: LoadedModel, layers: int, hidden: int | None, seed: int
) -> tuple[PreTrainedModel, str]:
    """A float32 student and a sentence saying how it was initialised.

    Tensors are copied from the target (never shared), so training leaves the target as it was.
    """
    target = loaded.model
    cfg = student_config(target.config, layers, hidden)
    if not cfg.architectures:
        cfg.architectures = [type(target).__name__]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        student = AutoModelForCausalLM.from_config(
            cfg, attn_implementation="sdpa", dtype=torch.float32
        )
    student.generation_config = copy.deepcopy(target.generation_config)
    if cfg.hidden_size != target.config.hidden_size:
        note = (
            f"random initialisation (seed {seed}): hidden size {cfg.hidden_size} differs from the "
            f"target's {target.config.hidden_size}, so no target weights fit"
        )
        return student, note
    _copy_from_target(student, target)
    note = (
        f"initialised from the target's embeddings, first {layers} of "
        f"{target.config.num_hidden_layers} layers, final norm and LM head"
    )
    return student, note


def _copy_from_target(student: PreTrainedModel, target: PreTrainedModel) -> None:
    weight = target.get_input_embeddings().weight
    dtype = weight.dtype if isinstance(weight, torch.Tensor) else torch.float32  # storage dtype
    with torch.no_grad():
        for name, param in student.named_parameters():
            module_name, _, attr = name.rpartition(".")
            try:
                module = target.get_submodule(module_name)
            except AttributeError:
                raise UnsupportedModelError(
                    f"cannot initialise the student from {type(target).__name__}: the target has "
                    f"no module {module_name!r}; pass --hidden to train from random weights"
                ) from None
            source = _dense_tensor(module, attr, dtype)
            if source is None or source.shape != param.shape:
                raise UnsupportedModelError(
                    f"cannot initialise the student's {name} from the target (shape "
                    f"{None if source is None else tuple(source.shape)} vs "
                    f"{tuple(param.shape)}); pass --hidden to train from random weights"
                )
            param.copy_(source.to(torch.float32))


def _dense_tensor(module: nn.Module, attr: str, dtype: torch.dtype) -> torch.Tensor | None:
    """A module's weight or bias as a plain tensor, also for the linears that the target's
    numerics swapped in (prepacked oneDNN, fp16 fbgemm), read back through their forward:
    ``m(I) - m(0)`` is ``W^T`` exactly, since each entry is one product by 1."""
    value = getattr(module, attr, None)
    if isinstance(value, torch.Tensor) and value.layout == torch.strided:
        return value.detach()
    n_in, n_out = getattr(module, "in_features", None), getattr(module, "out_features", None)
    if attr not in ("weight", "bias") or not (isinstance(n_in, int) and isinstance(n_out, int)):
        return None
    with torch.no_grad():
        zero = module(torch.zeros(1, n_in, dtype=dtype))  # [1, out] = bias
        if attr == "bias":
            return zero[0]
        return (module(torch.eye(n_in, dtype=dtype)) - zero).T.contiguous()  # [out, in]


# -- batches ----------------------------------------------------------------------------------


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


def lr_at(step: int, total: int, base: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to a tenth of ``base``.

    >>> [round(lr_at(s, 10, 1.0, 2), 3) for s in (0, 1, 2, 6, 9)]
    [0.5, 1.0, 1.0, 0.55, 0.134]
    """
    if step < warmup:
        return base * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# -- forward passes and the loss -------------------------------------------------------------


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


def _teacher_logits(target: PreTrainedModel, batch: Batch) -> torch.Tensor:
    # no_grad rather than inference_mode: the result is saved for the student's backward
    with torch.no_grad():
        return response_logits(target, batch)  # [P, V]


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
            log_p = F.log_softmax(_teacher_logits(target, batch), dim=-1)  # [P, V]
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


def evaluate(
    target: PreTrainedModel,
    student: PreTrainedModel,
    records: Sequence[Record],
    *,
    batch_tokens: int,
    pad_id: int,
    step: int,
) -> EvalPoint:
    """Top-1 agreement and mean KL(p || q) of the student on ``records``' response positions."""
    was_training = student.training
    student.eval()
    agree = 0
    kl_sum = 0.0
    positions = 0
    lengths = [len(r.tokens) for r in records]
    try:
        with torch.no_grad():
            for idx in batch_plan(lengths, batch_tokens, seed=0, epoch=0):
                batch = collate([records[i] for i in idx], pad_id)
                p_logits = _teacher_logits(target, batch)  # [P, V]
                q_logits = response_logits(student, batch)  # [P, V]
                n = p_logits.shape[0]
                kl = F.kl_div(
                    F.log_softmax(q_logits, -1),
                    F.log_softmax(p_logits, -1),
                    log_target=True,
                    reduction="sum",
                )
                kl_sum += float(kl)
                agree += int((q_logits.argmax(-1) == p_logits.argmax(-1)).sum())
                positions += n
    finally:
        student.train(was_training)
    return EvalPoint(step, agree / max(positions, 1), kl_sum / max(positions, 1), positions)


# -- checkpoints and export -------------------------------------------------------------------


@dataclass
class _State:
    step: int = 0
    tokens: int = 0
    wall_seconds: float = 0.0
    history: list[EvalPoint] = field(default_factory=list)


def _data_fingerprint(data: SelfDistilledData) -> str:
    return hashlib.sha256(data.manifest.to_json().encode()).hexdigest()[:32]


def _save_checkpoint(
    out: Path,
    student: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    state: _State,
    meta: dict[str, Any],
) -> None:
    from safetensors.torch import save_model

    tmp = Path(tempfile.mkdtemp(prefix=".checkpoint.", dir=out))
    try:
        save_model(student, str(tmp / "student.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        record = {**meta, **asdict(state), "history": [asdict(h) for h in state.history]}
        (tmp / "state.json").write_text(json.dumps(record, indent=2), encoding="utf-8")
        final = out / CHECKPOINT_DIR
        old = out / ".checkpoint.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.chmod(0o755)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_checkpoint(
    out: Path,
    student: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
) -> _State:
    from safetensors.torch import load_model as load_st

    ckpt = out / CHECKPOINT_DIR
    if not (ckpt / "state.json").is_file():
        raise CheckpointError(
            f"{out} holds no checkpoint to resume; run without --resume to start a new training"
        )
    try:
        saved = json.loads((ckpt / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"cannot read {ckpt / 'state.json'} ({e}); delete {ckpt} to start over"
        ) from e
    if saved.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt} is not a {FORMAT} checkpoint; use another --out")
    problem = identity_mismatch(saved.get("target", {}), meta["target"])
    if problem:
        raise CheckpointError(
            f"the checkpoint in {out} was trained for another target ({problem}); use another "
            "--out or the same --model"
        )
    if saved.get("data_fingerprint") != meta["data_fingerprint"]:
        raise CheckpointError(
            f"the checkpoint in {out} was trained on other data ({saved.get('data_dir')}); "
            "resume with the same --data, or use another --out"
        )
    old = saved.get("settings", {})
    diff = [k for k, v in meta["settings"].items() if old.get(k) != v]
    if diff:
        shown = ", ".join(f"{k}={old.get(k)!r}" for k in diff)
        raise CheckpointError(
            f"the checkpoint in {out} was trained with other settings ({shown}); resume with "
            "those, or use another --out"
        )
    try:
        load_st(student, str(ckpt / "student.safetensors"))
        optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
        return _State(
            step=int(saved["step"]),
            tokens=int(saved["tokens"]),
            wall_seconds=float(saved["wall_seconds"]),
            history=[EvalPoint(**h) for h in saved["history"]],
        )
    except Exception as e:  # truncated files raise assorted errors
        raise CheckpointError(
            f"cannot load the checkpoint in {ckpt} (truncated or corrupt?): "
            f"{type(e).__name__}: {e}; delete {ckpt} to start over"
        ) from e


def export_draft(student: PreTrainedModel, loaded: LoadedModel, out: Path) -> None:
    """Write ``student`` as a Hugging Face model directory with the target's tokenizer and
    generation config; each file is replaced atomically."""
    tmp = Path(tempfile.mkdtemp(prefix=".export.", dir=out))
    try:
        student.save_pretrained(tmp)
        loaded.tokenizer.save_pretrained(tmp)
        copy.deepcopy(loaded.model.generation_config).save_pretrained(tmp)
        for path in tmp.iterdir():
            path.chmod(0o644)  # temporary files are private; a model directory is not
            os.replace(path, out / path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_training_record(out: Path, meta: dict[str, Any], state: _State, **extra: Any) -> None:
    record = {
        **meta,
        "steps": state.step,
        "tokens": state.tokens,
        "wall_seconds": round(state.wall_seconds, 2),
        "held_out": [asdict(h) for h in state.history],
        "held_out_agreement": state.history[-1].agreement if state.history else None,
        **extra,
    }
    fd, tmp = tempfile.mkstemp(prefix=".training.", dir=out)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(record, indent=2))
    os.chmod(tmp, 0o644)
    os.replace(tmp, out / TRAINING_FILE)


# -- the trainer ------------------------------------------------------------------------------


def _prepare_out(out: Path, resume: bool) -> None:
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out} is a file; pass a directory")
    if not resume and ((out / CHECKPOINT_DIR).exists() or (out / TRAINING_FILE).exists()):
        raise CheckpointError(
            f"{out} already holds a draft training run; pass --resume to continue it, or choose "
            "another --out"
        )
    out.mkdir(parents=True, exist_ok=True)


def _schedule(
    lengths: Sequence[int], cfg: DistillConfig
) -> tuple[int, list[int]]:  # (total steps, steps per epoch)
    epochs = cfg.epochs if cfg.epochs is not None else (1 if cfg.max_steps is None else None)
    per_epoch: list[int] = []
    total = 0
    while (epochs is None or len(per_epoch) < epochs) and (
        cfg.max_steps is None or total < cfg.max_steps
    ):
        n = len(batch_plan(lengths, cfg.batch_tokens, cfg.seed, len(per_epoch)))
        per_epoch.append(n)
        total += n
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    return total, per_epoch


def train_draft(
    loaded: LoadedModel,
    data: SelfDistilledData | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    layers: int,
    hidden: int | None = None,
    epochs: int | None = None,
    max_steps: int | None = None,
    lr: float = 3e-4,
    batch_tokens: int = 2048,
    seed: int = 0,
    resume: bool = False,
    ce_weight: float = 0.0,
    teacher_topk: int = 0,
    held_out: float = 0.05,
    eval_every: int = 100,
    checkpoint_every: int = 200,
    progress: ProgressFactory = NullBar,
    **settings: Any,
) -> DistillResult:
    """Distil a ``layers``-layer draft from ``loaded`` on self-distilled ``data`` (a data
    directory or loaded data) into ``out_dir``; see the module docstring.

    Extra keyword ``settings`` are further :class:`DistillConfig` fields (``weight_decay``,
    ``warmup_steps``, ``grad_clip``, ``max_eval_records``). Progress and the held-out figures go
    to the ``progress`` bar; nothing is printed. ``resume=True`` continues from the checkpoint
    in ``out_dir`` (a top-k teacher cache is rebuilt, which costs one pass of the target).
    """
    cfg = DistillConfig(
        layers=layers, hidden=hidden, epochs=epochs, max_steps=max_steps, lr=lr,
        batch_tokens=batch_tokens, seed=seed, ce_weight=ce_weight, teacher_topk=teacher_topk,
        held_out=held_out,
        eval_every=eval_every, checkpoint_every=checkpoint_every, **settings,
    )  # fmt: skip
    data_dir: str | None = None
    if not isinstance(data, SelfDistilledData):
        data_dir = str(Path(data).resolve())
        data = load_data(data, loaded)
    data.check_target(loaded)
    student_config(loaded.model.config, cfg.layers, cfg.hidden)  # validate before any work
    train, held = data.split(cfg.held_out, cfg.seed)
    train = [r for r in train if r.response]
    held = [r for r in held if r.response][: cfg.max_eval_records]
    if not train or not held:
        raise DataError(
            f"the data holds {len(data.records)} sequences with responses; distillation needs "
            "at least 2 (one is held out). Generate more with `specdec data generate --limit N`"
        )
    out = Path(out_dir)
    _prepare_out(out, resume)

    target = loaded.model
    student, init = build_student(loaded, cfg.layers, cfg.hidden, cfg.seed)
    student.train()
    copied = student.config.hidden_size == target.config.hidden_size
    if not (cfg.train_embeddings if cfg.train_embeddings is not None else not copied):
        _freeze_embeddings(student)
        init += "; embeddings and LM head frozen"
    trainable = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    identity = loaded.identity()
    meta: dict[str, Any] = {
        "format": FORMAT,
        "target": identity,
        "data_dir": data_dir,
        "data_manifest": None if data_dir is None else str(Path(data_dir) / MANIFEST),
        "data_fingerprint": _data_fingerprint(data),
        "data_selection": data.selection,
        "data_records": {"train": len(train), "held_out": len(held)},
        "settings": cfg.resume_settings(),
    }
    state = _State()
    resumed_from = None
    if resume:
        state = _load_checkpoint(out, student, optimizer, meta)
        resumed_from = state.step

    pad = loaded.tokenizer.pad_token_id
    pad_id = int(pad) if pad is not None else min(loaded.eos_token_ids, default=0)
    lengths = [len(r.tokens) for r in train]
    total, per_epoch = _schedule(lengths, cfg)
    warmup = min(cfg.warmup_steps, total // 10)
    n_params = sum(p.numel() for p in student.parameters())
    run_meta = {
        **meta,
        "student": {
            "layers": cfg.layers,
            "hidden": int(student.config.hidden_size),
            "parameters": n_params,
            "trainable_parameters": sum(p.numel() for p in trainable),
            "init": init,
        },
    }

    def eval_now(step: int) -> EvalPoint:
        point = evaluate(target, student, held, batch_tokens=cfg.batch_tokens, pad_id=pad_id,
                         step=step)  # fmt: skip
        state.history.append(point)
        bar.write(
            f"step {step}: held-out agreement {point.agreement:.3f}, KL {point.kl:.3f} "
            f"({point.positions} positions)"
        )
        return point

    def save(finished: bool) -> None:
        _save_checkpoint(out, student, optimizer, state, run_meta)
        export_draft(student, loaded, out)
        _write_training_record(
            out, run_meta, state, total_steps=total, finished=finished,
            epochs=round(_epochs_done(state.step, per_epoch), 3),
        )  # fmt: skip

    bar = progress(total=total, initial=min(state.step, total), desc="distilling", unit="step")
    try:
        bar.write(f"student: {cfg.layers} layers, {n_params / 1e6:.1f}M parameters; {init}")
        if not state.history:
            eval_now(0)
        cache = None
        if cfg.teacher_topk and state.step < total:
            started = time.perf_counter()
            cache = build_topk_cache(target, train, cfg.teacher_topk,
                                     batch_tokens=cfg.batch_tokens, pad_id=pad_id,
                                     progress=progress)  # fmt: skip
            state.wall_seconds += time.perf_counter() - started
            run_meta["teacher_topk_mass"] = round(cache.mass, 4)
            bar.write(f"teacher top-{cfg.teacher_topk} covers {cache.mass:.3f} of p on average")
        plans: dict[int, list[list[int]]] = {}
        started = time.perf_counter()
        base_wall = state.wall_seconds
        while state.step < total:
            epoch, index = _locate(state.step, per_epoch)
            if epoch not in plans:
                plans = {epoch: batch_plan(lengths, cfg.batch_tokens, cfg.seed, epoch)}
            ids = plans[epoch][index]
            batch = collate([train[i] for i in ids], pad_id)
            lr_now = lr_at(state.step, total, cfg.lr, warmup)
            parts = _train_step(target, student, optimizer, batch, lr_now, cfg,
                                None if cache is None else cache.gather(ids))  # fmt: skip
            state.step += 1
            state.tokens += batch.tokens
            state.wall_seconds = base_wall + time.perf_counter() - started
            bar.update(1)
            bar.set_postfix(kl=f"{parts.kl:.3f}", ce=f"{parts.ce:.3f}", refresh=False)
            if state.step % cfg.eval_every == 0 or state.step == total:
                eval_now(state.step)
            if state.step % cfg.checkpoint_every == 0 or state.step == total:
                save(finished=state.step == total)
        if state.history[-1].step != state.step:  # resumed a finished run with nothing to do
            eval_now(state.step)
            save(finished=True)
    finally:
        bar.close()
    return DistillResult(
        out_dir=out,
        steps=state.step,
        total_steps=total,
        epochs=_epochs_done(state.step, per_epoch),
        tokens=state.tokens,
        wall_seconds=state.wall_seconds,
        history=tuple(state.history),
        init=init,
        student_parameters=n_params,
        resumed_from=resumed_from,
    )


def _freeze_embeddings(student: PreTrainedModel) -> None:
    """Keep the target's vocabulary matrices: with a tied LM head, Adam would otherwise move
    every one of the V rows every step, and the head is most of a small student's weights."""
    for module in (student.get_input_embeddings(), student.get_output_embeddings()):
        if module is not None:
            module.requires_grad_(False)


def _train_step(
    target: PreTrainedModel,
    student: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    lr: float,
    cfg: DistillConfig,
    cached: tuple[torch.Tensor, torch.Tensor] | None,  # the teacher's top-k ids, log p: [P, k]
) -> LossParts:
    """One optimiser step on one batch, against the exact teacher or its cached top k."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    if cached is None:
        teacher = _teacher_logits(target, batch)  # [P, V]
        parts = distill_loss(
            response_logits(student, batch), teacher, batch.next_tokens, cfg.ce_weight
        )
    else:
        parts = topk_distill_loss(
            response_logits(student, batch), *cached, batch.next_tokens, cfg.ce_weight
        )
    optimizer.zero_grad(set_to_none=True)
    parts.loss.backward()
    nn.utils.clip_grad_norm_([p for p in student.parameters() if p.requires_grad], cfg.grad_clip)
    optimizer.step()
    return parts


def _locate(step: int, per_epoch: Sequence[int]) -> tuple[int, int]:
    """(epoch, batch index) of global ``step``.

    >>> _locate(5, [3, 3, 3])
    (1, 2)
    """
    for epoch, n in enumerate(per_epoch):
        if step < n:
            return epoch, step
        step -= n
    raise IndexError("step beyond the planned epochs")


def _epochs_done(step: int, per_epoch: Sequence[int]) -> float:
    done = 0.0
    for n in per_epoch:
        if step >= n:
            done += 1
            step -= n
        else:
            return done + step / n
    return done
