"""EAGLE drafter training on self-distilled data: frozen target, cached features, training-time
test.

Features: one target pass per sequence keeps, at every position, the hidden states the drafter
reads (the final normed state for EAGLE-1; the low/middle/high layer outputs for EAGLE-3) and
the target's top-``k`` next-token log-probabilities there (its own distribution, the soft
label). Long prompts are cut to their last ``context`` tokens: the drafter needs recent context,
not the whole prompt. Features are cached next to the checkpoint (float16), keyed by data,
target and settings, in memory-mapped files (``feature_cache``), so training on any amount of data
keeps only the batches in memory.

Training-time test (EAGLE-3): the drafter is unrolled on its own outputs for ``ttt_steps``
steps. Step 0 reads the target's features; step j reads step j-1's output states at the same
positions, with the token j further along, at position p + j. Its attention sees step 0's
(target-feature) keys causally and, of later steps, only its own position's keys: exactly what a
node at depth j of a draft tree sees at serving time (the committed prefix and its ancestors).
Feeding the *data's* tokens at later steps is exact for the chain in which every earlier draft
was accepted, since the data is the target's own greedy output, so the held-out "simulated τ"
(1 + Σ_j P(steps 0..j all right)) is the mean accepted length of greedy chain drafting.

Loss per step j (weight ``decay^j``): cross-entropy against the target's top-k distribution at
the predicted position (tokens outside the draft vocabulary contribute nothing); EAGLE-1 adds
its feature regression (smooth L1 to the target's next hidden state), as in the paper.

Multi-GPU: the loop runs through ``accelerate`` (model, optimiser and batches prepared by an
``Accelerator``), so ``accelerate launch -m specdec.cli.main train eagle ...`` trains data-
parallel; feature extraction runs on the main process first and the others read its cache.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F

from specdec.errors import ConfigError, DataError
from specdec.heads.eagle import (
    VARIANTS,
    EagleConfig,
    EagleHead,
    causal_prefix_mask,
    default_aux_layers,
    extend_kv,
    layer_config_from,
)
from specdec.target.loading import DEFAULT_GGUF_NAME, DEFAULT_MODEL_HUB_ID, LoadedModel
from specdec.target.numerics import dense_weight
from specdec.training.checkpoint import CheckpointStore, check_schedule, run_identity
from specdec.training.data import Record, SelfDistilledData
from specdec.training.feature_cache import features_per_record, release_pages
from specdec.training.loop import Evaluation, StepOutput, TrainTask, train_epochs
from specdec.training.medusa import draft_vocabulary
from specdec.training.precision import autocast, check_precision
from specdec.training.progress import NullBar, ProgressFactory

# Prompt tokens kept before each response, for the CLI and the API alike: the feature cache's
# key includes it, so two defaults would make a script miss a CLI run's cache.
DEFAULT_CONTEXT = 192


@dataclass(frozen=True)
class EagleTrainConfig:
    variant: str = "eagle3"
    aux_layers: tuple[int, ...] | None = None  # EAGLE-3; None = (2, L // 2, L - 3)
    draft_vocab: int = 8192  # EAGLE-3 only; 0 = the full vocabulary
    ttt_steps: int = 3  # unrolled steps (1 = plain teacher forcing)
    step_decay: float = 0.8
    feature_weight: float = 1.0  # EAGLE-1's regression term
    topk_labels: int = 8  # target log-probabilities kept per position (the soft label)
    context: int = DEFAULT_CONTEXT  # prompt tokens kept before the response
    epochs: float = 6.0
    max_steps: int | None = None
    lr: float = 1e-3
    batch_sequences: int = 8
    held_out: float = 0.05
    eval_every: int = 100
    checkpoint_every: int = 100
    speculative_tokens: int = 5
    seed: int = 0
    precision: str = "auto"  # bf16-mixed | fp32 | auto: bf16 where native (training/precision)
    # start from this drafter's weights and draft vocabulary instead of the target's rows:
    # more answers then cost passes over the new ones only, not a retrain from scratch
    init_from: str | None = None

    def __post_init__(self) -> None:
        check_precision(self.precision)
        if self.variant not in VARIANTS:
            raise ConfigError(f"unknown --variant {self.variant!r}; use one of {VARIANTS}")
        if self.aux_layers is not None and self.variant != "eagle3":
            raise ConfigError("--aux-layers is for --variant eagle3")
        if self.draft_vocab < 0:
            raise ConfigError(f"--draft-vocab must be >= 0 (0 = full), got {self.draft_vocab}")
        if not 1 <= self.ttt_steps <= 16:
            raise ConfigError(f"--ttt-steps must be in 1..16, got {self.ttt_steps}")
        check_schedule(
            max_steps=self.max_steps,
            epochs=self.epochs,
            lr=self.lr,
            batch=self.batch_sequences,
            held_out=self.held_out,
        )
        if self.topk_labels < 1:
            raise ConfigError(f"top-k labels must be >= 1, got {self.topk_labels}")
        if self.context < 1:
            raise ConfigError(f"--context must be >= 1, got {self.context}")


@dataclass
class EagleTrainResult:
    out_dir: Path
    steps: int
    train_positions: int
    held_out_positions: int
    draft_vocab_coverage: float
    step_accuracy: list[float]  # held-out P(step j right | steps < j right)
    simulated_tau: float
    seconds: float
    feature_seconds: float
    history: list[dict[str, float]] = field(default_factory=list)


@dataclass
class SequenceFeatures:
    """Per sequence (window): tokens, drafter inputs and the target's soft labels."""

    tokens: list[torch.Tensor]  # [T] int64 each
    features: list[torch.Tensor]  # [T, F] float16: drafter input at each position
    final: list[torch.Tensor]  # [T, H] float16: final normed state (EAGLE-1 regression target)
    top_ids: list[torch.Tensor]  # [T, k] int64: target's top-k next tokens at each position
    top_logp: list[torch.Tensor]  # [T, k] float16
    first_label: list[int]  # first position whose next token is a response token

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def positions(self) -> int:
        return sum(len(t) - f for t, f in zip(self.tokens, self.first_label, strict=True))


