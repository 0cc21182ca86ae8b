"""The decoding loop. ``stream`` is the only loop; generate(), the CLI, server and bench use it."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from os import PathLike
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from specdec.config import GenerationConfig
from specdec.control import AdaptiveBudget, CostModel, FixedBudget, NodeBudget
from specdec.control.arms import ArmController, AutoOptions, build_arm_controller
from specdec.control.calibration import calibrate_on_first_use, load_cost_calibration
from specdec.errors import ConfigError, InvalidRequestError
from specdec.events import GenerationResult, ResultBuilder, TokenEvent
from specdec.grammar import Grammar, GrammarCompiler, GrammarConstraint
from specdec.grammar.constraint import ConstrainedTree
from specdec.logprobs import TokenLogprob, token_logprobs
from specdec.metrics import RequestStats
from specdec.request import Prompt, check_fits, encode_prompt
from specdec.speculators import (
    DraftContext,
    Feedback,
    NoSpeculator,
    Speculator,
    SpeculatorOptions,
    build_speculator,
    parse_spec,
)
from specdec.target import HFTarget, LoadedModel, Target, load_model
from specdec.text import IncrementalDetokenizer, StopMatcher
from specdec.tree import DraftTree
from specdec.verify import (
    Acceptance,
    AcceptanceRule,
    TypicalAcceptanceRule,
    make_generator,
    rule_for,
)


def _target_for(loaded: LoadedModel) -> Target:
    """The verifier: the torch model itself, or for ``dtype="gguf"`` llama.cpp running the GGUF
    file the model was loaded from (:class:`specdec.target.llamacpp.LlamaCppTarget`)."""
    from specdec.target.loading import GGUF_DTYPE

    if loaded.dtype_name == GGUF_DTYPE:
        from specdec.target.llamacpp import LlamaCppTarget

        return LlamaCppTarget(loaded.source, threads=torch.get_num_threads())
    return HFTarget(loaded)


def _initial_costs(loaded: LoadedModel | None, speculating: bool) -> CostModel:
    """The saved calibration's ratios as the prior when there is one (measured now, on first
    use, for a model that should have one: :func:`calibrate_on_first_use`), else the generic
    one. Plain decoding prices nothing, so an engine that never drafts measures nothing."""
    if loaded is None:
        calibration = None
    elif speculating:
        calibration = calibrate_on_first_use(loaded)
    else:
        calibration = load_cost_calibration(loaded)
    if calibration is None:
        return CostModel()
    return CostModel.calibrated(calibration.ratios(tree=False), calibration.ratios(tree=True))


@dataclass
class _Request:
    """Mutable state of one request inside :meth:`SpeculativeEngine.stream`."""

    tokens: list[int]  # prompt + committed output; the last one is the next tree's root
    prompt_len: int
    config: GenerationConfig
    plain: bool  # speculate=False: plain decoding through the same loop
    rule: AcceptanceRule
    generator: torch.Generator
    budget: AdaptiveBudget | FixedBudget | NodeBudget
    costs: CostModel  # what tree speculators price verification with (see DraftContext)
    started: float  # time.perf_counter() when the request arrived
    stats: RequestStats = field(default_factory=RequestStats)
    constraint: GrammarConstraint | None = None  # the request's grammar (specdec.grammar)
    logprobs: int | None = None  # None: off; n: each token's log-prob and the top n
    step_logprobs: list[TokenLogprob] = field(default_factory=list)  # the last step's
    # who drafts for this request: the engine's own, or a fork of it (batched decoding)
    speculator: Speculator = field(default_factory=NoSpeculator)
    arms: ArmController | None = None

    @property
    def remaining(self) -> int:
        return self.config.max_new_tokens - (len(self.tokens) - self.prompt_len)


@dataclass
class _Proposal:
    """One step's draft before verification: what the speculator proposed, the tree the target
    verifies (the proposal pruned by the request's grammar), and the timings so far."""

    budget: int
    proposed: DraftTree
    tree: DraftTree
    constrained: ConstrainedTree | None
    draft_seconds: float
    grammar_seconds: float
    catch_up_seconds: float


class SpeculativeEngine:
    """Lossless speculative decoding over one target model.

    Every step drafts a tree, verifies it in one target forward pass, keeps the accepted path
    and adds one target-chosen token, so greedy output equals plain greedy decoding and sampled
    output follows exactly the target's (temperature/top-k/top-p shaped) distribution.

    Who drafts is decided in the step: one ``speculator`` with the budget policy that sizes its
    drafts, or an :class:`~specdec.control.arms.ArmController` (``arms``) choosing among several
    speculators per step.
    """

    def __init__(
        self,
        target: Target,
        tokenizer: PreTrainedTokenizerBase,
        speculator: Speculator | None = None,
        *,
        arms: ArmController | None = None,
        num_draft_tokens: int = 5,
        eos_token_ids: Sequence[int] | None = None,
        loaded: LoadedModel | None = None,
        acceptance_rule: AcceptanceRule | None = None,
        adaptive: bool = True,
    ) -> None:
        """``adaptive`` drafts, per step, the length (up to K) that maximises expected tokens
        per second from measured acceptance and verification cost, drafting nothing when that
        does not pay; ``adaptive=False`` always drafts K. ``acceptance_rule`` overrides the
        lossless default (greedy match / rejection sampling, chosen per request); only opt-in
        lossy rules or tests pass one."""
        if speculator is not None and arms is not None:
            raise ConfigError("give the engine one speculator or an arm controller, not both")
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int):
            raise ConfigError(f"num_draft_tokens (K) must be an integer, got {num_draft_tokens!r}")
        if num_draft_tokens < 1:
            raise ConfigError(f"num_draft_tokens (K) must be >= 1, got {num_draft_tokens}")
        self.target = target
        self.acceptance_rule = acceptance_rule
        self.tokenizer = tokenizer
        self.arms = arms
        self.speculator: Speculator = speculator or NoSpeculator()
        # every speculator the engine serves: reset, end_request and features reach all of them
        self.speculators: tuple[Speculator, ...] = (
            arms.speculators if arms is not None else (self.speculator,)
        )
        self.num_draft_tokens = num_draft_tokens
        self.adaptive = adaptive
        # T(n) measured on this machine, shared by requests; from `specdec calibrate cost`
        self.cost_model = _initial_costs(
            loaded, arms is not None or not isinstance(self.speculator, NoSpeculator)
        )
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
        if arms is not None:  # the controller prices drafts with the engine's measured costs
            arms.bind_costs(self.cost_model)
        readers = [s for s in self.speculators if s.needs_hidden_states]
        if readers:
            if not target.provides_features:
                raise ConfigError(
                    f"the {readers[0].name} speculator reads the target's hidden states, "
                    f"which {type(target).__name__} does not provide"
                )
            target.enable_features(arms.feature_layers if arms else self.speculator.feature_layers)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        model: str | PathLike[str] | LoadedModel | None = None,
        *,
        gguf: str | PathLike[str] | None = None,
        speculator: str | SpeculatorOptions = "none",
        num_draft_tokens: int = 5,
        dtype: str = "float32",
        adaptive: bool = True,
        typical_acceptance: bool = False,
        device: str = "cpu",
        chat_template: str | PathLike[str] | None = None,
    ) -> SpeculativeEngine:
        """Load a target (a local HF directory, a GGUF file, or the bundled default model when
        both are ``None``) and build the speculator ``speculator`` names: a spec such as
        ``"eagle:dir=heads,tree=5x4x24"`` or ``"auto:arms=prompt-lookup+suffix"`` (grammar:
        :mod:`specdec.speculators.spec`), or an options object. The spec is checked before the
        model loads, so a typo fails in milliseconds.

        ``num_draft_tokens`` is K, the most tokens drafted per step (a spec's ``k`` overrides
        it). ``typical_acceptance`` switches sampled requests to Medusa's typical acceptance,
        which is faster but LOSSY (statistics say so). ``device`` (``cpu``, ``cuda``,
        ``cuda:N``, ``auto``) is where a model loaded here runs; a given ``LoadedModel`` keeps
        its own. ``chat_template`` (a file or the template text) gives a model without one
        (many GGUF files) a chat template.
        """
        options = parse_spec(speculator)
        k = options.k or num_draft_tokens
        loaded = (
            model
            if isinstance(model, LoadedModel)
            else load_model(
                model, gguf=gguf, dtype=dtype, device=device, chat_template=chat_template
            )
        )
        common: dict[str, Any] = {
            "num_draft_tokens": k,
            "loaded": loaded,
            "adaptive": adaptive,
            "acceptance_rule": TypicalAcceptanceRule() if typical_acceptance else None,
        }
        target = _target_for(loaded)
        if isinstance(options, AutoOptions):
            arms = build_arm_controller(loaded, options, k)
            return cls(target, loaded.tokenizer, arms=arms, **common)
        return cls(target, loaded.tokenizer, build_speculator(loaded, options), **common)

    @property
    def batchable(self) -> bool:
        """Whether :mod:`specdec.batch` can drive this engine's target (a Hugging Face one)."""
        return isinstance(self.target, HFTarget)

    @property
    def method(self) -> str:
        return "auto" if self.arms is not None else self.speculator.name

    @property
    def context_length(self) -> int:
        return self.target.context_length

    def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat)

    # -- the loop -------------------------------------------------------------------------------
    def stream(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] | str = (),
        chat: bool | None = None,
        ignore_eos: bool = False,
        speculate: bool = True,
        grammar: Grammar | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
    ) -> Iterator[TokenEvent]:
        """Yield one :class:`TokenEvent` per verification step, text as incremental deltas.

        ``speculate=False`` decodes plainly on the same target (the reference for speedups).
        ``grammar`` constrains the output (:class:`specdec.grammar.Grammar`), losslessly with
        respect to the grammar-masked target. ``logprobs`` adds each token's log-probability
        (and the ``top_logprobs`` most likely alternatives) to the events.
        Arguments are validated before the first token, so a bad request fails fast.
        """
        config = GenerationConfig.of(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
        )
        prompt_ids = self.encode(prompt, chat)
        return self.stream_ids(
            prompt_ids,
            config,
            speculate=speculate,
            grammar=grammar,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )

    def stream_ids(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig,
        *,
        speculate: bool = True,
        grammar: Grammar | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
    ) -> Iterator[TokenEvent]:
        req = self.new_request(
            prompt_ids,
            config,
            speculate=speculate,
            grammar=grammar,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )
        return self._run(req)

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
    ) -> _Request:
        """A validated request (bad arguments raise here, before any work). ``fork``: with
        its own speculator instances, for batched decoding (:mod:`specdec.batch`)."""
        check_fits(len(prompt_ids), config.max_new_tokens, self.context_length)
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int):
            raise InvalidRequestError("top_logprobs must be an integer", param="top_logprobs")
        if not 0 <= top_logprobs <= 20:
            raise InvalidRequestError(
                f"top_logprobs must be in [0, 20], got {top_logprobs}", param="top_logprobs"
            )
        constraint = self._constraint(grammar, config)
        wanted = top_logprobs if logprobs else None
        return self._new_request(list(prompt_ids), config, speculate, constraint, wanted, fork=fork)

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

    def _new_request(
        self,
        prompt_ids: list[int],
        config: GenerationConfig,
        speculate: bool,
        constraint: GrammarConstraint | None = None,
        logprobs: int | None = None,
        *,
        fork: bool = False,
    ) -> _Request:
        """A request's state; ``fork`` gives it its own speculator instances (batched decoding:
        each sequence keeps its own drafter state)."""
        started = time.perf_counter()
        greedy = config.sampling.greedy
        speculator, arms = self.speculator, self.arms
        if fork and speculate:
            if arms is not None:
                arms = arms.fork()
            else:
                speculator = speculator.fork()
        req = _Request(
            tokens=prompt_ids,
            prompt_len=len(prompt_ids),
            config=config,
            plain=not speculate,
            rule=self.acceptance_rule or rule_for(config.sampling),
            # on the target's device, where the probabilities are (fakes: the CPU)
            generator=make_generator(config.sampling.seed, self.target.device),
            budget=self._budget_policy(config),
            # sampled output depends on the drafts, so their sizing must not depend on timing
            costs=self.cost_model if greedy else self._cost_prior,
            started=started,
            constraint=constraint,
            logprobs=logprobs,
            speculator=speculator,
            arms=arms,
        )
        req.stats.prompt_tokens = len(prompt_ids)
        req.stats.lossless = req.rule.lossless
        return req

    def _run(self, req: _Request) -> Iterator[TokenEvent]:
        speculate = not req.plain
        if speculate:
            for s in self.speculators:
                s.reset()
            if self.arms is not None:
                self.arms.reset()
        self.target.begin(req.tokens)
        req.stats.prefill_seconds = time.perf_counter() - req.started
        try:
            yield from self._loop(req)
        finally:
            self.end_request(req)

    def end_request(self, req: _Request) -> None:
        """The request is over (finished, stopped or abandoned): its speculators learn from
        it (the suffix cache, online distillation)."""
        if not req.plain:
            for s in req.arms.speculators if req.arms else (req.speculator,):
                s.end_request(list(req.tokens), req.prompt_len)

    def _loop(self, req: _Request) -> Iterator[TokenEvent]:
        emitter = Emitter(self, req)
        while True:
            event = emitter.emit(self.step(req))
            yield event
            if event.finish_reason is not None:
                return

    def _budget_policy(self, config: GenerationConfig) -> AdaptiveBudget | FixedBudget | NodeBudget:
        if self.arms is not None or self.speculator.drafts_trees:
            return NodeBudget()  # the arm controller, or a tree speculator, sizes the draft
        if not self.adaptive:  # always K (DraftContext.fixed_length: no early stop either)
            return FixedBudget(self.num_draft_tokens)
        cap = self.speculator.chain_cap(config.sampling)
        if cap is not None:  # the speculator stops its chain itself, up to cap tokens
            return FixedBudget(cap)
        # Sampled output depends on the drafts, so its budget must not depend on timing.
        costs = self.cost_model if config.sampling.greedy else self._cost_prior
        return AdaptiveBudget(self.num_draft_tokens, costs)

    def step(self, req: _Request) -> Acceptance:
        """One speculative step: the controller drafts (choosing the speculator and the size),
        the target verifies in one pass, the rule accepts, the cache commits, the drafter
        observes."""
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

    def propose(self, req: _Request, budget: int, features: torch.Tensor | None) -> _Proposal:
        """The request's draft for this step (``budget`` 0: the root alone), pruned by its
        grammar; drafting time goes to the stats and the cost model."""
        tree, seconds, catch_up = self.draft(req, budget, features)
        return self.proposal(req, budget, tree, seconds, catch_up)

    def draft(
        self, req: _Request, budget: int, features: torch.Tensor | None
    ) -> tuple[DraftTree, float, float]:
        """The drafter's tree for ``budget``, its drafting seconds and catch-up seconds."""
        if budget <= 0:
            return DraftTree.root_only(req.tokens[-1]), 0.0, 0.0
        drafter = req.arms or req.speculator
        t0 = time.perf_counter()
        tree = self._draft(req, budget, features)
        return tree, time.perf_counter() - t0, drafter.catch_up_seconds()

    def proposal(
        self, req: _Request, budget: int, tree: DraftTree, seconds: float, catch_up: float
    ) -> _Proposal:
        """A drafted tree made ready for verification: the grammar prunes what it forbids
        (and masks every node's logits later); the stats and the cost model record drafting."""
        t1 = time.perf_counter()
        constrained = req.constraint.prepare(tree, extend=not req.plain) if req.constraint else None
        req.stats.draft_seconds += seconds
        self.cost_model.observe_draft(tree.num_drafted, max(0.0, seconds - catch_up))
        return _Proposal(
            budget,
            tree,
            constrained.tree if constrained else tree,
            constrained,
            seconds,
            time.perf_counter() - t1,
            catch_up,
        )

    def accept(
        self, req: _Request, proposal: _Proposal, logits: torch.Tensor
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
        req: _Request,
        proposal: _Proposal,
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

    def _draft(self, req: _Request, budget: int, features: torch.Tensor | None) -> DraftTree:
        """This step's draft from the controller over several speculators, or the one."""
        reads = any(s.needs_hidden_states for s in self.speculators)
        context = DraftContext(
            req.tokens,
            req.prompt_len,
            req.config.sampling,
            req.generator,
            features if reads else None,
            req.costs,
            req.constraint,
            fixed_length=not self.adaptive,
            remaining=req.remaining,
        )
        if req.arms is not None:
            return req.arms.draft(context, budget)
        return req.speculator.propose(context, budget)

    def generate_batch(
        self, prompts: Sequence[Prompt], *, max_batch: int = 8, **kwargs: Any
    ) -> list[GenerationResult]:
        """Generate for many prompts at once with continuous batching (one target pass per step
        verifies every sequence's draft; :mod:`specdec.batch`). Each result equals what
        :meth:`generate` gives for its prompt alone (greedy: the same tokens; seeded sampling:
        the same draws). ``seeds`` gives each prompt its own seed; other keyword arguments as
        :meth:`generate`."""
        from specdec.batch import generate_batch

        return generate_batch(self, prompts, max_batch=max_batch, **kwargs)

    def generate_batch_ids(
        self, prompt_ids: Sequence[Sequence[int]], *, max_batch: int = 8, **kwargs: Any
    ) -> list[GenerationResult]:
        """:meth:`generate_batch` for prompts given as token ids."""
        from specdec.batch import generate_batch_ids

        return generate_batch_ids(self, prompt_ids, max_batch=max_batch, **kwargs)

    def generate(self, prompt: Prompt, **kwargs: Any) -> GenerationResult:
        """Run :meth:`stream` to the end; same keyword arguments."""
        builder = ResultBuilder(bool(kwargs.get("logprobs")))
        for event in self.stream(prompt, **kwargs):
            builder.add(event)
        return builder.result(self.method if kwargs.get("speculate", True) else "none")


class Emitter:
    """Turns a request's accepted tokens into :class:`TokenEvent` s: end of sequence, stop
    strings, the token limit, incremental text. One per request; the engine's loop and the
    batch scheduler share it."""

    def __init__(self, engine: SpeculativeEngine, req: _Request) -> None:
        self.engine = engine
        self.req = req
        self.detok = IncrementalDetokenizer(engine.tokenizer, req.tokens)
        self.stopper = StopMatcher(req.config.stop)

    def emit(self, acceptance: Acceptance) -> TokenEvent:
        """Commit ``acceptance.tokens`` to the request (up to its end) and describe them."""
        req, config = self.req, self.req.config
        eos = self.engine.eos_token_ids
        emitted: list[int] = []
        text, finish, stop_hit, eos_hit = "", None, False, None
        for token in acceptance.tokens:
            if token in eos and not config.ignore_eos:
                finish, eos_hit = "stop", token
                break
            emitted.append(token)
            req.tokens.append(token)
            delta, stop_hit = self.stopper.feed(self.detok.push(token))
            text += delta
            if stop_hit:
                finish = "stop"
                break
            if req.remaining <= 0:
                finish = "length"
                break
        if finish is not None and not stop_hit:
            delta, stop_hit = self.stopper.feed(self.detok.flush())
            text += delta
            if not stop_hit:
                text += self.stopper.flush()  # release text held back for a possible stop
        req.stats.new_tokens = len(req.tokens) - req.prompt_len
        req.stats.seconds = time.perf_counter() - req.started
        lps = None if req.logprobs is None else tuple(req.step_logprobs[: len(emitted)])
        return TokenEvent(tuple(emitted), text, finish, req.stats.snapshot(), lps, eos_hit)
