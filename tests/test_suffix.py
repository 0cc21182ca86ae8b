"""SuffixDecoding: the suffix index against brute force, the frequency-scored trees, the bounded
and persistable global cache, greedy equivalence on tiny real models, learning across requests,
and losslessness of its branching deterministic trees under sampling."""

from __future__ import annotations

import doctest
import random
import threading

import pytest
import torch

from specdec import SpeculativeEngine
from specdec.config import SamplingConfig
from specdec.errors import CheckpointError, ConfigError
from specdec.speculators import options_for, suffix, suffix_index
from specdec.speculators.base import DraftContext, build_speculator
from specdec.speculators.suffix import SuffixCache, SuffixSpeculator
from specdec.speculators.suffix_index import SuffixIndex, expand_tree


def ctx(tokens: list[int]) -> DraftContext:
    return DraftContext(list(tokens), len(tokens), SamplingConfig(), torch.Generator())


def test_doctests():
    for module in (suffix_index, suffix):
        assert doctest.testmod(module).failed == 0


# -- the index ---------------------------------------------------------------------------------
def test_insertion_counts_are_trie_counts():
    index = SuffixIndex(max_depth=3)
    index.add_document([1, 2, 3, 1, 2, 4, 1, 2, 3])
    assert index.count([1]) == 3
    assert index.count([1, 2]) == 3
    assert index.count([1, 2, 3]) == 2
    assert index.count([2, 4]) == 1
    assert index.count([3, 1, 2]) == 1
    assert index.count([4, 4]) == 0
    assert index.count([1, 2, 3, 1]) == 0  # deeper than max_depth: not a trie node
    index.add_document([2, 3])  # a second document adds to the same counts
    assert index.count([2, 3]) == 3
    assert index.count([3, 2]) == 0  # documents do not run into each other


def test_left_context_and_open_documents():
    index = SuffixIndex(max_depth=4)
    # prompt tail [7, 8] as left context: only its last token is an occurrence end
    index.add_document([7, 8, 5, 6], context_len=2)
    assert index.count([7]) == 0 and index.count([8]) == 1 and index.count([7, 8]) == 1
    # an open document's final token is the query's end: not indexed until a token follows
    index.add_document([1, 2], open=True)
    assert index.count([2]) == 0
    index.extend([3])
    assert index.count([2]) == 1 and index.count([3]) == 0


def test_longest_suffix_match():
    index = SuffixIndex(max_depth=8)
    index.add_document([5, 1, 2, 3, 9, 2, 3, 9, 1, 2, 3, 4])
    matches = index.match([0, 1, 2, 3])
    assert [(m.length, m.count) for m in matches] == [(1, 3), (2, 3), (3, 2)]
    assert index.match([0, 1, 2, 3], min_length=3)[-1].length == 3
    assert index.match([42]) == []


def naive_count(docs: list[tuple[list[int], int]], pattern: list[int]) -> int:
    n, total = len(pattern), 0
    for tokens, context in docs:
        for j in range(max(0, context - 1), len(tokens)):
            total += j - n + 1 >= 0 and tokens[j - n + 1 : j + 1] == pattern
    return total


@pytest.mark.parametrize("seed", range(4))
def test_index_agrees_with_brute_force(seed):
    """Random documents (single inserts, bulk batches, bulk loads, evictions) over a tiny
    vocabulary, so patterns repeat a lot: every count equals a brute-force scan."""
    rng = random.Random(seed)
    depth = rng.choice([2, 3, 6])
    index, docs = SuffixIndex(depth), []
    for _ in range(8):
        n = rng.randint(0, rng.choice([5, 40, 400]))
        tokens = [rng.randrange(3) for _ in range(n)]
        context = rng.randint(0, n)
        if rng.random() < 0.3:
            index.load_documents([(tokens, context)])
        else:
            index.add_document(tokens, context)
        docs.append((tokens, context))
        if rng.random() < 0.25:
            k = rng.randint(1, len(docs))
            index.evict_oldest(k)
            docs = docs[k:]
    for _ in range(60):
        pattern = [rng.randrange(3) for _ in range(rng.randint(1, depth))]
        assert index.count(pattern) == naive_count(docs, pattern), pattern
    assert index.documents() == docs


