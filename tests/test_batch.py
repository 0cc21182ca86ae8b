"""Batched verification and continuous batching (specdec.batch) on tiny random-weight models.

Exactness: float64 throughout, where a batched pass and a single-sequence pass agree to ~1e-15,
so no argmax near-tie can flip and greedy outputs are compared for exact equality of token ids.
The KV-cache invariant is checked the same way: each row's keys and values after any mix of
steps equal a fresh single-sequence prefill of its committed tokens (within 1e-9).
"""

from __future__ import annotations

import gc
import random
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from specdec import SpeculativeEngine
from specdec.batch import BatchScheduler, BatchTarget
from specdec.batch.cache import SlotCache, SlotLayer
from specdec.config import GenerationConfig, SamplingConfig
from specdec.errors import ConfigError, InvalidRequestError
from specdec.grammar import Grammar
from specdec.target import ModelRunner, load_model
from specdec.tree import DraftTree
from tests.test_equivalence_tiny import PROMPTS as EQUIVALENCE_PROMPTS
from tests.test_losslessness import ResampleFromPRule

PROMPTS = [*EQUIVALENCE_PROMPTS, "a"]  # and a one-token prompt (nothing to prefill)


def _random_tree(rng: random.Random, root: int, vocab: int) -> DraftTree:
    size = rng.choice([1, 1, 2, 3, 5, 7])
    parents = [-1] + [rng.randrange(i) for i in range(1, size)]
    if rng.random() < 0.5:  # a chain
        parents = [-1] + list(range(size - 1))
    tokens = [root] + [rng.randrange(vocab) for _ in range(size - 1)]
    return DraftTree(tokens=tuple(tokens), parents=tuple(parents))


def _random_path(rng: random.Random, tree: DraftTree) -> list[int]:
    """A root-to-node path of the tree (what an acceptance rule may keep)."""
    node = rng.randrange(len(tree))
    return tree.path_to(node)


@pytest.mark.parametrize("packed", [True, False])
def test_kv_cache_invariant_after_any_mix_of_steps(tiny64, packed):
    """Rows join (prefilled in chunks, or several packed into one pass), verify random chains
    and trees, commit random paths, leave; every row's cache equals a fresh prefill of its
    committed tokens after each step, and every tree's logits equal those of its nodes' own
    chains decoded solo. Both with the trees' nodes packed into one sequence (the default) and
    with every tree padded to the widest."""
    rng = random.Random(0)
    vocab = tiny64.model.config.vocab_size
    target = BatchTarget(tiny64, chunk=5, packed=packed)
    assert target.packed is packed
    computed = []
    committed: list[list[int]] = []  # per row: the tokens its cache must hold (roots excluded)
    roots: list[int] = []
    for step in range(40):
        if len(committed) < 5 and rng.random() < 0.4:
            prompts = [
                [rng.randrange(vocab) for _ in range(rng.randrange(1, 14))]
                for _ in range(rng.choice([1, 1, 2, 3]))
            ]
            if len(prompts) > 1:  # packed into one pass, block-diagonal
                rows = target.prefill_packed([target.start_prefill(p) for p in prompts])
            else:  # chunked, 5 tokens per pass
                prefill = target.start_prefill(prompts[0])
                row = None
                while row is None:
                    row = target.prefill_chunk(prefill)
                rows = [row]
            assert rows == list(range(len(committed), len(committed) + len(prompts)))
            for prompt in prompts:
                committed.append(prompt[:-1])
                roots.append(prompt[-1])
        if committed and rng.random() < 0.15:
            row = rng.randrange(len(committed))
            target.remove(row)
            last_c, last_r = committed.pop(), roots.pop()
            if row < len(committed):
                committed[row], roots[row] = last_c, last_r
        if not committed:
            continue
        trees = [_random_tree(rng, root, vocab) for root in roots]
        logits = target.verify(trees)
        computed.append((target.last_rows, sum(len(t) for t in trees)))
        for r, (tree, row_logits) in enumerate(zip(trees, logits, strict=True)):
            node = len(tree) - 1
            path = tree.path_to(node)
            solo = ModelRunner(tiny64.model)
            context = committed[r] + [tree.tokens[i] for i in path]
            expect = solo.forward(context)[-1]
            assert torch.allclose(row_logits[node], expect, atol=1e-9), (step, r)
        paths = [_random_path(rng, t) for t in trees]
        target.commit(paths)
        for r, (tree, path) in enumerate(zip(trees, paths, strict=True)):
            kept = [tree.tokens[i] for i in path]
            committed[r] = committed[r] + kept
            roots[r] = rng.randrange(vocab)  # the next root (the rule's bonus token)
        for r, tokens in enumerate(committed):
            entries = target.cache.row_entries(r)
            if not tokens:
                continue
            fresh = ModelRunner(tiny64.model)
            fresh.forward(tokens)
            for layer, mine in zip(fresh.cache.hf.layers, entries, strict=True):
                assert mine is not None
                assert torch.allclose(mine[0], layer.keys[0], atol=1e-9), (step, r)
                assert torch.allclose(mine[1], layer.values[0], atol=1e-9), (step, r)
    # packed: a pass computes only the nodes; padded: rows x widest, more whenever sizes differ
    if packed:
        assert all(rows == nodes for rows, nodes in computed)
    else:
        assert any(rows > nodes for rows, nodes in computed)
    assert tiny64.model.config._attn_implementation != "specdec_packed"  # switched back


