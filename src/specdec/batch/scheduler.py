"""Continuous batching: sequences join and leave between steps; one pass verifies them all.

A step (:meth:`BatchScheduler.step`) does, in order:

1. drop the sequences cancelled since the last step (their rows are freed now);
2. admit: prompt tokens of prefilling sequences, oldest first, as many as keep the step within
   ``slowdown`` (2) times the measured cost of a full batch's plain step (at least 16, at most
   ``chunk``; a long prompt takes several steps, so it delays the running sequences by that
   much per step at most); a waiting sequence gets a row when a row is free and the budget
   has room for it;
3. one pass: every running sequence drafts (greedy ones the length :class:`BatchBudget` chose
   for the batch within the same limit on the step's rows, sampled ones their own timing-free
   budget), and one target pass verifies all the trees *and* carries the step's prompt tokens
   ahead of their rows' trees (the chunk rides the pass: on a CPU it costs its rows, not another
   pass over the weights). A sequence whose prompt completes in this pass drafts and is verified
   in it too (its first token comes from this pass), unless its speculator reads the target's
   hidden states, which its last chunk only now computes: it decodes from the next step. Each
   sequence's rule accepts with its own generator, every row commits its prefix and path, and
   each sequence emits its event; finished sequences leave.

With a padded target (an eager-attention model, :attr:`BatchTarget.packed` false) a prompt
chunk would pad every row of the pass to its width, so prompts are prefilled in passes of
their own on a private cache instead (one chunk per step), and join when complete.

Each sequence's state is its own: tokens, sampling generator, grammar, speculator instance
(:meth:`Speculator.fork`) and acceptance estimate. So a greedy sequence's output is its solo
greedy output, and a seeded sampled one's does not depend on what it was batched with.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.batch.target import DEFAULT_CHUNK, BatchTarget, Prefill
from specdec.config import GenerationConfig
from specdec.control.batch import BatchBudget, BatchCosts, Candidate
from specdec.control.budget import AdaptiveBudget
from specdec.decode import Decoder, Emitter, Proposal, RequestState
from specdec.errors import ConfigError, InvalidRequestError
from specdec.events import GenerationResult, ResultBuilder, TokenEvent
from specdec.grammar import Grammar
from specdec.request import Prompt
from specdec.target import HFTarget
from specdec.tree import DraftTree

_ids = itertools.count()
PACK_LIMIT = 1024  # prompt tokens prefilled in one pass when nothing runs yet
MIN_PROMPT_TOKENS = 16  # prompt tokens a step beside decoding sequences carries at least
DEFAULT_SLOWDOWN = 2.0


@dataclass(eq=False)
class BatchSequence:
    """One request inside the batch; :attr:`events` is filled as steps produce them when the
    caller asks the scheduler to keep them (``generate_batch`` does)."""

    req: RequestState
    emitter: Emitter
    tracker: AdaptiveBudget  # acceptance estimate by draft position, for the batch budget
    id: int = field(default_factory=lambda: next(_ids))
    prefill: Prefill | None = None  # while its prompt is on its way in; None once decoding
    cancelled: bool = False
    finished: bool = False
    finish_reason: str | None = None


@dataclass(frozen=True)
class StepReport:
    """What one step did, for metrics and tests."""

    batch_size: int  # sequences verified in the pass (0: a prefill-only step)
    width: int  # the widest sequence's tree in the pass (its prompt tokens not counted)
    draft_length: int  # the longest draft the batch budget gave a greedy sequence
    prefill_tokens: int
    seconds: float
    verify_seconds: float
    rows: int = 0  # token rows the pass computed (packed: all nodes; padded: batch x width)


class BatchScheduler:
    """The step-level scheduler behind the server and :func:`generate_batch`; not thread-safe
    (one thread owns it, as one owns an engine).

    ``max_batch`` caps the running sequences; more wait (prefill starts when a row is free).
    ``chunk`` is the most prompt tokens a step carries while others decode; ``slowdown`` caps
    what its prompt tokens and drafts may add to a step: it costs at most that many times a
    full batch's plain step, by the costs measured on this machine (:meth:`step_rows`).
    ``fused`` (default: whenever passes are packed) carries prompt chunks in the verification
    passes; ``False`` prefills them in passes of their own, as a padded target must (for
    comparing the two)."""

    def __init__(
        self,
        engine: Decoder,
        *,
        max_batch: int = 8,
        chunk: int = DEFAULT_CHUNK,
        slowdown: float = DEFAULT_SLOWDOWN,
        fused: bool | None = None,
    ) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ConfigError(f"the prefill chunk must be an integer >= 1, got {chunk!r}")
        if isinstance(slowdown, bool) or not isinstance(slowdown, int | float) or not slowdown >= 1:
            raise ConfigError(
                f"the prefill slowdown must be a number >= 1 (a multiple of a step's cost), "
                f"got {slowdown!r}"
            )
        if not engine.batchable or not isinstance(engine.target, HFTarget):
            raise ConfigError(
                "batched decoding needs a Hugging Face target (SpeculativeEngine.from_pretrained)"
            )
        self.engine = engine
        self.max_batch = max_batch
        self.chunk = chunk
        self.slowdown = float(slowdown)
        self.target = BatchTarget(engine.target.loaded, chunk=chunk)
        if engine.reads_features:
            self.target.enable_features(engine.feature_layers)
        self.costs = BatchCosts(engine.cost_model)
        # T(rows) of every pass, prompt rows included: what a step's prompt tokens add to it
        self.pass_costs = BatchCosts(engine.cost_model)
        self.budget = BatchBudget(engine.num_draft_tokens, self.costs, packed=self.target.packed)
        self.waiting: deque[BatchSequence] = deque()
        self.rows: list[BatchSequence] = []  # index = row in the batch cache
        self.prefilling: list[BatchSequence] = []  # rows still taking their prompt, oldest first
        # prompts ride the verification passes (see the module doc), unless passes are padded
        if fused and not self.target.packed:
            raise ConfigError(
                "fused prefill needs packed passes; this model's attention is not one "
                "transformers registers (eager?), so its prompts are prefilled on their own"
            )
        self.fused = self.target.packed if fused is None else fused
        # a joining row's drafter needs its last chunk's features
        self._join_late = engine.reads_features
        self.steps = 0
        self.last: StepReport | None = None

    # -- requests -------------------------------------------------------------------------------
    def add(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig,
        *,
        speculate: bool = True,
        grammar: Grammar | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
    ) -> BatchSequence:
        """Queue a request (validated now: a bad one raises before it waits)."""
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        req = self.engine.new_request(
            prompt_ids,
            config,
            speculate=speculate,
            grammar=grammar,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            fork=True,
        )
        engine = self.engine
        tracker = AdaptiveBudget(engine.num_draft_tokens, engine.cost_model)
        seq = BatchSequence(req, engine.emitter(req), tracker)
        seq.prefill = self.target.start_prefill(req.tokens)
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: BatchSequence) -> None:
        """Stop ``seq``; its row is freed at the start of the next step."""
        seq.cancelled = True

    @property
    def running(self) -> list[BatchSequence]:
        """The sequences decoding (their prompt is in)."""
        return [s for s in self.rows if s.prefill is None]

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.rows

    def __len__(self) -> int:
        return len(self.waiting) + len(self.rows)

    # -- the step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[tuple[BatchSequence, TokenEvent]]:
        """One scheduling step (see the module doc); returns the events it produced.  In
        inference mode as a whole: the cache buffers are allocated inside the verification
        pass, so every in-place edit of them (joins, commits, leaves) must be too."""
        t0 = time.perf_counter()
        self._drop_cancelled()
        if self.fused:
            plan = self._admit()
            prefilled = sum(len(tokens) for tokens in plan.values())
        else:
            plan, prefilled = {}, self._prefill()
        events: list[tuple[BatchSequence, TokenEvent]] = []
        batch, width, length, verify = 0, 0, 0, 0.0
        passed = bool(self.rows)
        if passed:
            batch, width, length, verify, events = self._decode(plan)
        self.steps += 1
        seconds = time.perf_counter() - t0
        rows = self.target.last_rows if passed else 0
        self.last = StepReport(batch, width, length, prefilled, seconds, verify, rows)
        return events

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(seq)
            seq.finished = True
        rows = [r for r, s in enumerate(self.rows) if s.cancelled]
        self._release(rows)

    def _release(self, rows: Iterable[int]) -> None:
        """Free these rows (descending, so each move brings a row that stays)."""
        for row in sorted(rows, reverse=True):
            seq = self.rows[row]
            self.target.remove(row)
            last = self.rows.pop()
            if row < len(self.rows):
                self.rows[row] = last
            if seq in self.prefilling:
                self.prefilling.remove(seq)
            seq.finished = True
            self.engine.end_request(seq.req)

    def step_rows(self, decoding: int) -> int | None:
        """The most rows a step beside ``decoding`` decoding sequences may compute, prompt
        tokens and drafted nodes included: as many as keep it within ``slowdown`` times a full
        batch's plain step, on the line fitted to this scheduler's passes (``None`` before two
        pass sizes are measured).

        Every decoding client waits for the step, so what a step's extra rows add is what their
        gaps between tokens grow by. On a CPU a row costs about the same whether it is a prompt
        token, a drafted node or a decoded token once the pass is bound by arithmetic, so a
        fixed prompt chunk (or a long draft) beside a full batch of a large model makes the
        slowest steps several times a plain one: the p99 gap. On a small model, whose passes
        cost mostly their fixed part, the same rows are nearly free, and the limit is far above
        them. A small batch may take more rows a step than a full one (fewer steps, each with
        fewer clients waiting), but no step costs more than ``slowdown`` full-batch steps."""
        line = self.pass_costs.line()
        if line is None or line[1] <= 0:
            return None
        slope = line[1]
        limit = self.slowdown * self.pass_costs.cost(max(self.max_batch, decoding))
        return decoding + int((limit - self.pass_costs.cost(decoding)) / slope + 1e-9)

    def prompt_budget(self, decoding: int) -> int:
        """The prompt tokens a step may carry beside ``decoding`` decoding sequences: what
        :meth:`step_rows` leaves after one row each, at least ``MIN_PROMPT_TOKENS`` (a prompt
        always progresses), at most ``chunk``; the floor until the passes are measured. With
        nothing decoding no one waits: up to ``PACK_LIMIT``. The total work does not change
        (each prompt token is one row either way); a smaller budget spreads it over more steps,
        each of which also decodes the running sequences."""
        if decoding == 0:
            return max(self.chunk, PACK_LIMIT)
        floor = min(self.chunk, MIN_PROMPT_TOKENS)
        rows = self.step_rows(decoding)
        if rows is None:
            return floor
        return max(floor, min(self.chunk, rows - decoding))

    def _admit(self) -> dict[int, list[int]]:
        """This step's prompt tokens per sequence id (see the module doc): the prefilling rows
        first, oldest first, then waiting sequences given rows while the budget has room. At
        most one prompt is left part-way, the last admitted, so every prefilling row has tokens
        in every pass. With nothing decoding there is no one to delay: up to ``PACK_LIMIT``."""
        budget = self.prompt_budget(len(self.rows) - len(self.prefilling))
        plan: dict[int, list[int]] = {}
        partial = False

        def take(seq: BatchSequence) -> None:
            nonlocal budget, partial
            prefill = seq.prefill
            assert prefill is not None
            left = len(prefill.tokens) - prefill.done
            n = min(left, budget)
            plan[seq.id] = prefill.tokens[prefill.done : prefill.done + n]
            budget -= n
            partial = partial or n < left

        for seq in self.prefilling:
            take(seq)
        while self.waiting and len(self.rows) < self.max_batch and not partial:
            seq = self.waiting[0]
            prefill = seq.prefill
            assert prefill is not None
            if budget == 0 and prefill.done < len(prefill.tokens):
                break
            self.waiting.popleft()
            row = self.target.attach(prefill)
            assert row == len(self.rows)
            self.rows.append(seq)
            self.prefilling.append(seq)
            take(seq)
        return plan

    def _prefill(self) -> int:
        """With a padded target: at most one prefill pass per step on a private cache, the next
        chunk of a prompt already under way, or as many fresh prompts as fit in ``chunk``
        tokens packed into one pass (a longer one starts alone, chunked); a complete prompt
        joins the batch. With nothing running: up to ``PACK_LIMIT`` tokens at once."""
        if not self.waiting or len(self.rows) >= self.max_batch:
            return 0
        budget = self.chunk if self.rows else max(self.chunk, PACK_LIMIT)
        head = self.waiting[0]
        assert head.prefill is not None
        started = time.perf_counter()
        if head.prefill.done or len(head.prefill.tokens) > budget:
            before = head.prefill.done
            row = self.target.prefill_chunk(head.prefill, budget)
            fed = head.prefill.done - before
            group, rows = [head], ([] if row is None else [row])
        else:
            group, fed = [], 0
            room = self.max_batch - len(self.rows)
            for seq in self.waiting:
                assert seq.prefill is not None
                size = len(seq.prefill.tokens)
                if len(group) == room or seq.prefill.done or fed + size > budget:
                    break
                group.append(seq)
                fed += size
            rows = self.target.prefill_packed([s.prefill for s in group if s.prefill])
        seconds = time.perf_counter() - started
        for seq in group:
            seq.req.stats.prefill_seconds += seconds
        for seq, row in zip(group, rows, strict=False):
            assert row == len(self.rows)
            self.waiting.popleft()
            seq.prefill = None
            self.rows.append(seq)
        return fed

    def _proposals(self, rows: Sequence[int], extra: int) -> tuple[dict[int, Proposal], int]:
        """The proposals of these rows' sequences for this step, and the longest length the
        batch budget gave. ``extra`` is the prompt tokens the pass carries besides.

        Greedy sequences whose speculator drafts cheaply (no model) draft first, up to their
        cap; the batch budget then prices each sequence's nodes against the drafts actually at
        hand (a sequence with no match adds no rows) and cuts them to what it chose. A sequence
        drafted by a model is sized before drafting, since its draft costs real time. Sampled
        and fixed-K sequences keep their own budgets."""
        engine = self.engine
        budgets = dict.fromkeys(rows, 0)
        drafts: dict[int, tuple[DraftTree, float, float]] = {}
        sized: list[int] = []
        candidates: list[Candidate] = []
        resting = self.budget.resting
        for i in rows:
            seq = self.rows[i]
            req = seq.req
            room = engine.context_length - len(req.tokens)
            cap = max(0, min(engine.num_draft_tokens, req.remaining - 1, room - 1))
            if not req.drafts:
                continue  # nothing drafts: plain rows
            if not req.config.sampling.greedy or not engine.adaptive:
                # its own timing-free budget (sampled), or always K (fixed)
                budgets[i] = req.budget.choose(req.remaining, room)
                continue
            if resting:
                continue  # the batch drafts nothing this step (see BatchBudget.resting)
            sized.append(i)
            spec = req.speculator
            if cap and req.arms is None and not spec.drafts_by_model and spec.truncatable:
                tree, seconds, catch_up = engine.draft(req, cap, self.target.features[i])
                drafts[i] = (tree, seconds, catch_up)
                depth = max(tree.depths)
                candidates.append(Candidate(seq.tracker.alphas, cap, tree.num_drafted, depth))
            else:
                candidates.append(Candidate(seq.tracker.alphas, cap))
        length = 0
        if resting:
            self.budget.rest()
        elif candidates:
            self.budget.draft_seconds_per_token = engine.cost_model.draft_seconds_per_token
            chosen = set(sized)
            k_max = engine.num_draft_tokens
            others = [1 + min(budgets[i], k_max) for i in rows if i not in chosen]
            decoding = len(self.rows) - len(self.prefilling)
            lengths = self.budget.choose(candidates, others, extra, self.step_rows(decoding))
            for i, c, k in zip(sized, candidates, lengths, strict=True):
                budgets[i] = min(k, c.cap)
            length = max(lengths, default=0)
        proposals: dict[int, Proposal] = {}
        for i in rows:
            req = self.rows[i].req
            if i in drafts:
                tree, seconds, catch_up = drafts[i]
                cut = tree.truncated(budgets[i])
                proposals[i] = engine.proposal(req, budgets[i], cut, seconds, catch_up)
            else:
                proposals[i] = engine.propose(req, budgets[i], self.target.features[i])
        return proposals, length

    def _decode(
        self, plan: dict[int, list[int]]
    ) -> tuple[int, int, int, float, list[tuple[BatchSequence, TokenEvent]]]:
        """The step's one pass over every row: proposals verified, prompt tokens carried."""
        engine = self.engine
        prefixes: list[list[int]] = [plan.get(seq.id, []) for seq in self.rows]
        verified: list[int] = []  # rows with a tree this pass
        for row, seq in enumerate(self.rows):
            prefill = seq.prefill
            if prefill is None:
                verified.append(row)
            elif prefill.done + len(prefixes[row]) >= len(prefill.tokens):
                if not self._join_late or not prefixes[row]:
                    verified.append(row)  # its prompt completes here: it decodes in this pass
        extra = sum(len(p) for p in prefixes)
        proposals, length = self._proposals(verified, extra)
        trees: list[DraftTree | None] = [
            proposals[r].tree if r in proposals else None for r in range(len(self.rows))
        ]
        t1 = time.perf_counter()
        logits = self.target.verify(trees, prefixes if extra else None)
        accepted = {}
        for row in verified:
            row_logits = logits[row]
            assert row_logits is not None
            accepted[row] = engine.accept(self.rows[row].req, proposals[row], row_logits)
        paths = [accepted[r][0].path if r in accepted else None for r in range(len(self.rows))]
        self.target.commit(paths)
        seconds = time.perf_counter() - t1
        self.pass_costs.observe(self.target.last_rows, seconds)
        drafted = any(len(proposals[r].tree) > 1 for r in verified)
        if not extra:
            # T(rows) is learnt from passes of trees alone: a prompt token skips the LM head, so
            # a pass carrying a chunk costs less per row than one of drafted nodes, and learning
            # from it would price drafts low
            self.budget.observe(self.target.last_rows, seconds, drafted=drafted)
        share = seconds / max(1, self.target.last_rows)
        for row, seq in enumerate(self.rows):
            prefill = seq.prefill
            if prefill is None or not prefixes[row] and row not in proposals:
                continue
            prefill.done += len(prefixes[row])
            seq.req.stats.prefill_seconds += share * len(prefixes[row])
            if prefill.finished:
                seq.prefill = None
                self.prefilling.remove(seq)
        events: list[tuple[BatchSequence, TokenEvent]] = []
        done: list[int] = []
        for row in verified:
            seq, proposal, (acceptance, scored) = self.rows[row], proposals[row], accepted[row]
            row_logits = logits[row]
            assert row_logits is not None
            req = seq.req
            engine.settle(req, proposal, acceptance, row_logits, scored)
            req.stats.verify_seconds += seconds + proposal.grammar_seconds
            drafted_here = max(proposal.proposed.depths)
            if drafted_here > 0:
                seq.tracker.observe(drafted_here, acceptance.num_accepted)
            event = seq.emitter.emit(acceptance)
            events.append((seq, event))
            if event.finish_reason is not None:
                seq.finish_reason = event.finish_reason
                done.append(row)
        self._release(done)
        width = max((len(proposals[r].tree) for r in verified), default=0)
        return len(verified), width, length, seconds, events

    # -- whole batches --------------------------------------------------------------------------
    def run(self) -> Iterable[tuple[BatchSequence, TokenEvent]]:
        """Step until every queued sequence is done, yielding events as they come."""
        while not self.idle:
            yield from self.step()


