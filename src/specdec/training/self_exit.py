"""Train a self-speculation exit: an adapter after the target's first L layers.

The target (frozen) is run once per self-distilled sequence; its hidden state after layer L and
its final hidden state (the LM head's input) at response positions are cached next to the
checkpoint (float16). Training then needs only the adapter, the final norm and the LM head: the
loss is the KL divergence from the target's distribution p (recomputed from the cached final
hidden state) to the draft's q over the draft vocabulary (token ids < ``draft_vocab``), i.e. the
cross-entropy with soft targets p restricted to those ids, up to a constant.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.errors import ConfigError, DataError
from specdec.heads.self_exit import PrefixHead, SelfExitAdapter, SelfExitConfig, head_rows
from specdec.target.loading import LoadedModel
from specdec.training.checkpoint import CheckpointStore, check_schedule, run_identity
from specdec.training.data import Record, SelfDistilledData
from specdec.training.feature_cache import fingerprint, load_cached, save_cached
from specdec.training.loop import Evaluation, StepOutput, TrainTask, train_epochs
from specdec.training.progress import NullBar, ProgressFactory


@dataclass(frozen=True)
class SelfExitTrainConfig:
    layer: int = 8
    rank: int = 0  # 0 = full H x H
    draft_vocab: int = 16384  # 0 (or >= the vocabulary size) = the full vocabulary
    epochs: float = 2.0
    max_steps: int | None = None
    lr: float = 2e-3
    batch_positions: int = 256
    held_out: float = 0.05
    checkpoint_every: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        if self.layer < 1:
            raise ConfigError(f"--layer must be >= 1, got {self.layer}")
        if self.rank < 0 or self.draft_vocab < 0:
            raise ConfigError("--rank and --draft-vocab must be >= 0 (0 = full)")
        check_schedule(
            max_steps=self.max_steps,
            epochs=self.epochs,
            lr=self.lr,
            batch=self.batch_positions,
            held_out=self.held_out,
        )


@dataclass
class SelfExitTrainResult:
    out_dir: Path
    steps: int
    train_positions: int
    held_out_positions: int
    agreement: float  # held-out: the draft's argmax equals the target's
    adapter_bytes: int
    seconds: float


@dataclass
class ExitFeatures:
    exit_hidden: torch.Tensor  # [P, H] float16, after layer L
    final_hidden: torch.Tensor  # [P, H] float16, the LM head's input

    def __len__(self) -> int:
        return len(self.exit_hidden)


@torch.inference_mode()
def extract_exit_features(
    loaded: LoadedModel,
    records: Sequence[Record],
    layer: int,
    cache_file: Path | None = None,
    progress: ProgressFactory = NullBar,
    desc: str = "target features",
) -> ExitFeatures:
    """Hidden states after layer ``layer`` and at the end, at the positions that predict the
    response tokens; one target pass per sequence, cached in ``cache_file``."""
    key = fingerprint(records, loaded.identity(), f"layer={layer};")
    cached = load_cached(cache_file, key)
    if cached is not None:
        t, _ = cached
        return ExitFeatures(t["exit_hidden"], t["final_hidden"])
    exit_rows: list[torch.Tensor] = []
    final_rows: list[torch.Tensor] = []
    bar = progress(total=len(records), desc=desc, unit="seq")
    try:
        for r in records:
            n, start = len(r.tokens), max(r.prompt_len - 1, 0)
            bar.update(1)
            if n - start < 2:
                continue
            ids = torch.tensor([r.tokens], dtype=torch.long)  # [1, T]
            out = loaded.model(input_ids=ids, output_hidden_states=True, logits_to_keep=1)
            exit_rows.append(out.hidden_states[layer][0, start : n - 1].to(torch.float16))
            final_rows.append(out.hidden_states[-1][0, start : n - 1].to(torch.float16))
    finally:
        bar.close()
    if not exit_rows:
        raise DataError("no sequence has a response to learn from")
    feats = ExitFeatures(torch.cat(exit_rows), torch.cat(final_rows))
    tensors = {"exit_hidden": feats.exit_hidden, "final_hidden": feats.final_hidden}
    save_cached(cache_file, key, tensors)
    return feats


class _Heads:
    """The target's final norm and LM head (frozen), and the draft's restricted head."""

    def __init__(self, loaded: LoadedModel, draft_vocab: int) -> None:
        model = loaded.model
        self.norm = model.model.norm
        self.lm_head = model.get_output_embeddings()
        vocab = int(model.config.vocab_size)
        self.rows = draft_vocab or vocab
        self.draft_head = PrefixHead(head_rows(model, self.rows), self.rows)  # no -inf padding

    def target_logp(self, final_hidden: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, rows]
        with torch.no_grad():
            logits = self.lm_head(final_hidden.float())  # [B, V]
            return torch.log_softmax(logits.float(), -1)[:, : self.rows]

    def draft_logits(self, adapter: SelfExitAdapter, exit_hidden: torch.Tensor) -> torch.Tensor:
        return self.draft_head(self.norm(adapter(exit_hidden.float())))  # [B, rows]


def kl_loss(target_logp: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum_v p_v log q_v over the draft vocabulary (KL up to a constant).

    >>> p = torch.log_softmax(torch.tensor([[2.0, 0.0]]), -1)
    >>> round(float(kl_loss(p, torch.tensor([[2.0, 0.0]]))), 4)  # entropy of p
    0.3653
    """
    return -(target_logp.exp() * torch.log_softmax(draft_logits, -1)).sum(-1).mean()