def feature_layers(config: EagleTrainConfig, num_layers: int) -> tuple[int, ...]:
    """The target hidden-state indices the drafter reads: EAGLE-1 the final state, EAGLE-3
    its auxiliary layers."""
    if config.variant == "eagle1":
        return (-1,)
    return aux_layers(config, num_layers)


def aux_layers(config: EagleTrainConfig, num_layers: int) -> tuple[int, ...]:
    layers = tuple(config.aux_layers or default_aux_layers(num_layers))
    for i in layers:
        if not 0 <= i <= num_layers:
            raise ConfigError(
                f"--aux-layers {i} is out of range: the target has {num_layers} layers "
                f"(hidden-state indices 0..{num_layers})"
            )
    return layers


@torch.inference_mode()
def extract_sequence_features(
    loaded: LoadedModel,
    records: Sequence[Record],
    config: EagleTrainConfig,
    cache_file: Path | None = None,
    progress: ProgressFactory = NullBar,
    desc: str = "target features",
) -> SequenceFeatures:
    """One target pass per sequence; cached per answer in ``cache_file`` (keyed by target and
    settings), so data that grew since the last training costs passes only for new answers.

    The cache holds both variants' inputs (the auxiliary layers and the final state), so an
    EAGLE-1 and an EAGLE-3 drafter trained on the same data share one extraction."""
    n_layers = int(loaded.model.config.num_hidden_layers)
    layers = aux_layers(config, n_layers)
    salt = f"eagle:{layers}:{config.topk_labels}:{config.context}"
    model = loaded.model
    device = loaded.device  # the target's device (a GPU extracts in seconds); cached on the CPU

    def one(r: Record) -> dict[str, torch.Tensor] | None:
        start = max(0, r.prompt_len - config.context)
        toks = torch.tensor(r.tokens[start:], dtype=torch.long)  # [T]
        first = max(r.prompt_len - 1 - start, 0)
        if len(toks) - first < 3:
            return None
        keep = len(toks) - first  # logits only where labels are read
        res = model(input_ids=toks[None].to(device), output_hidden_states=True, logits_to_keep=keep)
        states = res.hidden_states
        logp = torch.log_softmax(res.logits[0].float(), -1)  # [keep, V]
        top = logp.topk(config.topk_labels, dim=-1)
        top_ids = torch.zeros(len(toks), config.topk_labels, dtype=torch.long)
        top_logp = torch.full((len(toks), config.topk_labels), -30.0)
        top_ids[first:], top_logp[first:] = top.indices.cpu(), top.values.cpu()
        return {
            "tokens": toks,
            "aux": torch.cat([states[i][0] for i in layers], -1).to(torch.float16).cpu(),
            "final": states[-1][0].to(torch.float16).cpu(),
            "top_ids": top_ids,
            "top_logp": top_logp.to(torch.float16),
            "lengths": torch.tensor([len(toks)]),
            "first_label": torch.tensor([first]),
        }

    rows = [
        r
        for r in features_per_record(
            cache_file, records, loaded.identity(), salt, one, progress, desc
        )
        if r is not None
    ]
    if not rows:
        raise DataError("no sequence has a response long enough to learn from")
    # per-answer views, not one concatenated copy: with a cache they map its files, so the
    # features of every answer need no resident memory until a batch reads them
    final = [r["final"] for r in rows]
    return SequenceFeatures(
        [r["tokens"] for r in rows],
        final if config.variant == "eagle1" else [r["aux"] for r in rows],
        final,
        [r["top_ids"] for r in rows],
        [r["top_logp"] for r in rows],
        [int(r["first_label"][0]) for r in rows],
    )


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] (padded with 0)
    features: torch.Tensor  # [B, T, F] float32
    final: torch.Tensor  # [B, T, H] float32
    top_ids: torch.Tensor  # [B, T, k] target ids (draft ids after to_draft)
    top_p: torch.Tensor  # [B, T, k] probabilities
    label_ok: torch.Tensor  # [B, T] bool: the next token is a response token (and exists)


