"""Medusa-1 training: frozen target, heads learn the target's own future tokens.

Head k (0-based) at position t is trained to predict token t + k + 2 of the self-distilled
sequence (the target's LM head predicts t + 1), on response positions only: that is the text
the heads will draft at serving time. The target's hidden states are extracted once and cached
next to the checkpoint (float16), so epochs cost only the heads' own compute. Loss weights decay
with the head index (0.8^k, as in the Medusa paper): later heads are less accurate and matter
less, since their nodes are only reached when earlier ones were accepted.

The held-out evaluation measures, per head, the probability that its rank-r candidate is the
right token; the checkpoint stores these figures and ``medusa:DIR,tree=calibrated`` builds the node
budget's best tree from them.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec.errors import ConfigError, DataError
from specdec.heads.medusa import IGNORE, MedusaConfig, MedusaHeads
from specdec.speculators.medusa import best_sized_topology
from specdec.target.loading import LoadedModel
from specdec.target.numerics import dense_weight
from specdec.training.checkpoint import CheckpointStore, check_schedule, run_identity
from specdec.training.data import Record, SelfDistilledData
from specdec.training.feature_cache import features_per_record
from specdec.training.loop import Evaluation, StepOutput, TrainTask, train_epochs
from specdec.training.precision import autocast, check_precision
from specdec.training.progress import NullBar, ProgressFactory
from specdec.tree.topology import Topology, accepted_lengths


@dataclass(frozen=True)
class MedusaTrainConfig:
    num_heads: int = 4
    num_layers: int = 1
    draft_vocab: int = 8192  # 0 = the full vocabulary
    epochs: float = 4.0
    max_steps: int | None = None
    lr: float = 1e-3
    batch_positions: int = 256
    held_out: float = 0.05
    eval_every: int = 200
    checkpoint_every: int = 200
    head_decay: float = 0.8
    # share of each head's loss taken against the target's full distribution (0 = labels only)
    soft_weight: float = 0.0
    seed: int = 0
    precision: str = "auto"  # bf16-mixed | fp32 | auto: bf16 where native (training/precision)
    eval_ranks: int = 10

    def __post_init__(self) -> None:
        check_precision(self.precision)
        if self.num_heads < 1 or self.num_heads > 16:
            raise ConfigError(f"--heads must be in 1..16, got {self.num_heads}")
        if self.num_layers < 0:
            raise ConfigError(f"--layers must be >= 0, got {self.num_layers}")
        if not 0.0 <= self.soft_weight <= 1.0:
            raise ConfigError(f"--soft-weight must be in [0, 1], got {self.soft_weight}")
        if self.draft_vocab < 0:
            raise ConfigError(f"--draft-vocab must be >= 0 (0 = full), got {self.draft_vocab}")
        check_schedule(
            max_steps=self.max_steps,
            epochs=self.epochs,
            lr=self.lr,
            batch=self.batch_positions,
            held_out=self.held_out,
        )


@dataclass
class MedusaTrainResult:
    out_dir: Path
    steps: int
    train_positions: int
    held_out_positions: int
    draft_vocab_coverage: float
    # [K, ranks]: P(rank-r candidate of head k is right | heads before it right at rank 0)
    accuracy: list[list[float]]
    top1: list[float]  # [K]: P(head k's first candidate is right), unconditionally
    # 1 + mean accepted drafts of the cost-sized calibrated tree on held-out positions
    simulated_tau: float
    tree_nodes: int  # that tree's size (what `tree=calibrated` serves at the prior costs)
    seconds: float
    feature_seconds: float
    history: list[dict[str, float]] = field(default_factory=list)


@dataclass
class Features:
    """Target hidden states at response positions and each head's label there."""

    hidden: torch.Tensor  # [P, H] float16
    labels: torch.Tensor  # [P, K] int64 target token ids (IGNORE past the end)
    target_agreement: float  # fraction of positions where the target's argmax is the next token

    def __len__(self) -> int:
        return len(self.labels)