@pytest.mark.parametrize("spec", ["none", "prompt-lookup", "suffix", "lookahead", "auto"])
@pytest.mark.parametrize("max_batch,adaptive", [(2, True), (8, True), (3, False)])
def test_greedy_batch_equals_solo(tiny64, spec, max_batch, adaptive):
    """Each sequence's greedy output equals its solo greedy output, whoever it is batched
    with (max_batch 2 and 3 make sequences join and leave mid-run). The adaptive batch budget
    may rightly draft nothing on a tiny model (its choice depends on measured timings), so the
    drafting path is asserted with a fixed K."""
    engine = SpeculativeEngine.from_pretrained(
        tiny64, speculator=spec, num_draft_tokens=4, adaptive=adaptive
    )
    solo = [engine.generate(p, max_new_tokens=24, ignore_eos=True).token_ids for p in PROMPTS]
    batched = engine.generate_batch(
        PROMPTS, max_new_tokens=24, ignore_eos=True, max_batch=max_batch
    )
    assert [r.token_ids for r in batched] == solo
    if spec != "none" and not adaptive:
        assert sum(r.stats.drafted_tokens for r in batched) > 0


def test_greedy_batch_with_draft_model_and_fixed_k(tiny64, tiny_draft_dir):
    engine = SpeculativeEngine.from_pretrained(
        tiny64, speculator=f"draft:{tiny_draft_dir}", num_draft_tokens=3, adaptive=False
    )
    solo = [engine.generate(p, max_new_tokens=20, ignore_eos=True).token_ids for p in PROMPTS]
    batched = engine.generate_batch(PROMPTS, max_new_tokens=20, ignore_eos=True, max_batch=3)
    assert [r.token_ids for r in batched] == solo
    assert all(r.stats.drafted_tokens > 0 for r in batched if len(r.token_ids) > 1)