@torch.no_grad()
def agreement(
    heads: _Heads, adapter: SelfExitAdapter, feats: ExitFeatures, batch: int = 512
) -> float:
    """Fraction of positions where the draft's argmax is the target's."""
    hit = 0
    for i in range(0, len(feats), batch):
        t = heads.lm_head(feats.final_hidden[i : i + batch].float()).argmax(-1)  # [B]
        d = heads.draft_logits(adapter, feats.exit_hidden[i : i + batch]).argmax(-1)  # [B]
        hit += int((t == d).sum())
    return hit / max(len(feats), 1)


class _SelfExitTask(TrainTask):
    """The adapter against the target's distribution (KL); held-out argmax agreement."""

    def __init__(
        self, adapter: SelfExitAdapter, heads: _Heads, train: ExitFeatures, held: ExitFeatures
    ) -> None:
        self.module = self.adapter = adapter
        self.heads, self.train, self.held = heads, train, held

    def loss(self, batch: list[int]) -> StepOutput:
        idx = torch.tensor(batch)
        loss = kl_loss(
            self.heads.target_logp(self.train.final_hidden[idx]),
            self.heads.draft_logits(self.adapter, self.train.exit_hidden[idx]),
        )
        return StepOutput(loss, {"loss": float(loss.detach())})

    def evaluate(self, step: int, last: dict[str, float]) -> Evaluation:
        self.adapter.eval()
        agree = agreement(self.heads, self.adapter, self.held)
        self.adapter.train()
        message = f"held-out agreement with the target after {step} steps: {agree:.3f}"
        return Evaluation({"agreement": agree}, message)


def train_self_exit(
    loaded: LoadedModel,
    data: SelfDistilledData,
    out_dir: str | os.PathLike[str],
    config: SelfExitTrainConfig = SelfExitTrainConfig(),
    *,
    resume: bool = False,
    progress: ProgressFactory = NullBar,
) -> SelfExitTrainResult:
    """Train an exit adapter after ``config.layer`` layers of ``loaded`` and save it."""
    started = time.perf_counter()
    data.check_target(loaded)
    cfg = loaded.model.config
    total_layers = int(cfg.num_hidden_layers)
    if config.layer >= total_layers:
        raise ConfigError(f"--layer must be < {total_layers} (the target's layer count)")
    vocab = int(cfg.vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    train_recs, eval_recs = data.split(config.held_out, config.seed)
    train = extract_exit_features(
        loaded, train_recs, config.layer, out / "features-train.safetensors", progress
    )
    held = train
    if eval_recs:
        held = extract_exit_features(
            loaded, eval_recs, config.layer, out / "features-heldout.safetensors", progress,
            "held-out features",
        )  # fmt: skip
    econfig = SelfExitConfig(
        layer=config.layer,
        hidden_size=int(cfg.hidden_size),
        vocab_size=vocab,
        rank=config.rank,
        draft_vocab=config.draft_vocab if config.draft_vocab < vocab else 0,
        target=loaded.identity(),
    )
    adapter = SelfExitAdapter(econfig)
    heads = _Heads(loaded, econfig.draft_vocab)
    opt = torch.optim.AdamW(adapter.parameters(), lr=config.lr, weight_decay=0.0)
    store = CheckpointStore(out, run_identity("self-exit", loaded, data, config))
    run = train_epochs(
        _SelfExitTask(adapter, heads, train, held), opt, store, config,
        examples=len(train), batch=config.batch_positions, desc="training self exit",
        resume=resume, progress=progress,
    )  # fmt: skip
    step = run.state.step
    agree = run.state.history[-1]["agreement"]
    adapter.config = SelfExitConfig(**{**asdict(econfig), "agreement": round(agree, 4)})
    seconds = time.perf_counter() - started
    adapter.save(
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
                "seconds": round(seconds, 1),
            }
        },
    )
    store.discard()
    return SelfExitTrainResult(
        out, step, len(train), len(held), agree, adapter.num_bytes(), seconds
    )
