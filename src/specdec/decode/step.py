"""The decoding step, in public phases that the single-request loop and the batch scheduler
both drive: propose (draft, then prune by the grammar), verify (the caller's target pass),
accept, commit (the caller's cache), settle (grammar, log-probs, learning, statistics).

:meth:`Decoder.step` runs them in that order for one request on its own target; the batch
scheduler runs propose and accept/settle per request around one pass shared by all."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from specdec.config import GenerationConfig
from specdec.control.budget import AdaptiveBudget, CostModel, FixedBudget, NodeBudget
from specdec.control.calibration import calibrate_on_first_use, load_cost_calibration
from specdec.decode.emitter import Emitter
from specdec.decode.state import Budget, Proposal, RequestState
from specdec.drafting import DraftContext, Feedback
from specdec.errors import ConfigError, InvalidRequestError
from specdec.grammar import Grammar, GrammarCompiler, GrammarConstraint
from specdec.logprobs import token_logprobs
from specdec.request import Prompt, check_fits, encode_prompt
from specdec.speculators import NoSpeculator, Speculator
from specdec.speculators.auto import ArmController
from specdec.target import HFTarget, LoadedModel, Target
from specdec.tree import DraftTree
from specdec.verify import Acceptance, AcceptanceRule, make_generator, rule_for


def initial_costs(loaded: LoadedModel | None, speculating: bool) -> CostModel:
    """The saved calibration's ratios as the prior when there is one (measured now, on first
    use, for a model that should have one: :func:`calibrate_on_first_use`), else the generic
    one. Plain decoding prices nothing, so a decoder that never drafts measures nothing."""
    if loaded is None:
        calibration = None
    elif speculating:
        calibration = calibrate_on_first_use(loaded)
    else:
        calibration = load_cost_calibration(loaded)
    if calibration is None:
        return CostModel()
    return CostModel.calibrated(calibration.ratios(tree=False), calibration.ratios(tree=True))


DEFAULT_NUM_DRAFT_TOKENS = 5  # K when none is given: the adaptive budget's longest draft


class Decoder:
    """One target, who drafts for it, and the phases of a speculative step.

    Who drafts is decided in the step: one ``speculator`` with the budget policy that sizes its
    drafts, or an :class:`~specdec.speculators.auto.ArmController` (``arms``) choosing among
    several speculators per step. The verification costs it measures (``cost_model``) are
    shared by every request it serves.
    """

    def __init__(
        self,
        target: Target,
        tokenizer: PreTrainedTokenizerBase,
        speculator: Speculator | None = None,
        *,
        arms: ArmController | None = None,
        num_draft_tokens: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        loaded: LoadedModel | None = None,
        acceptance_rule: AcceptanceRule | None = None,
        adaptive: bool = True,
    ) -> None:
        """``adaptive`` drafts, per step, the length (up to K) that maximises expected tokens
        per second from measured acceptance and verification cost, drafting nothing when that
        does not pay; ``adaptive=False`` always drafts K. ``acceptance_rule`` overrides the
        lossless default (greedy match / rejection sampling, chosen per request); only opt-in
        lossy rules or tests pass one. ``num_draft_tokens`` (K) given caps every draft,
        a self-stopping chain's too; ``None`` is :data:`DEFAULT_NUM_DRAFT_TOKENS` for the
        adaptive budget and leaves a self-stopping chain its own cap."""
        if speculator is not None and arms is not None:
            raise ConfigError("give the engine one speculator or an arm controller, not both")
        self.caps_chains = num_draft_tokens is not None  # K was asked for: it caps chains too
        if num_draft_tokens is None:
            num_draft_tokens = DEFAULT_NUM_DRAFT_TOKENS
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int):
            raise ConfigError(f"num_draft_tokens (K) must be an integer, got {num_draft_tokens!r}")
        if num_draft_tokens < 1:
            raise ConfigError(f"num_draft_tokens (K) must be >= 1, got {num_draft_tokens}")
        self.target = target
        self.acceptance_rule = acceptance_rule
        self.tokenizer = tokenizer
        self.arms = arms
        self.speculator: Speculator = speculator or NoSpeculator()
        # every speculator the decoder serves: reset, end_request and features reach all of them
        self.speculators: tuple[Speculator, ...] = (
            arms.speculators if arms is not None else (self.speculator,)
        )
        self.num_draft_tokens = num_draft_tokens
        self.adaptive = adaptive
        # T(n) measured on this machine, shared by requests; from `specdec calibrate cost`
        self.cost_model = initial_costs(loaded, arms is not None or self.speculator.drafts)
        self._cost_prior = self.cost_model.frozen_prior()  # for sampled requests
        self.loaded = loaded
        self._grammar_compiler: GrammarCompiler | None = None  # built by the first grammar
        if eos_token_ids is not None:
            self.eos_token_ids = frozenset(eos_token_ids)
        elif loaded is not None:
            self.eos_token_ids = loaded.eos_token_ids
        else:
            eos = tokenizer.eos_token_id
            self.eos_token_ids = frozenset() if eos is None else frozenset({int(eos)})
        if arms is not None:  # the controller prices drafts with the decoder's measured costs
            arms.bind_costs(self.cost_model)
        if self.reads_features:
            readers = [s for s in self.speculators if s.needs_hidden_states]
            if not target.provides_features:
                raise ConfigError(
                    f"the {readers[0].name} speculator reads the target's hidden states, "
                    f"which {type(target).__name__} does not provide"
                )
            target.enable_features(self.feature_layers)

    # -- what it serves ---------------------------------------------------------------------------
    @property
    def method(self) -> str:
        """The speculation method's name (``auto`` for an arm controller)."""
        return "auto" if self.arms is not None else self.speculator.name

    @property
    def context_length(self) -> int:
        return self.target.context_length

    @property
    def reads_features(self) -> bool:
        """Whether a speculator it serves drafts from the target's hidden states."""
        return any(s.needs_hidden_states for s in self.speculators)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose hidden states its speculators read."""
        return self.arms.feature_layers if self.arms else self.speculator.feature_layers

    @property
    def batchable(self) -> bool:
        """Whether :class:`specdec.batch.BatchScheduler` can drive this decoder: its backend
        batches, and the verifier is the torch module the batch target shares."""
        backend_batches = self.loaded is None or self.loaded.backend.batching
        return backend_batches and isinstance(self.target, HFTarget)

    def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat)

    # -- requests -------------------------------------------------------------------------------
    def new_request(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig,
        *,
        speculate: bool = True,
        grammar: Grammar | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
        fork: bool = False,
    ) -> RequestState:
        """A validated request (bad arguments raise here, before any work). ``fork``: with
        its own speculator instances, for batched decoding (each sequence keeps its own
        drafter state)."""
        check_fits(len(prompt_ids), config.max_new_tokens, self.context_length)
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int):
            raise InvalidRequestError("top_logprobs must be an integer", param="top_logprobs")
        if not 0 <= top_logprobs <= 20:
            raise InvalidRequestError(
                f"top_logprobs must be in [0, 20], got {top_logprobs}", param="top_logprobs"
            )
        constraint = self._constraint(grammar, config)
        started = time.perf_counter()
        speculator, arms = self.speculator, self.arms
        if fork and speculate:
            if arms is not None:
                arms = arms.fork()
            else:
                speculator = speculator.fork()
        req = RequestState(
            tokens=list(prompt_ids),
            prompt_len=len(prompt_ids),
            config=config,
            plain=not speculate,
            rule=self.acceptance_rule or rule_for(config.sampling),
            # on the target's device, where the probabilities are (fakes: the CPU)
            generator=make_generator(config.sampling.seed, self.target.device),
            budget=self.budget_policy(config),
            # sampled output depends on the drafts, so their sizing must not depend on timing
            costs=self.cost_model if config.sampling.greedy else self._cost_prior,
            started=started,
            constraint=constraint,
            logprobs=top_logprobs if logprobs else None,
            speculator=speculator,
            arms=arms,
        )
        req.stats.prompt_tokens = len(prompt_ids)
        req.stats.lossless = req.rule.lossless
        return req

    def _constraint(
        self, grammar: Grammar | None, config: GenerationConfig
    ) -> GrammarConstraint | None:
        """The request's grammar compiled for this tokenizer (the compiler is built once)."""
        if grammar is None:
            return None
        if not isinstance(grammar, Grammar):
            raise InvalidRequestError(
                "grammar must be a specdec.grammar.Grammar (e.g. Grammar.json_schema(schema))",
                param="grammar",
            )
        if config.ignore_eos:
            raise InvalidRequestError(
                "ignore_eos cannot be combined with a grammar: the grammar decides where the "
                "output ends",
                param="ignore_eos",
            )
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, sorted(self.eos_token_ids))
        return self._grammar_compiler.constraint(grammar)

    def emitter(self, req: RequestState) -> Emitter:
        """The request's event emitter (detokenizer, stop strings, end of sequence)."""
        return Emitter(req, self.tokenizer, self.eos_token_ids)

    def start(self, req: RequestState) -> None:
        """Begin ``req`` on this decoder's own target: fresh per-request drafter state, the
        prompt prefilled."""
        if not req.plain:
            for s in self.speculators:
                s.reset()
            if self.arms is not None:
                self.arms.reset()
        self.target.begin(req.tokens)
        req.stats.prefill_seconds = time.perf_counter() - req.started

    def end_request(self, req: RequestState) -> None:
        """The request is over (finished, stopped or abandoned): its speculators learn from
        it (the suffix cache, online distillation)."""
        if not req.plain:
            for s in req.speculators:
                s.end_request(list(req.tokens), req.prompt_len)
            if req.arms is not None:
                produced = len(req.tokens) - req.prompt_len
                req.arms.end_request(produced, produced >= req.config.max_new_tokens)

    def budget_policy(self, config: GenerationConfig) -> Budget:
        """How a request's drafts are sized: by the arm controller or a tree speculator (a node
        cap), always K (``adaptive=False``), by a self-stopping chain, or per step by the
        adaptive budget."""
        if self.arms is not None or self.speculator.drafts_trees:
            return NodeBudget()  # the arm controller, or a tree speculator, sizes the draft
        if not self.adaptive:  # always K (DraftContext.fixed_length: no early stop either)
            return FixedBudget(self.num_draft_tokens)
        cap = self.speculator.chain_cap(config.sampling)
        if cap is not None:  # the speculator stops its chain itself, up to cap tokens
            return FixedBudget(min(cap, self.num_draft_tokens) if self.caps_chains else cap)
        # Sampled output depends on the drafts, so its budget must not depend on timing.
        costs = self.cost_model if config.sampling.greedy else self._cost_prior
        return AdaptiveBudget(self.num_draft_tokens, costs)

    # -- the phases of a step -------------------------------------------------------------------
    def step(self, req: RequestState) -> Acceptance:
        """One speculative step on this decoder's target: the controller drafts (choosing the
        speculator and the size), the target verifies in one pass, the rule accepts, the cache
        commits, the drafter observes."""
        room = self.context_length - len(req.tokens)
        budget = 0 if req.plain else req.budget.choose(req.remaining, room)
        proposal = self.propose(req, budget, self.target.features)
        t1 = time.perf_counter()
        logits = self.target.verify(proposal.tree)  # [N, V]
        acceptance, scored = self.accept(req, proposal, logits)
        self.target.commit(acceptance.path)
        t2 = time.perf_counter()
        self.settle(req, proposal, acceptance, logits, scored)
        req.stats.verify_seconds += t2 - t1 + proposal.grammar_seconds
        tree = proposal.tree
        self.cost_model.observe(len(tree), t2 - t1, tree=not tree.is_chain)
        return acceptance

    def propose(self, req: RequestState, budget: int, features: torch.Tensor | None) -> Proposal:
        """The request's draft for this step (``budget`` 0: the root alone), pruned by its
        grammar; drafting time goes to the stats and the cost model."""
        tree, seconds, catch_up = self.draft(req, budget, features)
        return self.proposal(req, budget, tree, seconds, catch_up)

    def draft(
        self, req: RequestState, budget: int, features: torch.Tensor | None
    ) -> tuple[DraftTree, float, float]:
        """The drafter's tree for ``budget``, its drafting seconds and catch-up seconds."""
        if budget <= 0:
            return DraftTree.root_only(req.tokens[-1]), 0.0, 0.0
        drafter = req.arms or req.speculator
        t0 = time.perf_counter()
        context = self.context(req, features)
        if req.arms is not None:
            tree = req.arms.draft(context, budget)
        else:
            tree = req.speculator.propose(context, budget)
        return tree, time.perf_counter() - t0, drafter.catch_up_seconds()

    def context(self, req: RequestState, features: torch.Tensor | None) -> DraftContext:
        """What the request's drafter sees this step."""
        return DraftContext(
            req.tokens,
            req.prompt_len,
            req.config.sampling,
            req.generator,
            features if self.reads_features else None,
            req.costs,
            req.constraint,
            fixed_length=not self.adaptive,
            remaining=req.remaining,
        )

    def proposal(
        self, req: RequestState, budget: int, tree: DraftTree, seconds: float, catch_up: float
    ) -> Proposal:
        """A drafted tree made ready for verification: the grammar prunes what it forbids
        (and masks every node's logits later); the stats and the cost model record drafting."""
        t1 = time.perf_counter()
        constrained = req.constraint.prepare(tree, extend=not req.plain) if req.constraint else None
        req.stats.draft_seconds += seconds
        self.cost_model.observe_draft(tree.num_drafted, max(0.0, seconds - catch_up))
        return Proposal(
            budget,
            tree,
            constrained.tree if constrained else tree,
            constrained,
            seconds,
            time.perf_counter() - t1,
            catch_up,
        )

    def accept(
        self, req: RequestState, proposal: Proposal, logits: torch.Tensor
    ) -> tuple[Acceptance, torch.Tensor]:
        """The acceptance rule over the verified logits (grammar-masked when constrained)."""
        tm = time.perf_counter()
        constrained = proposal.constrained
        scored = constrained.mask(logits) if constrained else logits  # [N, V]
        acceptance = req.rule.accept(proposal.tree, scored, req.config.sampling, req.generator)
        if constrained is not None:
            req.stats.grammar_seconds += time.perf_counter() - tm
        return acceptance, scored

    def settle(
        self,
        req: RequestState,
        proposal: Proposal,
        acceptance: Acceptance,
        logits: torch.Tensor,
        scored: torch.Tensor,
    ) -> None:
        """After the target committed ``acceptance.path``: the grammar advances, log-probs are
        read, the drafter and the budget learn, the stats record the step."""
        if req.constraint is not None:
            tg = time.perf_counter()
            req.constraint.advance(acceptance.tokens)
            req.stats.grammar_seconds += proposal.grammar_seconds + time.perf_counter() - tg
        if req.logprobs is not None:  # row of each committed token's parent on the path
            rows = scored[list(acceptance.path)]  # [len(tokens), V]
            sampling = req.config.sampling
            req.step_logprobs = token_logprobs(rows, acceptance.tokens, sampling, req.logprobs)
        constrained = proposal.constrained
        if constrained:
            feedback = constrained.feedback(acceptance, logits)
        else:
            feedback = Feedback(proposal.proposed, acceptance, logits)
        if req.arms is not None and not req.plain:
            req.arms.observe(feedback)
            choice = (req.arms.last_choice or "none") if proposal.budget > 0 else "none"
            req.stats.record_choice(choice)
        elif not req.plain:
            req.speculator.observe(feedback)
        req.stats.record_step(max(proposal.tree.depths), acceptance.num_accepted)
        # the budget sized the speculator's draft: it learns from that draft's fate alone
        req.budget.observe(max(proposal.proposed.depths), feedback.acceptance.num_accepted)