# -- frequency-scored trees --------------------------------------------------------------------
def test_tree_orders_nodes_by_path_frequency():
    """After "1 2": "3 4" three times, "3 5" once, "6" once. Path probabilities: 3 -> 0.8,
    3 4 -> 0.6, 6 -> 0.2, 3 5 -> 0.2; the greedy tree takes them in that order."""
    cache = SuffixCache()
    for cont in ([3, 4], [3, 4], [3, 4], [3, 5], [6]):
        cache.add([1, 2, *cont])
    spec = SuffixSpeculator(cache, alpha=4.0, min_token_prob=0.1)
    tree = spec.propose(ctx([9, 1, 2]), budget=100)
    assert tree.tokens == (2, 3, 4, 6, 5)
    assert tree.parents == (-1, 0, 1, 0, 1)
    assert tree.draft_probs is None
    # a higher probability floor prunes the rare branches
    tree = SuffixSpeculator(cache, alpha=4.0, min_token_prob=0.5).propose(ctx([9, 1, 2]), 100)
    assert tree.tokens == (2, 3, 4)


def test_expand_tree_counts_ended_occurrences_in_the_parent_only():
    corpus = [1, 7, -1, 1, 7, -1, 1, -1, 1, -1]  # after "1": 7 twice, nothing twice
    tokens, parents, score = expand_tree(corpus, [0, 3, 6, 8], max_nodes=4, min_prob=0.0)
    assert (tokens, parents, score) == ((7,), (0,), 0.5)


def test_draft_size_adapts_to_match_length():
    rng = random.Random(0)
    text = [rng.randrange(1000) for _ in range(200)]
    cache = SuffixCache()
    cache.add(text)
    for alpha, cap in ((1.0, 32), (2.0, 32), (1.0, 5)):
        spec = SuffixSpeculator(cache, alpha=alpha, max_spec_tokens=cap)
        for p in (2, 3, 8, 20, 40):
            spec.reset()  # each context is a new request
            tree = spec.propose(ctx([5000, *text[50 - p : 50]]), budget=100)
            assert tree.num_drafted == min(cap, int(alpha * p), spec.max_depth * alpha)
            assert tree.is_chain and list(tree.tokens[1:]) == text[50 : 50 + tree.num_drafted]
    spec.reset()
    assert spec.propose(ctx([5000, *text[40:50]]), budget=3).num_drafted == 3  # engine budget


def test_nothing_matches_gives_the_root_alone():
    spec = SuffixSpeculator()
    spec.cache.add([1, 2, 3])
    tree = spec.propose(ctx([7, 8, 9]), budget=10)
    assert tree.tokens == (9,) and tree.parents == (-1,)
    tree = spec.propose(ctx([7, 8, 9, 2]), budget=10)  # a single shared token: too weak
    assert tree.num_drafted == 0


def test_per_request_index_and_reset():
    spec = SuffixSpeculator()
    tokens = [1, 2, 3, 4, 5, 1, 2]
    assert spec.propose(ctx(tokens), 10).tokens == (2, 3, 4)
    tokens += [3, 4]  # the request grew: indexed incrementally
    assert spec.propose(ctx(tokens), 10).tokens[:2] == (4, 5)
    spec.reset()  # a new request forgets the old one's text...
    assert spec.propose(ctx([8, 1, 2]), 10).num_drafted == 0
    spec.end_request([8, 1, 2, 3, 4], prompt_len=3)  # ...unless it was added to the cache
    spec.reset()
    assert spec.propose(ctx([6, 1, 2]), 10).tokens == (2, 3, 4)