@torch.inference_mode()
def extract_features(
    loaded: LoadedModel,
    records: Sequence[Record],
    num_heads: int,
    cache_file: Path | None = None,
    progress: ProgressFactory = NullBar,
    desc: str = "target features",
) -> Features:
    """One target pass per sequence; cached per answer in ``cache_file``, so data that grew
    since the last training costs passes only for the new answers."""
    model = loaded.model
    device = loaded.device  # the target's device; the features are cached on the CPU

    def one(r: Record) -> dict[str, torch.Tensor] | None:
        n = len(r.tokens)
        start = max(r.prompt_len - 1, 0)
        if n - start < 2:
            return None
        ids = torch.tensor([r.tokens], dtype=torch.long, device=device)  # [1, T]
        out = model(input_ids=ids, output_hidden_states=True, logits_to_keep=n - start)
        h = out.hidden_states[-1][0, start : n - 1].cpu()  # [P, H]
        pred = out.logits[0, : n - 1 - start].argmax(-1).cpu()  # [P]
        tokens = torch.tensor(r.tokens, dtype=torch.long)  # [T]
        pos = torch.arange(start, n - 1)  # [P]
        labels = torch.full((len(pos), num_heads), IGNORE, dtype=torch.long)  # [P, K]
        for k in range(num_heads):
            tgt = pos + k + 2
            ok = tgt < n
            labels[ok, k] = tokens[tgt[ok]]
        agree = int((pred == tokens[start + 1 : n]).sum())
        return {
            "hidden": h.to(torch.float16),
            "labels": labels,
            "agreement": torch.tensor([agree, n - 1 - start], dtype=torch.long),  # [2]
        }

    rows = [
        r
        for r in features_per_record(
            cache_file, records, loaded.identity(), f"medusa:{num_heads}", one, progress, desc
        )
        if r is not None
    ]
    if not rows:
        raise DataError("no sequence has a response to learn from")
    agree, total = torch.stack([r["agreement"] for r in rows]).sum(0).tolist()
    return Features(
        torch.cat([r["hidden"] for r in rows]),
        torch.cat([r["labels"] for r in rows]),
        agree / max(total, 1),
    )