def test_sliding_window_model_in_a_batch(tmp_path, tiny_tokenizer_dir):
    """Mistral with a window shorter than the sequences: windowed batch masks."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(3)
    cfg = MistralConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        sliding_window=8, initializer_range=0.25, tie_word_embeddings=True,
    )  # fmt: skip
    MistralForCausalLM(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="float64")
    engine = SpeculativeEngine.from_pretrained(loaded, speculator="prompt-lookup")
    solo = [engine.generate(p, max_new_tokens=20, ignore_eos=True).token_ids for p in PROMPTS]
    batched = engine.generate_batch(PROMPTS, max_new_tokens=20, ignore_eos=True, max_batch=4)
    assert [r.token_ids for r in batched] == solo


def test_seeded_sampled_output_does_not_depend_on_batch_mates(tiny64):
    engine = SpeculativeEngine.from_pretrained(tiny64, speculator="prompt-lookup")
    kw = {"max_new_tokens": 20, "temperature": 1.0, "top_k": 20, "ignore_eos": True}
    prompt = PROMPTS[2]
    solo = engine.generate(prompt, seed=7, **kw).token_ids
    alone = engine.generate_batch([prompt], seeds=[7], **kw)[0].token_ids
    mixed = engine.generate_batch(PROMPTS + [prompt], seeds=[1, 2, 3, 4, 5, 6, 7], **kw)
    greedy_mates = engine.generate_batch(
        [prompt] + PROMPTS, seeds=[7] + [None] * len(PROMPTS), **kw
    )
    assert alone == solo
    assert mixed[-1].token_ids == solo
    assert greedy_mates[0].token_ids == solo
    assert len({tuple(r.token_ids) for r in mixed[:-1]}) > 1  # the mates did sample


def _first_two_tokens(engine: SpeculativeEngine, prompt: str, n: int, rule=None) -> Counter:
    if rule is not None:
        engine.acceptance_rule = rule
    kw = {"max_new_tokens": 2, "temperature": 1.0, "top_k": 4, "ignore_eos": True}
    results = engine.generate_batch([prompt] * n, seeds=list(range(n)), max_batch=16, **kw)
    return Counter(tuple(r.token_ids) for r in results)


def _exact_two_token_law(loaded, prompt_ids: list[int]) -> dict[tuple[int, int], float]:
    runner = ModelRunner(loaded.model)

    def top4(ids: list[int]) -> dict[int, float]:
        runner.reset()
        logits = runner.forward(ids)[-1]
        values, index = logits.topk(4)
        probs = torch.softmax(values, -1)
        return {int(i): float(p) for i, p in zip(index, probs, strict=True)}

    law: dict[tuple[int, int], float] = {}
    for a, pa in top4(prompt_ids).items():
        for b, pb in top4(prompt_ids + [a]).items():
            law[(a, b)] = pa * pb
    return law


@pytest.mark.slow
def test_sampled_batch_follows_the_target_and_the_test_has_power(tiny64):
    """Chi-square over the first two sampled tokens (top-k 4: 16 outcomes) through the batched
    path with a draft model (the target's first two layers: drafts carry q and overlap p, so
    both acceptance and rejection happen); the same test rejects a subtly wrong rule (on
    rejection it resamples from p instead of the residual), so it can fail."""
    engine = SpeculativeEngine.from_pretrained(
        tiny64, speculator="draft:model=layers:2", num_draft_tokens=2, adaptive=False
    )
    prompt = PROMPTS[0]
    law = _exact_two_token_law(tiny64, engine.encode(prompt))
    n = 3000
    counts = _first_two_tokens(engine, prompt, n)
    keys = sorted(law)
    assert set(counts) <= set(keys)
    p = chisquare([counts[k] for k in keys], [law[k] * n for k in keys]).pvalue
    assert p > 1e-3, p
    lossy = _first_two_tokens(engine, prompt, n, ResampleFromPRule())
    p_lossy = chisquare([lossy[k] for k in keys], [law[k] * n for k in keys]).pvalue
    assert p_lossy < 1e-6, p_lossy


def test_grammar_and_logprobs_in_a_batch(tiny64):
    engine = SpeculativeEngine.from_pretrained(tiny64, speculator="prompt-lookup")
    grammar = Grammar.regex(r"(the |a ){3,8}end")
    kw = {"max_new_tokens": 30, "logprobs": True, "top_logprobs": 2}
    solo = [engine.generate(p, grammar=grammar, **kw) for p in PROMPTS[:3]]
    batched = engine.generate_batch(PROMPTS[:3], grammar=grammar, **kw)
    for s, b in zip(solo, batched, strict=True):
        assert b.token_ids == s.token_ids
        assert b.text == s.text
        assert b.logprobs is not None and s.logprobs is not None
        for x, y in zip(b.logprobs, s.logprobs, strict=True):
            assert abs(x.logprob - y.logprob) < 1e-9


def test_cancel_frees_the_row_and_the_others_go_on(tiny64):
    engine = SpeculativeEngine.from_pretrained(tiny64, speculator="prompt-lookup")
    solo = [engine.generate(p, max_new_tokens=16, ignore_eos=True).token_ids for p in PROMPTS]
    scheduler = BatchScheduler(engine, max_batch=4)
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True, sampling=SamplingConfig())
    seqs = [scheduler.add(engine.encode(p), config) for p in PROMPTS]
    out: dict[int, list[int]] = {s.id: [] for s in seqs}
    steps = 0
    while not scheduler.idle:
        for seq, event in scheduler.step():
            out[seq.id].extend(event.token_ids)
        steps += 1
        if steps == 3:
            scheduler.cancel(seqs[1])
        assert len(scheduler.running) <= 4
    assert seqs[1].finished and seqs[1].finish_reason is None
    for i, seq in enumerate(seqs):
        if i != 1:
            assert out[seq.id] == solo[i]
    assert len(scheduler.target) == 0  # every row freed


def test_finished_batches_free_their_caches_without_the_cycle_collector(tiny64):
    """A batch's cache (its buffers hold every row's keys and values) is freed when the batch
    is over, by reference counting: a cycle through it would wait for Python's rare full
    collections, and a job running batch after batch (data generation) kept one per batch
    until it was OOM-killed."""
    engine = SpeculativeEngine.from_pretrained(tiny64, speculator="prompt-lookup")
    prompts = [engine.encode(p) for p in PROMPTS]
    kinds = (SlotCache, SlotLayer, BatchTarget, BatchScheduler)
    gc.collect()
    before = {id(o) for o in gc.get_objects() if type(o) in kinds}
    gc.disable()
    try:
        for _ in range(4):  # max_batch 3: rows leave mid-run, and the last out renews the cache
            engine.generate_batch_ids(prompts, max_batch=3, max_new_tokens=12, ignore_eos=True)
        alive = [o for o in gc.get_objects() if type(o) in kinds and id(o) not in before]
        left = sorted(type(o).__name__ for o in alive)
        del alive
    finally:
        gc.enable()
    assert left == []


def test_prefill_is_chunked_while_others_run(tiny64):
    engine = SpeculativeEngine.from_pretrained(tiny64)
    scheduler = BatchScheduler(engine, max_batch=4, chunk=8)
    config = GenerationConfig(max_new_tokens=100, ignore_eos=True, sampling=SamplingConfig())
    scheduler.add(engine.encode(PROMPTS[0]), config)
    scheduler.step()  # nobody running: the whole prompt at once
    long_ids = engine.encode(" ".join(PROMPTS) * 2)[:200]
    scheduler.add(long_ids, config)
    fed = []
    while len(scheduler.running) < 2:
        scheduler.step()
        assert scheduler.last is not None
        fed.append(scheduler.last.prefill_tokens)
        assert scheduler.last.batch_size >= 1  # the running sequence kept decoding
    assert max(fed) <= 8 and len(fed) >= len(long_ids) // 8


def test_a_step_beside_a_full_batch_of_dear_rows_takes_fewer_prompt_tokens(tiny64):
    """A step's prompt tokens and drafts are priced by the measured passes: where every row
    costs (a large model) a step computes only as many rows as keep it within ``slowdown``
    times a full batch's plain step, so a full batch takes fewer prompt tokens a step than a
    small one; where rows are nearly free (a small model) the whole chunk. Never fewer than
    16 prompt tokens, never more than the chunk; all at once when nothing decodes."""
    from specdec.batch.scheduler import MIN_PROMPT_TOKENS, PACK_LIMIT
    from specdec.control.batch import BatchCosts

    engine = SpeculativeEngine.from_pretrained(tiny64)

    def priced(a: float, b: float, **kwargs) -> BatchScheduler:
        scheduler = BatchScheduler(engine, max_batch=16, chunk=64, **kwargs)
        scheduler.pass_costs = BatchCosts(engine.cost_model)
        for rows in (4, 16, 40, 80):
            scheduler.pass_costs.observe(rows, a + b * rows)
        return scheduler

    fresh = BatchScheduler(engine, chunk=64)
    assert fresh.step_rows(4) is None and fresh.prompt_budget(4) == MIN_PROMPT_TOKENS
    dear = priced(0.04, 0.01)  # T(16) = 0.2 s: no step above 0.4 s, i.e. 36 rows
    assert [dear.step_rows(d) for d in (1, 4, 16)] == [36, 36, 36]
    assert dear.prompt_budget(16) == 20
    assert dear.prompt_budget(4) == 32
    assert dear.prompt_budget(0) == PACK_LIMIT
    assert priced(0.04, 0.01, slowdown=1.2).prompt_budget(16) == MIN_PROMPT_TOKENS
    assert priced(0.04, 0.01, slowdown=4.0).prompt_budget(16) == 60  # 0.8 s: 76 rows
    cheap = priced(0.02, 0.0002)  # fixed cost dominates: the chunk is nearly free
    assert cheap.prompt_budget(16) == 64
    small_chunk = BatchScheduler(engine, chunk=8)
    small_chunk.pass_costs = dear.pass_costs
    assert small_chunk.prompt_budget(16) == 8  # the chunk caps the floor too
    for bad in (0.5, float("nan"), True, "2"):
        with pytest.raises(ConfigError, match="slowdown"):
            BatchScheduler(engine, slowdown=bad)  # type: ignore[arg-type]


def test_batch_budget_keeps_drafts_within_the_steps_row_limit():
    """Drafts that pay for themselves in tokens per second are still cut where they would take
    the pass past the scheduler's row limit (the slowest gap between tokens)."""
    from specdec.control.batch import BatchBudget, BatchCosts, Candidate
    from specdec.control.budget import CostModel

    cheap = BatchCosts(CostModel(prior_slope=0.01, frozen=True))
    sure = [Candidate([0.95] * 4, 4)] * 8
    assert BatchBudget(4, cheap).choose(sure) == [4] * 8  # 40 rows
    limited = BatchBudget(4, cheap).choose(sure, max_rows=24)
    assert sum(limited) + 8 <= 24 and sum(limited) > 0
    assert BatchBudget(4, cheap).choose(sure, max_rows=8) == [0] * 8
    assert sum(BatchBudget(4, cheap).choose(sure, prompt=10, max_rows=20)) <= 2  # 8 + 10 + 2


