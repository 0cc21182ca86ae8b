"""The distillation run: its settings, its task for the shared training loop, and
:func:`train_draft`, which ties the student, the batches, the teacher and the export together."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specdec.errors import CheckpointError, ConfigError, DataError
from specdec.heads.optim import Schedule
from specdec.target.loading import LoadedModel
from specdec.training.checkpoint import CheckpointStore, LoopState, run_identity
from specdec.training.data import MANIFEST, Record, SelfDistilledData, load_data
from specdec.training.distill.batches import batch_plan, collate
from specdec.training.distill.export import TRAINING_FILE, export_draft, write_training_record
from specdec.training.distill.loss import distill_loss, topk_distill_loss
from specdec.training.distill.student import build_student, freeze_embeddings, student_config
from specdec.training.distill.teacher import (
    TopKCache,
    build_topk_cache,
    response_logits,
    teacher_logits,
)
from specdec.training.loop import (
    EpochSampler,
    Evaluation,
    Log,
    LoopSettings,
    StepOutput,
    TrainTask,
    train_loop,
)
from specdec.training.progress import NullBar, ProgressFactory


@dataclass(frozen=True)
class DistillConfig:
    """Settings of one distillation run.

    ``epochs`` and ``max_steps`` bound the run together: with only ``max_steps`` the data is
    repeated as often as needed; with neither, one epoch. Everything except the run length and
    the eval/checkpoint intervals (``FREE_SETTINGS``) must be unchanged to resume.
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
                p_logits = teacher_logits(target, batch)  # [P, V]
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


class _DistillTask(TrainTask):
    """The student against the teacher's exact distribution (a forward per batch) or its cached
    top k; each checkpoint also exports the model directory and the training record."""

    def __init__(
        self,
        loaded: LoadedModel,
        student: PreTrainedModel,
        train: Sequence[Record],
        held: Sequence[Record],
        cfg: DistillConfig,
        out: Path,
        meta: dict[str, Any],
        total: int,
        per_epoch: Sequence[int],
        progress: ProgressFactory,
    ) -> None:
        self.module = self.student = student
        self.loaded, self.target = loaded, loaded.model
        self.train, self.held, self.cfg, self.out = train, held, cfg, out
        self.meta, self.progress = meta, progress
        self.total, self.per_epoch = total, per_epoch
        pad = loaded.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else min(loaded.eos_token_ids, default=0)
        self.cache: TopKCache | None = None
        self.record: dict[str, Any] = {}

    def begin(self, state: LoopState, log: Log) -> None:
        student = self.meta["student"]
        log(
            f"student: {student['layers']} layers, {student['parameters'] / 1e6:.1f}M "
            f"parameters; {student['init']}"
        )
        k = self.cfg.teacher_topk
        if k and state.step < self.total:
            self.cache = build_topk_cache(self.target, self.train, k,
                                          batch_tokens=self.cfg.batch_tokens, pad_id=self.pad_id,
                                          progress=self.progress)  # fmt: skip
            self.record["teacher_topk_mass"] = round(self.cache.mass, 4)
            log(f"teacher top-{k} covers {self.cache.mass:.3f} of p on average")

    def loss(self, batch: list[int]) -> StepOutput:
        b = collate([self.train[i] for i in batch], self.pad_id)
        q = response_logits(self.student, b)
        if self.cache is None:
            parts = distill_loss(q, teacher_logits(self.target, b), b.next_tokens,
                                 self.cfg.ce_weight)  # fmt: skip
        else:
            ids, logp = self.cache.gather(batch)
            parts = topk_distill_loss(q, ids, logp, b.next_tokens, self.cfg.ce_weight)
        return StepOutput(parts.loss, {"kl": parts.kl, "ce": parts.ce}, b.tokens)

    def evaluate(self, step: int, last: dict[str, float]) -> Evaluation:
        point = evaluate(self.target, self.student, self.held, batch_tokens=self.cfg.batch_tokens,
                         pad_id=self.pad_id, step=step)  # fmt: skip
        figures = {k: v for k, v in asdict(point).items() if k != "step"}
        message = (
            f"step {step}: held-out agreement {point.agreement:.3f}, KL {point.kl:.3f} "
            f"({point.positions} positions)"
        )
        return Evaluation(figures, message)

    def saved(self, state: LoopState, finished: bool) -> None:
        export_draft(self.student, self.loaded, self.out)
        write_training_record(
            self.out, {**self.meta, **self.record}, state, total_steps=self.total,
            finished=finished, epochs=round(epochs_done(state.step, self.per_epoch), 3),
        )  # fmt: skip