def collate(
    feats: SequenceFeatures, idx: Sequence[int], device: torch.device | str = "cpu"
) -> Batch:
    t_max = max(len(feats.tokens[i]) for i in idx)
    b = len(idx)
    f_dim = feats.features[idx[0]].shape[1]
    h_dim = feats.final[idx[0]].shape[1]
    k = feats.top_ids[idx[0]].shape[1]
    batch = Batch(
        torch.zeros(b, t_max, dtype=torch.long),
        torch.zeros(b, t_max, f_dim),
        torch.zeros(b, t_max, h_dim),
        torch.zeros(b, t_max, k, dtype=torch.long),
        torch.zeros(b, t_max, k),
        torch.zeros(b, t_max, dtype=torch.bool),
    )
    for row, i in enumerate(idx):
        n = len(feats.tokens[i])
        batch.tokens[row, :n] = feats.tokens[i]
        batch.features[row, :n] = feats.features[i].float()
        batch.final[row, :n] = feats.final[i].float()
        batch.top_ids[row, :n] = feats.top_ids[i]
        batch.top_p[row, :n] = feats.top_logp[i].float().exp()
        batch.label_ok[row, feats.first_label[i] : n - 1] = True
    release_pages()  # the rows are copied: the cache's pages need not stay resident
    return Batch(*(getattr(batch, f).to(device) for f in Batch.__dataclass_fields__))


def ttt_mask(idx: torch.Tensor, t: int, step: int) -> torch.Tensor:
    """Attention of unroll step ``step`` (>= 1) at positions ``idx`` over the keys of steps
    0..step.  # [B, W, T + step W]

    Step 0's keys (all ``t`` positions) causally; later steps' keys, computed at the same
    positions ``idx``, only at the query's own position.

    >>> ttt_mask(torch.tensor([[0, 1]]), 2, 1).int().tolist()
    [[[1, 0, 1, 0], [1, 1, 0, 1]]]
    """
    b, w = idx.shape
    causal = torch.arange(t, device=idx.device)[None, None] <= idx[:, :, None]  # [B, W, T]
    own = torch.eye(w, dtype=torch.bool, device=idx.device).repeat(1, step)  # [W, step W]
    return torch.cat([causal, own[None].expand(b, w, step * w)], dim=2)