def test_bad_batch_arguments_are_refused(tiny64):
    engine = SpeculativeEngine.from_pretrained(tiny64)
    with pytest.raises(ConfigError, match="max_batch"):
        BatchScheduler(engine, max_batch=0)
    with pytest.raises(InvalidRequestError, match="seeds"):
        engine.generate_batch(PROMPTS[:2], seeds=[1])
    with pytest.raises(InvalidRequestError, match="unknown"):
        engine.generate_batch(PROMPTS[:2], temprature=0.5)
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        engine.generate_batch(PROMPTS[:1], max_new_tokens=10_000)


def test_batch_budget_rests_after_declining_and_probes_again():
    """Once drafting was priced out, the budget skips asking the speculators until a probe is
    due; a long drafting run is interrupted by one plain step that keeps T(plain) measured."""
    from specdec.control.batch import BatchBudget, BatchCosts, Candidate
    from specdec.control.budget import CostModel

    dear = BatchCosts(CostModel(prior_slope=1.0, frozen=True))  # every row costs a full pass
    budget = BatchBudget(4, dear, probe_every=4)
    poor = [Candidate([0.1] * 4, 4, nodes=4, depth=4)] * 8
    assert budget.choose(poor) == [0] * 8 and budget.resting
    budget.rest()
    assert budget.resting
    budget.rest()
    assert not budget.resting  # the next step asks again: a probe is due
    assert budget.choose(poor) == [1] * 8
    cheap = BatchCosts(CostModel(prior_slope=0.0, frozen=True))
    eager = BatchBudget(4, cheap, probe_every=2)
    good = [Candidate([0.9] * 4, 4, nodes=4, depth=4)]
    choices = [eager.choose(good) for _ in range(8)]
    assert choices.count([0]) == 1 and choices[-1] == [0]