def draft_vocabulary(records: Sequence[Record], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent response tokens (ties by id), most frequent first.

    >>> recs = [Record((9, 1, 2, 2, 3, 2), prompt_len=1, index=0)]
    >>> draft_vocabulary(recs, 2, 10).tolist()
    [2, 1]
    """
    counts: Counter[int] = Counter()
    for r in records:
        counts.update(r.response)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    if len(ranked) < size:  # pad with unseen ids so the head keeps its configured size
        seen = set(ranked)
        ranked += [t for t in range(vocab_size) if t not in seen][: size - len(ranked)]
    return torch.tensor(ranked, dtype=torch.long)


def head_accuracy(
    heads: MedusaHeads, feats: Features, ranks: int, batch: int = 1024
) -> tuple[list[list[float]], list[list[float]]]:
    """``(chained, plain)``, each ``acc[k][r]``: how often head k's rank-r candidate is the
    label (labels outside the draft vocabulary count as misses); ``chained`` counts only
    positions where heads 0..k-1 had their rank-0 candidate right, the figures trees are sized
    from (see ``candidate_hits``), ``plain`` counts every position."""
    k_heads = heads.config.num_heads
    hits = {"chained": torch.zeros(k_heads, ranks), "plain": torch.zeros(k_heads, ranks)}
    counted = {"chained": torch.zeros(k_heads), "plain": torch.zeros(k_heads)}
    for i in range(0, len(feats), batch):
        match, valid, chain = heads.rank_hits(
            feats.hidden[i : i + batch], feats.labels[i : i + batch], ranks
        )
        for key, rows in (("chained", chain), ("plain", valid)):  # rows [B, K]
            hits[key] += (match & rows[..., None]).sum(0).float()
            counted[key] += rows.sum(0).float()
    chained, plain = ((hits[k] / counted[k].clamp_min(1)[:, None]).tolist() for k in hits)
    return chained, plain


def simulated_tau(
    heads: MedusaHeads, feats: Features, topology: Topology, batch: int = 1024
) -> float:
    """Tokens per verification a greedy walk over ``topology`` would commit on these
    positions (1 + mean accepted drafts), counted from the heads' actual candidates: the
    figure a user compares across checkpoints and data sizes without running a benchmark.
    The data's next tokens stand in for the target's, which they are (greedy self-distillation)
    up to ``target_agreement``."""
    ranks = 1 + max(r for path in topology for r in path)
    total = 0
    for i in range(0, len(feats), batch):
        match, _, _ = heads.rank_hits(
            feats.hidden[i : i + batch], feats.labels[i : i + batch], ranks
        )
        total += int(accepted_lengths(topology, match).sum())
    return 1.0 + total / max(len(feats), 1)


@torch.no_grad()
def teacher_probs(
    hidden: torch.Tensor, idx: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor
) -> torch.Tensor:
    """The target's distribution over the draft vocabulary for each head's label: head k's
    label at row i is the token the target predicts at row i + k + 1 (rows of one answer are
    consecutive positions, and a label exists only while that row is in the same answer), and
    the cached final hidden state there times the LM head gives that prediction without
    another target pass. hidden [P, H] (all rows), idx [B], labels [B, K], teacher [V_draft, H];
    returns [B, K, V_draft] (uniform where there is no label; the loss skips those rows)."""
    k_heads = labels.shape[1]
    rows = (idx[:, None] + torch.arange(1, k_heads + 1)).clamp_max(len(hidden) - 1)  # [B, K]
    logits = hidden[rows].to(teacher.device).float() @ teacher.T  # [B, K, V_draft]
    return torch.softmax(logits, dim=-1)


class _MedusaTask(TrainTask):
    """Heads on cached features: loss decayed over the heads, held-out top-1 per head."""

    def __init__(
        self,
        heads: MedusaHeads,
        train: Features,
        held: Features,
        teacher: torch.Tensor | None,
        config: MedusaTrainConfig,
    ) -> None:
        self.module = self.heads = heads
        self.train, self.held, self.teacher = train, held, teacher
        self.soft_weight = config.soft_weight
        self.precision = config.precision
        self.device = next(heads.parameters()).device  # features stay on the CPU
        self.weights = torch.tensor(
            [config.head_decay**k for k in range(config.num_heads)], device=self.device
        )

    def loss(self, batch: list[int]) -> StepOutput:
        idx = torch.tensor(batch)
        h = self.train.hidden[idx].to(self.device).float()  # [B, H]
        labels = self.train.labels[idx].to(self.device)  # [B, K]
        soft = None
        if self.teacher is not None:
            soft = teacher_probs(self.train.hidden, idx, labels, self.teacher)
        with autocast(self.precision, h.device):
            loss = self.heads.loss(h, labels, self.weights, soft, self.soft_weight)
        return StepOutput(loss, {"loss": float(loss.detach())})

    def evaluate(self, step: int, last: dict[str, float]) -> Evaluation:
        self.heads.eval()
        _, acc = head_accuracy(self.heads, self.held, 1)
        self.heads.train()
        shown = " ".join(f"{a[0]:.3f}" for a in acc)
        figures = {**last, **{f"top1_head{k + 1}": a[0] for k, a in enumerate(acc)}}
        loss = f"loss {last['loss']:.3f}, " if "loss" in last else ""
        return Evaluation(figures, f"step {step}: {loss}held-out top-1 per head {shown}")


def train_medusa(
    loaded: LoadedModel,
    data: SelfDistilledData,
    out_dir: str | os.PathLike[str],
    config: MedusaTrainConfig = MedusaTrainConfig(),
    *,
    resume: bool = False,
    progress: ProgressFactory = NullBar,
    held_out_records: Sequence[Record] | None = None,
    feature_cache: str | os.PathLike[str] | None = None,
) -> MedusaTrainResult:
    """Train Medusa-1 heads for ``loaded`` on ``data`` and save them in ``out_dir``.

    ``held_out_records`` fixes the evaluation set (and keeps it out of training) instead of
    splitting off ``config.held_out`` of the data, so checkpoints trained on different amounts
    of data are measured on the same positions. ``feature_cache``: one features file shared by
    runs on the same data (default: next to the checkpoint), as in ``train_eagle``."""
    started = time.perf_counter()
    data.check_target(loaded)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    train_recs, eval_recs = data.split_for_training(config.held_out, config.seed, held_out_records)
    t0 = time.perf_counter()
    shared = Path(feature_cache) if feature_cache is not None else None
    train = extract_features(
        loaded, train_recs, config.num_heads, shared or out / "features-train", progress
    )
    held = (
        extract_features(
            loaded,
            eval_recs,
            config.num_heads,
            shared or out / "features-heldout",
            progress,
            "held-out features",
        )
        if eval_recs
        else train
    )
    feature_seconds = time.perf_counter() - t0
    cfg = loaded.model.config
    vocab = int(cfg.vocab_size)
    token_map = None
    if config.draft_vocab and config.draft_vocab < vocab:
        token_map = draft_vocabulary(train_recs, config.draft_vocab, vocab)
    mconfig = MedusaConfig(
        hidden_size=int(cfg.hidden_size),
        vocab_size=vocab,
        num_heads=config.num_heads,
        num_layers=config.num_layers,
        draft_vocab_size=None if token_map is None else len(token_map),
        target=loaded.identity(),
    )
    heads = MedusaHeads(mconfig, token_map)
    lm_head = dense_weight(loaded.model.get_output_embeddings()).detach().float().cpu()  # [V, H]
    heads.init_from_lm_head(lm_head)
    teacher = None  # [V_draft, H]: the target's readout over the draft vocabulary
    valid = train.labels != IGNORE
    coverage = float((heads.to_draft_ids(train.labels) != IGNORE)[valid].float().mean())
    heads.to(loaded.device)  # the heads train where the target runs (a GPU when it is there)
    if config.soft_weight > 0:
        teacher = (lm_head if token_map is None else lm_head[token_map]).to(loaded.device)
    opt = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=0.0)
    store = CheckpointStore(
        out, run_identity("medusa", loaded, data, config, held_out=held_out_records)
    )
    run = train_epochs(
        _MedusaTask(heads, train, held, teacher, config), opt, store, config,
        examples=len(train), batch=config.batch_positions, desc="training medusa",
        eval_every=config.eval_every, resume=resume, progress=progress,
    )  # fmt: skip
    step, history = run.state.step, run.state.history
    heads.eval()
    accuracy, plain = head_accuracy(heads, held, config.eval_ranks)
    top1 = [row[0] for row in plain]
    heads.config = MedusaConfig(**{**asdict(mconfig), "accuracy": accuracy})
    # heads right nowhere on held-out data (too little training) get no tree, not a crash
    tree = best_sized_topology(accuracy) if any(a > 0 for row in accuracy for a in row) else ()
    tau = simulated_tau(heads, held, tree) if tree else 1.0
    seconds = time.perf_counter() - started
    heads.save(
        out,
        extra={
            "training": {
                "data": str(Path(data.manifest.prompts_file).name),
                **data.selection,
                "records": len(data.records),
                "train_positions": len(train),
                "held_out_positions": len(held),
                "steps": step,
                "config": asdict(config),
                "held_out_top1": [round(a, 4) for a in top1],
                "held_out_simulated_tau": round(tau, 4),
                "calibrated_tree_nodes": len(tree),
                "draft_vocab_coverage": round(coverage, 4),
                "target_agreement_on_data": round(train.target_agreement, 4),
                "seconds": round(seconds, 1),
            }
        },
    )
    store.discard()
    return MedusaTrainResult(
        out_dir=out,
        steps=step,
        train_positions=len(train),
        held_out_positions=len(held),
        draft_vocab_coverage=coverage,
        accuracy=accuracy,
        top1=top1,
        simulated_tau=tau,
        tree_nodes=len(tree),
        seconds=seconds,
        feature_seconds=feature_seconds,
        history=history,
    )