def active_window(label_ok: torch.Tensor, reach: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the positions the unroll's steps >= 1 must compute: from ``reach`` before the
    first label to the last. Step j >= 1 at position p reads only step 0's keys and its own
    position's keys of steps 1..j-1, so the prompt before that window and the batch's padding
    after it feed no label: skipping them is exact, and they are ~40% of a ShareGPT batch
    (192 prompt tokens of context before answers of up to 256).

    Returns ``idx`` [B, W] (clamped into the row) and ``live`` [B, W] (inside the window)."""
    b, t = label_ok.shape
    ar = torch.arange(t, device=label_ok.device)
    first = torch.where(label_ok, ar, t).min(1).values  # [B]
    last = torch.where(label_ok, ar, -1).max(1).values  # [B]
    start = (first - reach).clamp_min(0)
    width = (last - 1 - start).clamp_min(0)  # step j >= 1 at p reads the label at p + j + 1
    w = max(int(width.max()), 1)
    offs = torch.arange(w, device=label_ok.device)
    idx = (start[:, None] + offs).clamp_max(t - 1)
    return idx, offs[None] < width[:, None]


@dataclass
class StepStats:
    loss: torch.Tensor
    correct: list[torch.Tensor]  # per step: [B, T] bool, draft argmax == the data's token
    valid: list[torch.Tensor]  # per step: [B, T] bool


@dataclass(frozen=True)
class Readout:
    """The vocabulary the loss scores: the drafter's own (EAGLE-3's draft vocabulary), or for
    EAGLE-1, whose readout is the target's full LM head, the ``rows`` of the most frequent
    tokens: scoring all 49k rows for every position made a training step several times slower
    on a CPU (docs/training.md), and the softmax over the frequent tokens ranks the candidates
    that matter the same.
    ``to_draft`` maps a target id to its index in that vocabulary (-1 outside it)."""

    to_draft: torch.Tensor  # [V]
    rows: torch.Tensor | None = None  # [V_train] target ids, EAGLE-1 only

    def to(self, device: torch.device | str) -> Readout:
        rows = None if self.rows is None else self.rows.to(device)
        return Readout(self.to_draft.to(device), rows)

    def logits(self, head: EagleHead, state: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return head.logits(state)
        return state @ cast(torch.Tensor, head.readout)[self.rows].T


def readout_for(head: EagleHead, config: EagleTrainConfig, records: Sequence[Record]) -> Readout:
    vocab = head.config.vocab_size
    rows = None
    ids = head.draft_token_ids()
    if head.config.variant == "eagle1" and 0 < config.draft_vocab < vocab:
        rows = draft_vocabulary(records, config.draft_vocab, vocab).sort().values
        ids = rows
    to_draft = torch.full((vocab,), -1, dtype=torch.long)
    to_draft[ids] = torch.arange(len(ids))
    return Readout(to_draft, rows)


def _shifted_at(
    x: torch.Tensor, fill: float = 0, *, shift: int, rows: torch.Tensor, idx: torch.Tensor
) -> torch.Tensor:
    """``x`` [B, T, ...] shifted left by ``shift`` (padded with ``fill``), at positions
    ``idx``.  # [B, W, ...]"""
    pad = (0, 0) * (x.dim() - 2) + (0, shift)
    return F.pad(x[:, shift:], pad, value=fill)[rows, idx]