def plan_epochs(lengths: Sequence[int], cfg: DistillConfig) -> tuple[int, list[int]]:
    """(total steps, steps of each epoch the run reaches): as many epochs as ``cfg.epochs`` and
    ``cfg.max_steps`` allow together (one without either); the last may be cut short."""
    epochs = cfg.epochs if cfg.epochs is not None else (1 if cfg.max_steps is None else None)
    per_epoch: list[int] = []
    while (epochs is None or len(per_epoch) < epochs) and (
        cfg.max_steps is None or sum(per_epoch) < cfg.max_steps
    ):
        per_epoch.append(len(batch_plan(lengths, cfg.batch_tokens, cfg.seed, len(per_epoch))))
    total = sum(per_epoch)
    return (total if cfg.max_steps is None else min(total, cfg.max_steps)), per_epoch


def epochs_done(step: int, per_epoch: Sequence[int]) -> float:
    """Passes over the training records after ``step`` steps (the last epoch may be partial).

    >>> epochs_done(4, [2, 4])
    1.5
    """
    done = 0.0
    for n in per_epoch:
        if step >= n:
            done += 1
            step -= n
        else:
            return done + step / n
    return done


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
    directory or loaded data) into ``out_dir``; see :mod:`specdec.training.distill`.

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
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out} is a file; pass a directory")
    if not resume and (out / TRAINING_FILE).exists():
        raise CheckpointError(
            f"{out} already holds a draft training run; pass --resume to continue it, or choose "
            "another --out"
        )

    target = loaded.model
    student, init = build_student(loaded, cfg.layers, cfg.hidden, cfg.seed)
    copied = student.config.hidden_size == target.config.hidden_size
    if not (cfg.train_embeddings if cfg.train_embeddings is not None else not copied):
        freeze_embeddings(student)
        init += "; embeddings and LM head frozen"
    trainable = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    meta = run_identity(
        "distill", loaded, data, cfg,
        data_dir=data_dir,
        data_manifest=None if data_dir is None else str(Path(data_dir) / MANIFEST),
        data_selection=data.selection,
        data_records={"train": len(train), "held_out": len(held)},
        student={
            "layers": cfg.layers,
            "hidden": int(student.config.hidden_size),
            "parameters": sum(p.numel() for p in student.parameters()),
            "trainable_parameters": sum(p.numel() for p in trainable),
            "init": init,
        },
    )  # fmt: skip
    store = CheckpointStore(out, meta)
    store.check_start(resume)  # before the directory is made: a refused run leaves no trace
    out.mkdir(parents=True, exist_ok=True)

    lengths = [len(r.tokens) for r in train]
    total, per_epoch = plan_epochs(lengths, cfg)
    task = _DistillTask(loaded, student, train, held, cfg, out, meta, total, per_epoch, progress)
    run = train_loop(
        task,
        optimizer,
        EpochSampler(lambda epoch: batch_plan(lengths, cfg.batch_tokens, cfg.seed, epoch)),
        LoopSettings(
            total_steps=total,
            lr=cfg.lr,
            schedule=Schedule(min(cfg.warmup_steps, total // 10), "cosine", 0.1),
            eval_every=cfg.eval_every,
            checkpoint_every=cfg.checkpoint_every,
            grad_clip=cfg.grad_clip,
            initial_eval=True,
            keep_checkpoint=True,
            desc="distilling",
        ),
        store,
        resume=resume,
        progress=progress,
    )
    state = run.state
    return DistillResult(
        out_dir=out,
        steps=state.step,
        total_steps=total,
        epochs=epochs_done(state.step, per_epoch),
        tokens=state.tokens,
        wall_seconds=state.wall_seconds,
        history=tuple(
            EvalPoint(int(h["step"]), h["agreement"], h["kl"], int(h["positions"]))
            for h in state.history
        ),
        init=init,
        student_parameters=meta["student"]["parameters"],
        resumed_from=run.resumed_from,
    )