def test_probes_back_off_while_drafting_stays_priced_out():
    from specdec.control.batch import BatchBudget, BatchCosts, Candidate
    from specdec.control.budget import CostModel

    budget = BatchBudget(4, BatchCosts(CostModel(prior_slope=1.0, frozen=True)), probe_every=2)
    poor = [Candidate([0.1] * 4, 4, nodes=4, depth=4)] * 8
    probes = []
    for step in range(600):
        if budget.resting:
            budget.rest()
        elif budget.choose(poor) == [1] * 8:
            probes.append(step)
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] == 64 and gaps[0] < 16


def test_rows_outgrow_the_first_slot_reserve_outside_inference_mode(tiny64):
    """The slot buffers grow inside the verification pass (inference mode); committing,
    joining and leaving happen between passes, so a caller outside inference mode (the data
    generator) must still be able to run past the first reserve of slots."""
    from specdec.batch.cache import SLOT_STEP

    assert not torch.is_inference_mode_enabled()
    engine = SpeculativeEngine.from_pretrained(tiny64, speculator="none")
    out = engine.generate_batch(
        PROMPTS[:3], max_new_tokens=SLOT_STEP + 8, ignore_eos=True, max_batch=2
    )
    assert all(len(r.token_ids) == SLOT_STEP + 8 for r in out)