def unroll(
    head: EagleHead,
    batch: Batch,
    readout: Readout,
    config: EagleTrainConfig,
    *,
    packed: bool = True,
) -> StepStats:
    """The training-time-test unroll over one batch; loss and per-step correctness.

    Step 0 runs at every position (its keys are the context every later step reads); steps
    >= 1 only in each row's :func:`active_window` (``packed``; False runs them everywhere, the
    reference the tests compare it with)."""
    b, t = batch.tokens.shape
    state = head.fuse(batch.features)  # [B, T, H]
    dev = batch.tokens.device
    rows = torch.arange(b, device=dev)[:, None]
    full = torch.arange(t, device=dev)[None].expand(b, t)
    window, live = (
        active_window(batch.label_ok, config.ttt_steps)
        if packed
        else (full, torch.ones(b, t, dtype=torch.bool, device=dev))
    )
    idx, in_window = full, torch.ones(b, t, dtype=torch.bool, device=dev)  # step 0: everywhere
    past: tuple[torch.Tensor, torch.Tensor] | None = None
    to_draft = readout.to_draft
    draft_ids = to_draft[batch.top_ids]  # [B, T, k], -1 outside the scored vocabulary
    total = batch.features.new_zeros(())
    correct, valid_steps = [], []
    for j in range(config.ttt_steps):
        # step j at position p reads token p + j + 1 and predicts the target at p + j + 1
        shift = j + 1
        if shift >= t:
            break
        if j == 1:  # from here on, only the rows' windows
            idx, in_window = window, live
            state = state[rows, idx]
        at = partial(_shifted_at, shift=shift, rows=rows, idx=idx)
        tokens = at(batch.tokens)  # [B, W]
        mask = causal_prefix_mask(t, 0, dev) if j == 0 else ttt_mask(idx, t, j)
        out, kv = head(state, tokens, idx + j, past, mask)
        past = extend_kv(past, kv)
        # labels at position p + shift: the target's distribution after token p + shift
        ids = at(draft_ids, -1)  # [B, W, k]
        probs = at(batch.top_p)  # [B, W, k]
        ok = at(batch.label_ok) & in_window  # [B, W]
        nxt = at(F.pad(batch.tokens[:, 1:], (0, 1)))  # data token p + shift + 1
        # the readout (the costliest matmul) only where a label is read  # [M, Vd]
        logp = torch.log_softmax(readout.logits(head, out[ok]).float(), -1)
        ids_ok = ids[ok]  # [M, k]
        picked = logp.gather(-1, ids_ok.clamp_min(0)) * (ids_ok >= 0)
        denom = ok.sum().clamp_min(1)
        loss_j = -(probs[ok] * picked).sum() / denom
        if head.config.variant == "eagle1" and config.feature_weight > 0:
            tgt = at(batch.final)  # [B, W, H]
            reg = F.smooth_l1_loss(out, tgt, reduction="none").mean(-1)
            loss_j = loss_j + config.feature_weight * (reg * ok).sum() / denom
        total = total + config.step_decay**j * loss_j
        nxt_draft = to_draft[nxt[ok]]  # [M]
        # per step [B, T] again, so chain acceptance follows a position across steps
        right = torch.zeros(b, t, dtype=torch.bool, device=dev)
        valid = torch.zeros(b, t, dtype=torch.bool, device=dev)
        where = (rows.expand_as(idx)[ok], idx[ok])
        right[where] = (logp.argmax(-1) == nxt_draft) & (nxt_draft >= 0)
        valid[where] = True
        correct.append(right)
        valid_steps.append(valid)
        state = out
    return StepStats(total, correct, valid_steps)


def chain_acceptance(stats: Sequence[StepStats]) -> tuple[list[float], float]:
    """Per-step P(step j right | steps < j right), and 1 + Σ_j P(steps 0..j all right)."""
    if not stats:
        return [], 1.0
    steps = len(stats[0].correct)
    run_hits = [0] * steps
    counted = 0
    for s in stats:
        alive = s.valid[-1].clone()
        counted += int(alive.sum())
        for j in range(steps):
            alive = alive & s.correct[j]
            run_hits[j] += int(alive.sum())
    if counted == 0:
        return [0.0] * steps, 1.0
    p_all = [h / counted for h in run_hits]
    cond = [p_all[0]] + [p_all[j] / p_all[j - 1] if p_all[j - 1] else 0.0 for j in range(1, steps)]
    return cond, 1.0 + sum(p_all)


@torch.inference_mode()
def evaluate(
    head: EagleHead, feats: SequenceFeatures, readout: Readout, config: EagleTrainConfig
) -> tuple[list[float], float]:
    was_training = head.training
    head.eval()
    device = head.fc.weight.device
    readout = readout.to(device)
    with autocast(config.precision, device):
        stats = [
            unroll(head, collate(feats, range(i, min(i + 8, len(feats))), device), readout, config)
            for i in range(0, len(feats), 8)
        ]
    head.train(was_training)
    return chain_acceptance(stats)


