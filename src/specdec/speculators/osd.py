"""Online speculative decoding (OSD, Liu et al. 2023, arXiv 2310.07177): Medusa heads that keep
learning from the traffic the engine serves.

Every verification pass already computes the target's final hidden state at each committed
position, and the committed tokens are the target's own output (greedy: its argmax). So each
committed position t yields a training example for free: hidden state h_t -> the tokens at
t+2 .. t+1+K, what Medusa head k must predict. :class:`OnlineMedusaSpeculator` collects these
examples (from every step, whichever speculator drafted it) into a bounded buffer of recent
traffic; a background thread trains a private copy of the heads on it and publishes a new,
never again modified, copy every ``publish_every`` optimiser steps. ``propose`` reads the
published heads once per step, so a step never mixes weights, and the swap never blocks
decoding (one reference assignment). The adapted state (heads, optimiser-free) is saved to and
restored from a directory in the Medusa checkpoint format.

The tree adapts with the heads. A calibrated topology is only as good as the accuracies it was
built from, and the checkpoint's were measured on its training domain: on new traffic the static
tree is too bushy where the heads are poor and too shallow once they have learnt it. So the
trainer measures the heads' per-rank accuracy on each batch of new traffic *before* training on
it (an honest held-out estimate, decayed over ``accuracy_window`` examples and starting from the
checkpoint's figures), and each publication carries the tree rebuilt from those accuracies by the
same sizing rule the static heads used (``calibrated`` / ``calibrated:N``; a preset or file
topology stays fixed). The saved state records the accuracies, so a restored learner starts
from the tree it had.

Lossless: the heads only propose; the target verifies every draft as for static Medusa.
Guardrail: under ``auto`` with both static Medusa heads and this speculator, the
controller does not choose it while its first-position acceptance is below the static one's.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import os
import random
import shutil
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from specdec.errors import CheckpointError, ConfigError
from specdec.heads.medusa import IGNORE, MedusaHeads, load_medusa
from specdec.speculators.base import DraftContext, Speculator
from specdec.speculators.medusa import (
    MedusaSpeculator,
    Sizer,
    check_heads_fit,
    resolve_topology,
    sized_per_step,
    topology_sizer,
)
from specdec.speculators.spec import SpeculatorOptions, option, register
from specdec.target import LoadedModel
from specdec.tree import DraftTree
from specdec.tree.topology import Topology, generic_profile


@dataclass(frozen=True)
class OnlineConfig:
    """``buffer``: examples kept (oldest dropped); ``batch``: examples per optimiser step;
    ``min_examples``: wait for this many before the first step; ``steps_per_round``: optimiser
    steps per new batch of traffic, so training follows the traffic instead of spinning on a
    stale buffer; ``publish_every``: optimiser steps between swaps; ``warmup``: steps over which
    the learning rate ramps up to ``lr``; ``accuracy_window``: examples over which the measured
    head accuracies (which size the tree) are averaged, older ones weighing exponentially less;
    ``accuracy_prior``: how many examples the checkpoint's own accuracies count as at the start.

    Defaults from replaying self-distilled traffic through the trainer (chat-trained heads, then
    translation and code answers; experiments/medusa/2026-11-30-osd-shift.md): lr 1e-3 with 8
    steps per round learned the new domains fastest, and the warm-up keeps Adam's first,
    ~lr-sized steps from lowering in-domain acceptance on the first requests."""

    buffer: int = 8192
    batch: int = 64
    lr: float = 1e-3
    min_examples: int = 64
    steps_per_round: int = 8
    publish_every: int = 4
    head_decay: float = 0.8
    warmup: int = 200
    accuracy_window: int = 2048
    accuracy_prior: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.buffer, self.batch, self.min_examples, self.steps_per_round) < 1:
            raise ConfigError("online training needs positive buffer, batch, steps and minimum")
        if self.publish_every < 1 or not self.lr > 0 or self.warmup < 0:
            raise ConfigError("online training needs publish_every >= 1, lr > 0, warmup >= 0")
        if self.accuracy_window < 1 or self.accuracy_prior < 0:
            raise ConfigError("online training needs accuracy_window >= 1 and accuracy_prior >= 0")


@dataclass(frozen=True)
class Published:
    """One immutable set of weights, the tree to draft with them (None: the speculator's fixed
    topology) and its version (0 = the initial heads)."""

    version: int
    heads: MedusaHeads
    topology: Topology | None = None


class OnlineTrainer:
    """The bounded buffer and the background thread that distils it into the heads."""

    def __init__(
        self, heads: MedusaHeads, config: OnlineConfig, sizer: Sizer | None = None
    ) -> None:
        self.config = config
        self.sizer = sizer
        self._shadow = copy.deepcopy(heads).train()
        for p in self._shadow.parameters():
            p.requires_grad_(True)
        self._opt = torch.optim.AdamW(self._shadow.parameters(), lr=config.lr, weight_decay=0.0)
        # the offline trainers' schedule family: Adam's first steps move every weight by ~lr,
        # so ease them in, then hold the rate (online training has no end to decay towards)
        from specdec.heads.optim import Schedule

        self._schedule = Schedule(config.warmup, "constant")
        k = heads.config.num_heads
        self.num_heads = k
        self._weights = torch.tensor([config.head_decay**i for i in range(k)])  # [K]
        # accuracy counts [K, R]: the checkpoint's figures as accuracy_prior pseudo-examples
        prior = [list(row) for row in heads.config.accuracy[:k]]
        if len(prior) < k or not all(prior):
            prior = [list(row) for row in generic_profile()[:k]]
        ranks = max(len(row) for row in prior)
        prior_t = torch.zeros(k, ranks)
        for d, row in enumerate(prior):
            prior_t[d, : len(row)] = torch.tensor(row[:ranks], dtype=torch.float32)
        self._hits = prior_t * config.accuracy_prior  # [K, R]
        self._counted = torch.full((k,), float(config.accuracy_prior))  # [K]
        self.measured = 0  # examples whose accuracy was measured
        self.published = Published(0, _frozen_copy(heads))  # drafts with the given topology
        self._buffer: deque[tuple[torch.Tensor, torch.Tensor]] = deque(maxlen=config.buffer)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._new = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self._rng = random.Random(config.seed)
        self.steps = 0
        self.last_loss: float | None = None

    @property
    def examples(self) -> int:
        with self._lock:
            return len(self._buffer)

    def add(self, hidden: torch.Tensor, labels: torch.Tensor) -> None:
        """Queue examples: hidden [B, H], labels [B, K] target ids (IGNORE where unknown)."""
        with self._wake:
            for h, y in zip(hidden, labels, strict=True):
                self._buffer.append((h, y))
            self._new += len(hidden)
            self._wake.notify()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="osd-trainer", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._stop = False

    def train_round(self) -> bool:
        """Run ``steps_per_round`` optimiser steps if enough new traffic arrived; publishes as
        configured. Returns whether it trained. (The thread calls it; tests may too.)"""
        from specdec.heads.optim import optimizer_step  # the offline trainers' step, too

        cfg = self.config
        with self._lock:
            if len(self._buffer) < cfg.min_examples or self._new < cfg.batch:
                return False
            fresh = list(itertools.islice(reversed(self._buffer), self._new))
            self._new = 0
            pool = list(self._buffer)
        self._measure(fresh)
        for _ in range(cfg.steps_per_round):
            batch = self._rng.sample(pool, min(cfg.batch, len(pool)))
            h = torch.stack([b[0] for b in batch]).float()  # [B, H]
            y = torch.stack([b[1] for b in batch])  # [B, K]
            lr = cfg.lr * self._schedule.factor(self.steps)
            with torch.enable_grad():
                loss = self._shadow.loss(h, y, self._weights)
                optimizer_step(self._opt, loss, lr)
            self.last_loss = float(loss.detach())
            self.steps += 1
            if self.steps % cfg.publish_every == 0:
                self.publish()
        return True

    def _measure(self, fresh: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Count how often each head's rank-r candidate was right (after a right chain, as
        trees need: ``candidate_hits``) on traffic it has not been trained on yet, decaying
        older counts over ``accuracy_window`` examples."""
        if not fresh:
            return
        h = torch.stack([b[0] for b in fresh])  # [B, H]
        y = torch.stack([b[1] for b in fresh])  # [B, K]
        match, _, chained = self._shadow.rank_hits(h, y, self._hits.shape[1])
        decay = math.exp(-len(fresh) / self.config.accuracy_window)
        self._hits = self._hits * decay + (match & chained[..., None]).sum(0).float()
        self._counted = self._counted * decay + chained.sum(0).float()
        self.measured += len(fresh)

    def accuracy(self) -> list[list[float]]:
        """The current estimate of ``acc[k][r]`` = P(head k's rank-r candidate is right)."""
        acc: list[list[float]] = (self._hits / self._counted.clamp_min(1e-9)[:, None]).tolist()
        return acc

    def publish(self) -> None:
        """Swap in a copy of the trained weights, their measured accuracies and the tree sized
        from them: one reference assignment, so a reader holds either the old set or the new
        one, never a mixture."""
        heads = _frozen_copy(self._shadow)
        accuracy = self.accuracy()
        heads.config = dataclasses.replace(heads.config, accuracy=accuracy)
        topology = None if self.sizer is None else self.sizer(accuracy)
        self.published = Published(self.published.version + 1, heads, topology)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stop and self._new < self.config.batch:
                    self._wake.wait()
                if self._stop:
                    return
            self.train_round()