# -- the global cache ----------------------------------------------------------------------------
def test_eviction_bounds_tokens_and_removes_the_evicted_counts():
    cache = SuffixCache(max_tokens=100)
    for i in range(10):
        cache.add([1000 + i, 1000 + i, 7, 7, 7] + [50] * 25)  # 30 tokens each
        assert cache.num_tokens <= 100
    assert cache.num_documents == 3
    assert cache.count([1000, 1000]) == 0  # the oldest documents' own patterns are gone
    assert cache.count([1009, 1009]) == 1
    assert cache.count([7, 7]) == 3 * 2  # shared patterns keep only the kept documents' counts


def test_eviction_memory_stays_bounded():
    cache = SuffixCache(max_tokens=2_000, max_depth=8)
    rng = random.Random(1)
    for _ in range(200):
        cache.add([rng.randrange(50) for _ in range(100)], context=[1, 2, 3])
    index = cache._index
    assert cache.num_tokens <= 2_000
    assert len(index.sa) <= 2_000 and len(index.corpus) <= 2_000 + 8 * cache.num_documents


def test_save_load_round_trip_gives_identical_proposals(tmp_path):
    rng = random.Random(2)
    cache = SuffixCache(max_tokens=5_000)
    for _ in range(30):
        cache.add([rng.randrange(20) for _ in range(60)], context=[rng.randrange(20)] * 3)
    path = tmp_path / "sub" / "cache.safetensors"
    cache.save(path)
    loaded = SuffixCache.load(path)
    assert (loaded.num_tokens, loaded.num_documents, loaded.max_tokens, loaded.max_depth) == (
        cache.num_tokens,
        cache.num_documents,
        5_000,
        cache.max_depth,
    )
    a, b = SuffixSpeculator(cache), SuffixSpeculator(loaded)
    for _ in range(50):
        context = [rng.randrange(20) for _ in range(rng.randint(1, 40))]
        ta, tb = a.propose(ctx(context), 50), b.propose(ctx(context), 50)
        assert (ta.tokens, ta.parents) == (tb.tokens, tb.parents)
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    # a smaller cap on load keeps the newest documents
    small = SuffixCache.load(path, max_tokens=200)
    assert small.num_tokens <= 200 and small.num_documents == 3


def test_unreadable_cache_file_raises_checkpoint_error_naming_it(tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00\x01 not a safetensors file")
    with pytest.raises(CheckpointError, match="garbage.safetensors"):
        SuffixCache.load(garbage)
    cache = SuffixCache()
    cache.add(list(range(100)))
    good = tmp_path / "good.safetensors"
    cache.save(good)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-50])
    with pytest.raises(CheckpointError, match="truncated.safetensors"):
        SuffixCache.load(truncated)
    import numpy as np
    from safetensors.numpy import save_file

    other = tmp_path / "other.safetensors"
    save_file({"weight": np.zeros(3, dtype=np.float32)}, str(other))
    with pytest.raises(CheckpointError, match="other.safetensors"):
        SuffixCache.load(other)
    with pytest.raises(CheckpointError, match="missing.safetensors"):
        SuffixCache.load(tmp_path / "missing.safetensors")


def test_factory_loads_and_saves_the_configured_cache(tmp_path):
    path = tmp_path / "suffix.safetensors"
    config = options_for("suffix", cache=str(path))
    spec = build_speculator(None, config)  # type: ignore[arg-type]  # the target is unused
    assert isinstance(spec, SuffixSpeculator) and spec.cache.num_tokens == 0
    spec.end_request([1, 2, 3, 4, 5, 6], prompt_len=2)
    assert path.is_file()
    again = build_speculator(None, config)  # type: ignore[arg-type]
    assert again.cache.num_tokens == spec.cache.num_tokens == 6
    again.reset()
    assert again.propose(ctx([9, 1, 2]), 10).tokens == (2, 3, 4)


def test_bad_settings_raise_config_error():
    with pytest.raises(ConfigError):
        SuffixSpeculator(alpha=0)
    with pytest.raises(ConfigError):
        SuffixCache(max_tokens=0)