def test_packed_budget_lets_a_confident_sequence_draft_alone():
    """Compute-bound passes (every row costs the same): drafting for all is priced out, and
    padded passes (one length for all: every row pays the widest) never draft; packed ones let
    the one sequence whose drafts are nearly sure draft, and only it."""
    from specdec.control.batch import BatchBudget, BatchCosts, Candidate

    costs = BatchCosts()
    for rows in (16, 32, 64):
        costs.observe(rows, 0.1 + 0.005 * rows)  # T = 100 ms + 5 ms per row
    sure = Candidate([0.97] * 4, 4, nodes=4, depth=4)
    unsure = Candidate([0.2] * 4, 4, nodes=4, depth=4)
    batch = [sure] + [unsure] * 15
    packed = BatchBudget(4, costs, packed=True).choose(batch)
    assert packed[0] == 4 and packed[1:] == [0] * 15
    assert BatchBudget(4, costs, packed=False).choose(batch) == [0] * 16
    # alone, the unsure sequence's first node pays (a pass's fixed 100 ms dominates a row)
    assert BatchBudget(4, costs).choose([unsure])[0] >= 1


def test_a_prompt_chunk_in_the_pass_does_not_make_drafting_look_cheap():
    """A chunk of prompt tokens makes its pass slow per decoded token, but it is paid whatever
    is drafted. A node worth less than a token of the plain full batch must stay priced out in
    that pass too (it was drafted there: 0.94 of plain batching at 32 clients), while a node
    that pays without the chunk still pays with it."""
    from specdec.control.batch import BatchBudget, BatchCosts, Candidate

    costs = BatchCosts()
    for rows in (8, 32, 128):
        costs.observe(rows, 0.035 + 0.0037 * rows)  # this machine's bundled model, roughly
    middling = [Candidate([0.6] * 4, 4, nodes=4, depth=4)] * 32
    for prompt in (0, 64, 512):
        budget = BatchBudget(4, costs, overhead=1.0)
        assert budget.choose(middling, prompt=prompt) == [0] * 32, prompt
    sure = [Candidate([0.98] * 4, 4, nodes=4, depth=4)] + middling[1:]
    for prompt in (0, 64):  # (without the margin such a pass now also asks: the next test)
        budget = BatchBudget(4, costs, overhead=1.0, chunk_margin=1.0)
        assert budget.choose(sure, prompt=prompt)[0] == 4
    # folding the chunk into the other rows' price (the old rule) drafts the middling nodes
    assert any(BatchBudget(4, costs, overhead=1.0).choose(middling, others=[64]))


def test_drafts_in_a_prompt_carrying_pass_must_pay_twice_over():
    """That pass is the batch's slowest step, and its drafts lengthen the worst gap between
    tokens: a node that pays only thinly in a full batch is drafted in a plain pass but not in
    one carrying a chunk, while a small batch's good drafts (and a sure one) still are."""
    from specdec.control.batch import BatchBudget, BatchCosts, Candidate

    costs = BatchCosts()
    for rows in (8, 32, 128):
        costs.observe(rows, 0.035 + 0.0037 * rows)  # this machine's bundled model, roughly
    thin = [Candidate([0.75, 0.0, 0.0, 0.0], 4, nodes=1, depth=1)] * 16  # 0.75 per 3.7 ms row
    assert all(BatchBudget(4, costs, overhead=1.0).choose(thin))
    assert not any(BatchBudget(4, costs, overhead=1.0).choose(thin, prompt=64))
    assert all(BatchBudget(4, costs, overhead=1.0, chunk_margin=1.0).choose(thin, prompt=64))
    few = [Candidate([0.8] * 4, 4, nodes=4, depth=4)] * 3
    assert all(BatchBudget(4, costs, overhead=1.0).choose(few, prompt=64))
    # a probe (one node for every sequence) never lands in such a pass: it waits for the next
    budget = BatchBudget(4, costs, overhead=1.0)
    hopeless = [Candidate([0.05] * 4, 4, nodes=4, depth=4)] * 16
    for _ in range(3 * budget.probe_every):
        assert not any(budget.choose(hopeless, prompt=64))
    assert budget.choose(hopeless) == [1] * 16