def _frozen_copy(heads: MedusaHeads) -> MedusaHeads:
    out = copy.deepcopy(heads).eval()
    for p in out.parameters():
        p.requires_grad_(False)
    return out


class OnlineMedusaSpeculator(Speculator):
    """Medusa drafting from heads that a background thread keeps distilling (module doc)."""

    name: ClassVar[str] = "osd"
    needs_hidden_states: ClassVar[bool] = True
    drafts_trees: ClassVar[bool] = True
    watches: ClassVar[bool] = True  # every committed step is a training example

    def __init__(
        self,
        heads: MedusaHeads,
        topology: Topology,
        config: OnlineConfig | None = None,
        *,
        state_dir: str | os.PathLike[str] | None = None,
        background: bool = True,
        sizer: Sizer | None = None,
        sized: bool = False,
    ) -> None:
        """``topology``: the tree until the first publication, and always when ``sizer`` is None;
        ``sizer``: rebuilds the tree from measured accuracies at each publication; ``sized``:
        each step drafts the prefix of the current tree that pays at the context's costs."""
        self.trainer = OnlineTrainer(heads, config or OnlineConfig(), sizer)
        self.topology = topology
        self.sized = sized
        self._drafter: tuple[int, MedusaSpeculator] | None = None  # per published version
        self.state_dir = None if state_dir is None else Path(state_dir)
        self.background = background
        self._pending: list[tuple[int, torch.Tensor]] = []  # (position, hidden [H]) awaiting labels
        self._next = 0  # first position of this request whose hidden state is not collected
        self.versions_used: list[int] = []  # the weight version each proposal used (for tests)
        if background:
            self.trainer.start()

    @property
    def version(self) -> int:
        return self.trainer.published.version

    def reset(self) -> None:
        self._pending = []
        self._next = 0

    # -- learning from traffic --------------------------------------------------------------------
    def watch(self, context: DraftContext) -> None:
        """Collect this step's examples; called every step, whichever speculator drafts (and
        again by ``propose``: positions already collected are skipped).

        ``context.features`` row j is the hidden state at the position that produced committed
        token ``len(tokens) - M + j`` (M rows); that state's labels are the K tokens after the
        one it produced, known once they are committed. Only states whose labels are the
        target's output (not the user's prompt) are kept."""
        tokens, feats = context.tokens, context.features
        if len(tokens) < self._next:  # a new request without reset()
            self.reset()
        if feats is not None and len(feats):
            first = len(tokens) - len(feats) - 1  # position of row 0
            start = max(self._next, context.prompt_len - 1, first)
            if start < len(tokens) - 1:
                with torch.inference_mode(False):  # the trainer needs ordinary tensors
                    rows = feats[start - first :].detach().float().clone()  # [R, H]
                self._pending.extend((start + i, rows[i]) for i in range(len(rows)))
                self._next = len(tokens) - 1
        self._emit(tokens, final=False)

    def _emit(self, tokens: Sequence[int], final: bool) -> None:
        k = self.trainer.num_heads
        ready = [(p, h) for p, h in self._pending if final or p + 1 + k < len(tokens)]
        if not ready:
            return
        self._pending = [(p, h) for p, h in self._pending if not (final or p + 1 + k < len(tokens))]
        hidden = torch.stack([h for _, h in ready])  # [B, H]
        labels = torch.full((len(ready), k), IGNORE, dtype=torch.long)  # [B, K]
        for i, (p, _) in enumerate(ready):
            future = tokens[p + 2 : p + 2 + k]
            labels[i, : len(future)] = torch.tensor(future, dtype=torch.long)
        self.trainer.add(hidden, labels)

    def end_request(self, tokens: list[int], prompt_len: int) -> None:
        self._emit(tokens, final=True)
        if self.state_dir is not None:
            self.save(self.state_dir)

    # -- drafting ---------------------------------------------------------------------------------
    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        self.watch(context)
        snapshot = self.trainer.published  # read once: one set of weights for the whole step
        self.versions_used.append(snapshot.version)
        del self.versions_used[:-1024]
        return self._drafter_for(snapshot).propose(context, budget)

    def _drafter_for(self, snapshot: Published) -> MedusaSpeculator:
        if self._drafter is None or self._drafter[0] != snapshot.version:
            topology = snapshot.topology or self.topology
            self._drafter = (
                snapshot.version,
                MedusaSpeculator(snapshot.heads, topology, sized=self.sized),
            )
        return self._drafter[1]

    @property
    def current_topology(self) -> Topology:
        """The tree the next proposal drafts with (at the prior costs when sized per step)."""
        return self._drafter_for(self.trainer.published).current_topology()

    # -- state ------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the published heads as a Medusa checkpoint, replacing ``path`` whole (a crash
        leaves the old or the new state, and a leftover ``.new`` directory)."""
        out = Path(path)
        tmp = out.with_name(out.name + ".new")
        shutil.rmtree(tmp, ignore_errors=True)
        snap = self.trainer.published
        snap.heads.save(tmp, extra={"online": {"version": snap.version}})
        old = out.with_name(out.name + ".old")
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        self.trainer.stop()


@dataclass(frozen=True, kw_only=True)
class OsdOptions(SpeculatorOptions):
    primary = "heads"
    heads: str | None = option(None, help="trained Medusa heads to start from")
    state: str | None = option(
        None, help="directory the adapted heads are kept in (and restarted from)"
    )
    tree: str | None = option(None, help="tree topology, as medusa's tree option")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.heads is None and self.state is None:
            raise ConfigError(
                "osd starts from trained Medusa heads: write osd:heads=DIR (and state=DIR to "
                "keep the adapted heads across restarts)"
            )


def initial_heads(options: OsdOptions, target: LoadedModel) -> MedusaHeads:
    """A saved adapted state (``options.state``) when there is one, else the static heads."""
    state = Path(options.state) if options.state else None
    if state is not None and state.is_dir():
        heads = load_medusa(state)
    elif options.heads:
        heads = load_medusa(options.heads)
    else:
        raise ConfigError(
            f"osd: the state directory {state} does not exist yet and no heads=DIR was given to "
            "start from"
        )
    try:
        check_heads_fit(heads, target)
    except CheckpointError as e:
        raise CheckpointError(f"{e} (online heads {state or options.heads})") from None
    return heads


@register("osd", OsdOptions)
def _build(target: LoadedModel, options: OsdOptions) -> OnlineMedusaSpeculator:
    """online distillation: Medusa heads that keep learning from the traffic served"""
    heads = initial_heads(options, target)
    return OnlineMedusaSpeculator(
        heads,
        resolve_topology(options.tree, heads),
        state_dir=options.state,
        sizer=topology_sizer(options.tree),
        sized=sized_per_step(options.tree),
    )