def test_threads_can_share_one_cache():
    cache = SuffixCache(max_tokens=3_000)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            rng = random.Random(seed)
            spec = SuffixSpeculator(cache)
            for _ in range(40):
                spec.reset()
                tokens = [rng.randrange(30) for _ in range(20)]
                for _ in range(5):
                    tree = spec.propose(ctx(tokens), 16)
                    tokens += [*tree.tokens[1:2], rng.randrange(30)]
                spec.end_request(tokens, prompt_len=20)
        except BaseException as e:  # noqa: BLE001  (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert 0 < cache.num_tokens <= 3_000
    index = cache._index
    keys = [index._key(j) for j in index.sa]
    assert keys == sorted(keys)  # no interleaved insertion broke the order


# -- engine level --------------------------------------------------------------------------------
PROMPTS = [
    "ROMEO: But soft, what light",
    "First Citizen:\nBefore we proceed any further, hear me speak. Speak, speak. Before we",
    "the the the the the the the",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind",
]


def test_greedy_equals_plain_on_a_tiny_model(tiny64):
    engine = SpeculativeEngine.from_pretrained(tiny64, speculator="suffix")
    drafted = 0
    for prompt in PROMPTS + PROMPTS:  # the second round drafts from the learned cache
        plain = engine.generate(prompt, max_new_tokens=40, ignore_eos=True, speculate=False)
        spec = engine.generate(prompt, max_new_tokens=40, ignore_eos=True)
        assert spec.token_ids == plain.token_ids, prompt
        assert spec.stats.target_forwards <= plain.stats.target_forwards
        drafted += spec.stats.drafted_tokens
    assert drafted > 0


def test_the_cache_learns_across_requests(tiny64):
    engine = SpeculativeEngine.from_pretrained(tiny64, speculator="suffix")
    prompt = "KING RICHARD III: Now is the winter of our discontent made glorious summer by"
    first = engine.generate(prompt, max_new_tokens=48, ignore_eos=True)
    second = engine.generate(prompt, max_new_tokens=48, ignore_eos=True)
    assert second.token_ids == first.token_ids
    assert second.stats.mean_accepted > first.stats.mean_accepted
    assert second.stats.mean_accepted > 3.0  # the earlier answer is drafted from step one


@pytest.mark.slow(threads=1)
def test_branching_suffix_trees_are_lossless_under_sampling():
    """The Markov setup of test_losslessness with a suffix speculator pre-filled with text from
    the (different) draft chain, so its trees branch where that text did; it keeps learning
    from each sampled request. The joint of 4 sampled tokens must match p exactly."""
    from test_losslessness import ALPHA, N_NEW, SAMPLES, V, lossless_pvalue, make_engine, tables

    from specdec.verify import probs_from_logits, sample

    _, draft = tables()
    q = probs_from_logits(draft, SamplingConfig(temperature=1.0))  # [V, V]
    g = torch.Generator().manual_seed(7)
    cache = SuffixCache()
    for _ in range(60):
        doc = [int(torch.randint(V, (1,), generator=g))]
        for _ in range(12):
            doc.append(sample(q[doc[-1]], g))
        cache.add(doc)

    class Recording(SuffixSpeculator):
        branching = steps = 0

        def propose(self, context, budget):
            tree = super().propose(context, budget)
            self.steps += 1
            self.branching += any(len(c) > 1 for c in tree.children)
            return tree

    spec = Recording(cache, min_match_length=1, alpha=3.0, min_token_prob=0.05, max_occurrences=16)
    engine = make_engine(speculator=spec)
    pvalue = lossless_pvalue(engine)
    assert pvalue > ALPHA, f"suffix trees depart from p (chi-square p = {pvalue:.2e})"
    assert spec.branching > 0.3 * spec.steps  # the trees really branched
    assert engine.target.forwards < SAMPLES * N_NEW * 0.8  # multi-token acceptance happened