def test_prompt_chunks_riding_verification_passes_keep_the_invariant(tiny64):
    """Rows attached empty take their prompts as prefixes of verification passes, a few tokens
    per pass beside other rows' random trees; a row whose prompt completes in a pass has its
    first tree verified behind it, or none (it decodes from the next pass). Every tree's logits
    equal its chain decoded solo after the row's whole committed context, and every row's cache
    equals a fresh prefill of its committed tokens after each pass (float64)."""
    rng = random.Random(1)
    vocab = tiny64.model.config.vocab_size
    target = BatchTarget(tiny64)
    assert target.packed
    target.enable_features()
    rows: list[dict] = []  # per row: committed tokens, root, prompt tokens still to come
    joined_in_pass = 0
    for step in range(40):
        if len(rows) < 5 and rng.random() < 0.5:
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 16))]
            row = target.attach(target.start_prefill(prompt))
            assert row == len(rows)
            rows.append({"committed": [], "root": prompt[-1], "pending": prompt[:-1]})
        if rows and rng.random() < 0.1:
            row = rng.randrange(len(rows))
            target.remove(row)
            last = rows.pop()
            if row < len(rows):
                rows[row] = last
        if not rows:
            continue
        trees, prefixes = [], []
        for state in rows:
            chunk = state["pending"][: rng.randrange(1, 6)]
            prefixes.append(chunk)
            completes = len(chunk) == len(state["pending"])
            if completes and (not chunk or rng.random() < 0.6):
                trees.append(_random_tree(rng, state["root"], vocab))
                joined_in_pass += bool(chunk)
            else:
                trees.append(None)
        logits = target.verify(trees, prefixes)
        assert target.last_rows == sum(
            len(p) + (0 if t is None else len(t)) for p, t in zip(prefixes, trees, strict=True)
        )
        paths = []
        for r, (state, tree, chunk) in enumerate(zip(rows, trees, prefixes, strict=True)):
            if tree is None:
                assert logits[r] is None
                paths.append(None)
                continue
            row_logits = logits[r]
            assert row_logits is not None and row_logits.shape[0] == len(tree)
            node = len(tree) - 1
            path = tree.path_to(node)
            solo = ModelRunner(tiny64.model)
            context = state["committed"] + chunk + [tree.tokens[i] for i in path]
            expect = solo.forward(context)[-1]
            assert torch.allclose(row_logits[node], expect, atol=1e-9), (step, r)
            paths.append(_random_path(rng, tree))
        target.commit(paths)
        for state, tree, chunk, path in zip(rows, trees, prefixes, paths, strict=True):
            state["committed"] = state["committed"] + chunk
            state["pending"] = state["pending"][len(chunk) :]
            if tree is not None:
                state["committed"] += [tree.tokens[i] for i in path]
                state["root"] = rng.randrange(vocab)
        for r, state in enumerate(rows):
            tokens = state["committed"]
            feats = target.features[r]
            if not tokens:
                continue
            fresh = ModelRunner(tiny64.model)
            fresh.forward(tokens)
            for layer, mine in zip(fresh.cache.hf.layers, target.cache.row_entries(r), strict=True):
                assert mine is not None
                assert torch.allclose(mine[0], layer.keys[0], atol=1e-9), (step, r)
                assert torch.allclose(mine[1], layer.values[0], atol=1e-9), (step, r)
            if state["pending"]:  # mid-prompt: the features of every prompt token so far
                assert feats is not None and feats.shape[0] == len(tokens)
    assert joined_in_pass > 3


def test_separate_prefill_passes_equal_solo_too(tiny64):
    """The path a padded target takes (prompts prefilled in passes of their own)."""
    engine = SpeculativeEngine.from_pretrained(
        tiny64, speculator="prompt-lookup", num_draft_tokens=4, adaptive=False
    )
    solo = [engine.generate(p, max_new_tokens=24, ignore_eos=True).token_ids for p in PROMPTS]
    scheduler = BatchScheduler(engine, max_batch=3, fused=False)
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True, sampling=SamplingConfig())
    seqs = [scheduler.add(engine.encode(p), config) for p in PROMPTS]
    out: dict[int, list[int]] = {s.id: [] for s in seqs}
    for seq, event in scheduler.run():
        out[seq.id].extend(event.token_ids)
    assert [out[s.id] for s in seqs] == solo