def generate_batch(
    engine: Decoder,
    prompts: Sequence[Prompt],
    *,
    max_batch: int = 8,
    chat: bool | None = None,
    **kwargs: Any,
) -> list[GenerationResult]:
    """Generate for every prompt with continuous batching; results in prompt order.

    Takes :meth:`SpeculativeEngine.generate`'s keyword arguments (``max_new_tokens``,
    ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``ignore_eos``, ``speculate``,
    ``grammar``, ``logprobs``, ``top_logprobs``); ``seeds`` gives each prompt its own seed (a
    single ``seed`` applies to all)."""
    ids = [engine.encode(p, chat) for p in prompts]
    return generate_batch_ids(engine, ids, max_batch=max_batch, **kwargs)


def generate_batch_ids(
    engine: Decoder,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_batch: int = 8,
    speculate: bool = True,
    seeds: Sequence[int | None] | None = None,
    grammar: Grammar | None = None,
    logprobs: bool = False,
    top_logprobs: int = 0,
    **kwargs: Any,
) -> list[GenerationResult]:
    """:func:`generate_batch` for prompts given as token ids (batch jobs that tokenized
    already, such as the trainers' data generation)."""
    sampling_keys = {"temperature", "top_p", "top_k"}
    config_keys = {"max_new_tokens", "stop", "ignore_eos"}
    unknown = set(kwargs) - sampling_keys - config_keys - {"seed"}
    if unknown:
        raise InvalidRequestError(f"generate_batch got unknown arguments: {sorted(unknown)}")
    if seeds is not None and len(seeds) != len(prompt_ids):
        raise InvalidRequestError(
            f"{len(seeds)} seeds for {len(prompt_ids)} prompts", param="seeds"
        )
    scheduler = BatchScheduler(engine, max_batch=max_batch)
    seqs: list[BatchSequence] = []
    for i, ids in enumerate(prompt_ids):
        seed = seeds[i] if seeds is not None else kwargs.get("seed")
        config = GenerationConfig.of(**{**kwargs, "seed": seed})
        seqs.append(
            scheduler.add(
                list(ids),
                config,
                speculate=speculate,
                grammar=grammar,
                logprobs=logprobs,
                top_logprobs=top_logprobs,
            )
        )
    builders = {s.id: ResultBuilder(logprobs) for s in seqs}
    for seq, event in scheduler.run():
        builders[seq.id].add(event)
    method = engine.method if speculate else "none"
    return [builders[s.id].result(method) for s in seqs]