def build_head(
    loaded: LoadedModel, config: EagleTrainConfig, train_recs: Sequence[Record]
) -> EagleHead:
    cfg = loaded.model.config
    vocab = int(cfg.vocab_size)
    reduced = config.variant == "eagle3" and 0 < config.draft_vocab < vocab
    ec = EagleConfig(
        variant=config.variant,
        layer=layer_config_from(cfg),
        vocab_size=vocab,
        target_hidden_size=int(cfg.hidden_size),
        aux_layers=feature_layers(config, int(cfg.num_hidden_layers)),
        draft_vocab_size=config.draft_vocab if reduced else None,
        target=loaded.identity(),
        speculative_tokens=config.speculative_tokens,
        fc_bias=config.variant == "eagle1",
    )
    # built on the CPU from copies whatever the target's device; the trainer moves it
    emb = cast(torch.Tensor, loaded.model.get_input_embeddings().weight).detach().cpu()
    lm_head = dense_weight(loaded.model.get_output_embeddings()).cpu()
    head = EagleHead(ec, emb, lm_head)
    if reduced:
        head.set_vocabulary(draft_vocabulary(train_recs, config.draft_vocab, vocab).sort().values)
    norm = getattr(getattr(getattr(loaded.model, "model", None), "norm", None), "weight", None)
    head.init_from_target(None if norm is None else norm.detach().cpu(), lm_head)
    return head


def warm_start_head(
    loaded: LoadedModel, config: EagleTrainConfig, path: str | os.PathLike[str]
) -> EagleHead:
    """The drafter in ``path`` to continue training, refused where the run's settings would
    train it on other inputs (another variant, other feature layers) or another vocabulary."""
    from specdec.heads.eagle_io import load_eagle

    head = load_eagle(path, loaded)
    ec = head.config
    n_layers = int(loaded.model.config.num_hidden_layers)
    if ec.variant != config.variant:
        raise ConfigError(
            f"--init {path} is an {ec.variant} drafter; pass --variant {ec.variant} to continue it"
        )
    wanted = feature_layers(config, n_layers)
    if tuple(ec.aux_layers) != wanted:
        raise ConfigError(
            f"--init {path} reads target layers {tuple(ec.aux_layers)}, this run extracts "
            f"{wanted}; pass --aux-layers {','.join(map(str, ec.aux_layers))}"
        )
    if ec.variant == "eagle3":
        size = ec.draft_vocab_size or 0
        asked = config.draft_vocab if config.draft_vocab < ec.vocab_size else 0
        if size != asked:
            raise ConfigError(
                f"--init {path} drafts over {size or 'all'} tokens and keeps that vocabulary; "
                f"pass --draft-vocab {size} (got {config.draft_vocab})"
            )
    return head


class _EagleTask(TrainTask):
    """The training-time-test unroll on cached features; held-out chain acceptance."""

    def __init__(
        self,
        head: EagleHead,
        train: SequenceFeatures,
        held: SequenceFeatures,
        readout: Readout,
        config: EagleTrainConfig,
        accel: Any,
    ) -> None:
        self.module = self.head = head
        self.train, self.held, self.readout, self.config = train, held, readout, config
        self.accel = accel
        self.device = accel.device

    def loss(self, batch: list[int]) -> StepOutput:
        # each data-parallel process takes its own share of the batch
        share = batch[self.accel.process_index :: self.accel.num_processes] or batch
        feats = collate(self.train, share, self.device)
        with autocast(self.config.precision, self.device):
            stats = unroll(self.head, feats, self.readout.to(self.device), self.config)
        return StepOutput(stats.loss, {"loss": float(stats.loss.detach())})

    def evaluate(self, step: int, last: dict[str, float]) -> Evaluation:
        acc, tau = evaluate(self.head, self.held, self.readout, self.config)
        per = " ".join(f"{a:.3f}" for a in acc)
        figures = {
            **last,
            "simulated_tau": tau,
            **{f"acc_step{j + 1}": a for j, a in enumerate(acc)},
        }
        loss = f"loss {last['loss']:.3f}, " if "loss" in last else ""
        return Evaluation(figures, f"step {step}: {loss}held-out τ {tau:.2f} (per step {per})")


