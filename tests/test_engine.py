"""The decoding loop on real tiny models: cache invariant, stop conditions, streaming, seeds,
sampling distribution of a real model."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from specdec import SpeculativeEngine
from specdec.cache import KVCache
from specdec.config import SamplingConfig
from specdec.speculators import DraftModelSpeculator
from specdec.target import ModelRunner, load_model
from specdec.testing import MarkovTarget, ScriptedSpeculator, word_tokenizer
from specdec.tree import DraftTree
from specdec.verify import probs_from_logits

PROMPT = "ROMEO: But soft, what light through yonder window breaks?"


@pytest.fixture(scope="module")
def tiny32(tiny_model_dir: Path):
    return load_model(tiny_model_dir)


def fresh_cache(model, tokens: list[int]) -> KVCache:
    runner = ModelRunner(model)
    runner.forward(tokens)
    return runner.cache


def assert_cache_equals_prefill(cache: KVCache, model) -> None:
    ref = fresh_cache(model, cache.tokens)
    assert len(cache.hf.layers) == len(ref.hf.layers)
    for got, want in zip(cache.hf.layers, ref.hf.layers, strict=False):
        assert got.keys.shape == want.keys.shape
        torch.testing.assert_close(got.keys, want.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.values, want.values, atol=1e-4, rtol=1e-4)


def test_kv_cache_invariant_after_mixed_accept_reject(tiny32):
    """After every step the target cache holds exactly the committed tokens but the last, and
    equals a fresh prefill of them; the draft's cache likewise after its rollback."""
    engine = SpeculativeEngine.from_pretrained(
        tiny32, speculator="draft:layers:2", num_draft_tokens=4, adaptive=False
    )
    prompt_ids = engine.encode(PROMPT)
    committed = list(prompt_ids)
    accepted_counts = []
    from specdec.config import GenerationConfig

    for event in engine.stream_ids(
        prompt_ids, GenerationConfig(max_new_tokens=40, ignore_eos=True)
    ):
        committed.extend(event.token_ids)
        accepted_counts.append(len(event.token_ids))
        cache = engine.target.runner.cache
        if event.finish_reason is None:
            assert cache.tokens == committed[:-1]
        assert_cache_equals_prefill(cache, tiny32.model)
    assert max(accepted_counts) > 1 and min(accepted_counts) == 1  # both accepts and rejects
    assert isinstance(engine.speculator, DraftModelSpeculator)
    assert_cache_equals_prefill(engine.speculator.runner.cache, engine.speculator.runner.model)


def test_tree_verification_and_compaction(tiny32):
    """Tree-forward logits equal each root-to-node path's own forward, and committing a
    non-contiguous path compacts the cache to equal a fresh prefill of that path."""
    model = tiny32.model
    runner = ModelRunner(model)
    prefix = [5, 17, 42, 8]
    runner.forward(prefix)
    tree = DraftTree(tokens=(9, 30, 31, 32, 33, 34), parents=(-1, 0, 0, 1, 2, 2))
    logits = runner.forward_tree(tree)  # [6, V]
    for node in range(len(tree)):
        path = [tree.tokens[i] for i in tree.path_to(node)]
        ref = ModelRunner(model).forward(prefix + path)[-1]
        torch.testing.assert_close(logits[node], ref, atol=1e-4, rtol=1e-4)
    runner.cache.commit(len(prefix), [0, 2, 5])
    assert runner.cache.tokens == prefix + [9, 31, 34]
    assert_cache_equals_prefill(runner.cache, model)


def oracle_engine(engine: SpeculativeEngine, plain_ids: list[int], k: int) -> SpeculativeEngine:
    """Same target, drafting the true greedy continuation: everything is accepted, in bulk."""
    n_prompt = len(engine.encode(PROMPT))
    script = {n_prompt + i: plain_ids[i : i + k] for i in range(len(plain_ids))}
    return SpeculativeEngine(
        engine.target,
        engine.tokenizer,
        ScriptedSpeculator(script),
        num_draft_tokens=k,
        adaptive=False,
    )


def test_all_accepted_drafts_past_max_new_tokens_are_not_emitted(tiny32):
    engine = SpeculativeEngine.from_pretrained(tiny32)
    plain = engine.generate(PROMPT, max_new_tokens=20, ignore_eos=True, speculate=False)
    oracle = oracle_engine(engine, plain.token_ids, 8)
    for limit in (1, 5, 7, 9):
        res = oracle.generate(PROMPT, max_new_tokens=limit, ignore_eos=True)
        assert res.token_ids == plain.token_ids[:limit]
        assert res.finish_reason == "length"
    res = oracle.generate(PROMPT, max_new_tokens=18, ignore_eos=True)
    assert res.stats.target_forwards == 2  # 8 drafts + bonus, then 8 more, cut at 18
    assert res.stats.mean_accepted == 9.0


