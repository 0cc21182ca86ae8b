"""A request's state inside the decoding loop, and one step's proposal before verification.

Both the single-request loop (:class:`specdec.engine.SpeculativeEngine`) and the batch
scheduler (:class:`specdec.batch.BatchScheduler`) hold these; :class:`specdec.decode.Decoder`
builds and advances them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.config import GenerationConfig
from specdec.control.budget import AdaptiveBudget, CostModel, FixedBudget, NodeBudget
from specdec.grammar import GrammarConstraint
from specdec.grammar.constraint import ConstrainedTree
from specdec.logprobs import TokenLogprob
from specdec.metrics import RequestStats
from specdec.speculators import NoSpeculator, Speculator
from specdec.speculators.auto import ArmController
from specdec.tree import DraftTree
from specdec.verify import AcceptanceRule

Budget = AdaptiveBudget | FixedBudget | NodeBudget


@dataclass
class RequestState:
    """Mutable state of one request: its tokens so far, settings, drafter and statistics.

    ``speculator`` / ``arms`` is who drafts for it: the decoder's own, or a fork of it when
    the batch scheduler decodes several requests at once (each keeps its own drafter state).
    """

    tokens: list[int]  # prompt + committed output; the last one is the next tree's root
    prompt_len: int
    config: GenerationConfig
    plain: bool  # speculate=False: plain decoding through the same loop
    rule: AcceptanceRule
    generator: torch.Generator
    budget: Budget
    costs: CostModel  # what tree speculators price verification with (see DraftContext)
    started: float  # time.perf_counter() when the request arrived
    stats: RequestStats = field(default_factory=RequestStats)
    constraint: GrammarConstraint | None = None  # the request's grammar (specdec.grammar)
    logprobs: int | None = None  # None: off; n: each token's log-prob and the top n
    step_logprobs: list[TokenLogprob] = field(default_factory=list)  # the last step's
    speculator: Speculator = field(default_factory=NoSpeculator)
    arms: ArmController | None = None

    @property
    def remaining(self) -> int:
        """Tokens the request may still generate."""
        return self.config.max_new_tokens - (len(self.tokens) - self.prompt_len)

    @property
    def drafts(self) -> bool:
        """Whether anything drafts for this request: false for plain decoding, asked for
        (``speculate=False``) or served by a speculator that never drafts (``none``)."""
        return not self.plain and (self.arms is not None or self.speculator.drafts)

    @property
    def speculators(self) -> tuple[Speculator, ...]:
        """Every speculator serving this request (the arms of ``auto``, or the one)."""
        return self.arms.speculators if self.arms is not None else (self.speculator,)


@dataclass
class Proposal:
    """One step's draft before verification: what the speculator proposed, the tree the target
    verifies (the proposal pruned by the request's grammar), and the timings so far."""

    budget: int
    proposed: DraftTree
    tree: DraftTree
    constrained: ConstrainedTree | None
    draft_seconds: float
    grammar_seconds: float
    catch_up_seconds: float