def train_eagle(
    loaded: LoadedModel,
    data: SelfDistilledData,
    out_dir: str | os.PathLike[str],
    config: EagleTrainConfig = EagleTrainConfig(),
    *,
    resume: bool = False,
    progress: ProgressFactory = NullBar,
    verifier_name: str | None = None,
    held_out_records: Sequence[Record] | None = None,
    feature_cache: str | os.PathLike[str] | None = None,
) -> EagleTrainResult:
    """Train an EAGLE drafter for ``loaded`` on ``data``; save it in the speculators format.

    ``held_out_records``: see :meth:`SelfDistilledData.split_for_training`.  ``feature_cache``:
    one features cache for runs that share data (default: ``features-train`` and
    ``features-heldout`` next to the checkpoint); it keeps every answer it has seen, so the runs
    of a learning curve pay for one extraction."""
    from accelerate import Accelerator

    from specdec.heads.eagle_io import save_eagle

    started = time.perf_counter()
    data.check_target(loaded)
    # a drafter to continue is checked before the target passes, not after an hour of them
    start = warm_start_head(loaded, config, config.init_from) if config.init_from else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    accel = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(config.seed)
    train_recs, eval_recs = data.split_for_training(config.held_out, config.seed, held_out_records)
    shared = Path(feature_cache) if feature_cache is not None else None
    t0 = time.perf_counter()
    with accel.main_process_first():
        train = extract_sequence_features(
            loaded, train_recs, config, shared or out / "features-train", progress
        )
        held = (
            extract_sequence_features(
                loaded,
                eval_recs,
                config,
                shared or out / "features-heldout",
                progress,
                "held-out features",
            )
            if eval_recs
            else train
        )
    feature_seconds = time.perf_counter() - t0
    head = start or build_head(loaded, config, train_recs)
    readout = readout_for(head, config, train_recs)
    to_draft = readout.to_draft
    labels = torch.cat([t[f + 1 :] for t, f in zip(train.tokens, train.first_label, strict=True)])
    coverage = float((to_draft[labels] >= 0).float().mean()) if len(labels) else 0.0
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    store = CheckpointStore(
        out, run_identity("eagle", loaded, data, config, held_out=held_out_records)
    )
    prepared, opt = accel.prepare(head, opt)
    core: EagleHead = accel.unwrap_model(prepared)
    run = train_epochs(
        _EagleTask(core, train, held, readout, config, accel), opt, store, config,
        examples=len(train), batch=config.batch_sequences, desc=f"training {config.variant}",
        eval_every=config.eval_every, grad_clip=1.0, resume=resume, progress=progress,
        accelerator=accel, initial_eval=config.init_from is not None,
    )  # fmt: skip
    step, history = run.state.step, run.state.history
    acc, tau = evaluate(core, held, readout, config)
    seconds = time.perf_counter() - started
    if accel.is_main_process:
        save_eagle(
            core,
            out,
            verifier_name_or_path=verifier_name or default_verifier_name(loaded),
            verifier_architectures=list(
                getattr(loaded.model.config, "architectures", None) or [type(loaded.model).__name__]
            ),
            extra={
                "training": {
                    "data": str(Path(data.manifest.prompts_file).name),
                    **data.selection,
                    "records": len(data.records),
                    "train_positions": train.positions,
                    "held_out_positions": held.positions,
                    "steps": step,
                    "config": asdict(config),
                    "draft_vocab_coverage": round(coverage, 4),
                    "held_out_step_accuracy": [round(a, 4) for a in acc],
                    "held_out_simulated_tau": round(tau, 3),
                    **(
                        {"held_out_simulated_tau_at_start": round(history[0]["simulated_tau"], 3)}
                        if config.init_from and history and "simulated_tau" in history[0]
                        else {}
                    ),
                    "seconds": round(seconds, 1),
                }
            },
        )
        store.discard()
    return EagleTrainResult(
        out_dir=out,
        steps=step,
        train_positions=train.positions,
        held_out_positions=held.positions,
        draft_vocab_coverage=coverage,
        step_accuracy=acc,
        simulated_tau=tau,
        seconds=seconds,
        feature_seconds=feature_seconds,
        history=history,
    )


def default_verifier_name(loaded: LoadedModel) -> str:
    """What the exported config names as the verifier: the Hub id for the bundled model (its
    GGUF path means nothing to a vLLM server elsewhere), else the path it was loaded from."""
    if Path(str(loaded.source)).name == DEFAULT_GGUF_NAME:
        return DEFAULT_MODEL_HUB_ID
    return str(loaded.source)