def test_stop_string_in_bulk_acceptance(tiny32):
    engine = SpeculativeEngine.from_pretrained(tiny32)
    plain = engine.generate(PROMPT, max_new_tokens=30, ignore_eos=True, speculate=False)
    text = plain.text
    # a stop string of whole characters: a partly decoded byte sequence reads as U+FFFD, which
    # would match the stop one token early
    start = next(i for i in range(len(text) // 2, len(text) - 3) if "\ufffd" not in text[i : i + 4])
    stop = text[start : start + 3]
    oracle = oracle_engine(engine, plain.token_ids, 10)
    for eng in (engine, oracle):
        res = eng.generate(PROMPT, max_new_tokens=30, ignore_eos=True, stop=[stop])
        assert res.finish_reason == "stop"
        assert res.text == text[: text.find(stop)]
        assert stop not in res.text
        assert res.token_ids == plain.token_ids[: len(res.token_ids)]
        # tokens end with the one that completed the stop string, none after it
        assert stop in engine.tokenizer.decode(res.token_ids)
        assert stop not in engine.tokenizer.decode(res.token_ids[:-1])


def test_eos_in_bulk_acceptance_ends_the_request():
    v = 4
    table = torch.full((v + 1, v + 1), -5.0)
    table[0, 1] = table[1, 2] = table[2, v] = table[v, 3] = 5.0  # 0 -> 1 -> 2 -> EOS -> 3
    script = {1: [1, 2, v, 3, 3]}
    engine = SpeculativeEngine(
        MarkovTarget(table),
        word_tokenizer(v),
        ScriptedSpeculator(script),
        num_draft_tokens=5,
        adaptive=False,
    )
    from specdec.config import GenerationConfig

    events = list(engine.stream_ids([0], GenerationConfig(max_new_tokens=10)))
    assert [e.token_ids for e in events] == [(1, 2)]
    assert events[-1].finish_reason == "stop" and events[-1].text.split() == ["t1", "t2"]


def test_stream_deltas_concatenate_to_generate_text(tiny32):
    engine = SpeculativeEngine.from_pretrained(tiny32, speculator="prompt-lookup")
    events = list(engine.stream(PROMPT, max_new_tokens=30))
    res = engine.generate(PROMPT, max_new_tokens=30)
    assert "".join(e.text for e in events) == res.text
    assert [t for e in events for t in e.token_ids] == res.token_ids
    assert all(e.finish_reason is None for e in events[:-1]) and events[-1].finish_reason
    assert res.text == engine.tokenizer.decode(res.token_ids, skip_special_tokens=True)


def test_chat_messages_use_the_chat_template(tiny32):
    engine = SpeculativeEngine.from_pretrained(tiny32)
    msgs = [{"role": "user", "content": "Speak, speak."}]
    ids = engine.encode(msgs)
    assert ids == engine.encode("Speak, speak.", chat=True)
    assert ids != engine.encode("Speak, speak.")
    assert engine.generate(msgs, max_new_tokens=5).stats.prompt_tokens == len(ids)


def test_seeded_sampling_is_reproducible(tiny32):
    engine = SpeculativeEngine.from_pretrained(tiny32, speculator="draft:layers:2")
    kw = dict(max_new_tokens=25, temperature=0.9, top_p=0.95, ignore_eos=True)
    a = engine.generate(PROMPT, seed=7, **kw)
    b = engine.generate(PROMPT, seed=7, **kw)
    c = engine.generate(PROMPT, seed=8, **kw)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


@pytest.mark.slow(threads=1)
def test_real_model_sampling_distribution_of_two_tokens(tiny_model_dir):
    """A real (tiny) HF target and its 1-layer early-exit draft, float64, top-k 3, T = 1:
    the joint of the first two sampled tokens matches the exact p(x1) p(x2 | x1)."""
    loaded = load_model(tiny_model_dir, dtype="float64")
    cfg = SamplingConfig(temperature=1.0, top_k=3)
    engine = SpeculativeEngine.from_pretrained(
        loaded, speculator="draft:layers:1", num_draft_tokens=3, adaptive=False
    )
    prompt_ids = engine.encode(PROMPT)
    runner = ModelRunner(loaded.model)
    p1 = probs_from_logits(runner.forward(prompt_ids)[-1:], cfg)[0]
    exact = {}
    for a in torch.nonzero(p1).flatten().tolist():
        r = ModelRunner(loaded.model)
        p2 = probs_from_logits(r.forward(prompt_ids + [a])[-1:], cfg)[0]
        for b in torch.nonzero(p2).flatten().tolist():
            exact[(a, b)] = float(p1[a] * p2[b])
    n = 1000
    counts: Counter = Counter()
    from specdec.config import GenerationConfig

    for seed in range(n):
        config = GenerationConfig(
            max_new_tokens=2,
            ignore_eos=True,
            sampling=SamplingConfig(temperature=1.0, top_k=3, seed=seed),
        )
        ids = list(
            itertools.chain.from_iterable(
                e.token_ids for e in engine.stream_ids(prompt_ids, config)
            )
        )
        counts[tuple(ids)] += 1
    assert set(counts) <= set(exact)
    keys = sorted(exact)
    pvalue = chisquare([counts[k] for k in keys], [exact[k] * n for k in keys]).pvalue
    assert pvalue > 1e-3, pvalue
