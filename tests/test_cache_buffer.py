"""The in-place KV cache layer: the same entries as Hugging Face's concatenating ``DynamicLayer``
through appends, crops, tree-path commits, buffer growth and outside replacement."""

from __future__ import annotations

import random

import torch
from transformers import LlamaConfig
from transformers.cache_utils import DynamicLayer

from specdec.cache import KVCache
from specdec.cache.buffer import MIN_SLOTS, BufferLayer


def _config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def _entries(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, 2, n, 8, generator=gen), torch.randn(1, 2, n, 8, generator=gen)


def test_layers_are_buffer_layers_viewing_their_buffers():
    cache = KVCache(_config())
    assert all(type(layer) is BufferLayer for layer in cache.hf.layers)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        k, v = _entries(5, gen)
        keys, values = cache.hf.update(k, v, 0)
    layer = cache.hf.layers[0]
    assert keys.shape == (1, 2, 5, 8) and torch.equal(keys, k) and torch.equal(values, v)
    assert layer._key_buffer is not None and layer._key_buffer.shape[-2] == MIN_SLOTS
    assert keys.data_ptr() == layer._key_buffer.data_ptr()  # a view, not a copy
    cache.appended([1, 2, 3, 4, 5])  # a rollback-able layer as far as the runner is concerned
    cache.check_rollback_supported()


def test_random_appends_rollbacks_and_commits_match_concatenation():
    """Against a plain ``DynamicLayer`` driven by the same operations (and ``torch.cat``
    compaction, the former commit), bit for bit, across several buffer growths."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(_config())
    ref = DynamicLayer()
    for step in range(120):
        n = len(cache)
        t = rng.choice([1, 1, 3, 8, 40])
        k, v = _entries(t, gen)
        with torch.inference_mode():
            for i in range(3):
                got_k, got_v = cache.hf.update(k + i, v - i, i)
            want_k, want_v = ref.update(k, v)
        cache.appended(list(range(t)))
        assert torch.equal(got_k, want_k + 2) and torch.equal(got_v, want_v - 2), step
        action = rng.choice(["keep", "rollback", "commit"])
        if action == "rollback":
            length = rng.randint(n, n + t)
            cache.rollback(length)
            if n + t - length:
                ref.crop(-(n + t - length))
        elif action == "commit":
            keep = sorted(rng.sample(range(t), rng.randint(1, t)))
            cache.commit(n, keep)
            idx = torch.tensor(keep) + n
            with torch.inference_mode():
                ref.keys = torch.cat([ref.keys[..., :n, :], ref.keys[..., idx, :]], -2)
                ref.values = torch.cat([ref.values[..., :n, :], ref.values[..., idx, :]], -2)
        for i, layer in enumerate(cache.hf.layers):
            assert torch.equal(layer.keys, ref.keys + i), (step, action)
            assert torch.equal(layer.values, ref.values - i), (step, action)
        assert layer.get_seq_length() == len(cache) == ref.get_seq_length()
    assert len(cache) > MIN_SLOTS * 2  # grown more than once on the way


def test_replaced_entries_are_adopted_on_the_next_update():
    """Code that assigns ``keys``/``values`` a new tensor (as ``DynamicLayer`` allows) is
    followed: the next update appends to what was assigned."""
    gen = torch.Generator().manual_seed(1)
    layer = BufferLayer()
    with torch.inference_mode():
        layer.update(*_entries(4, gen))
        k, v = _entries(3, gen)
        layer.keys, layer.values = k.clone(), v.clone()
        k2, v2 = _entries(2, gen)
        keys, values = layer.update(k2, v2)
    assert torch.equal(keys, torch.cat([k, k2], -2)) and torch.equal(values, torch.cat([v, v2], -2))


def test_reset_forgets_the_buffers():
    gen = torch.Generator().manual_seed(2)
    cache = KVCache(_config())
    with torch.inference_mode():
        cache.hf.update(*_entries(4, gen), 0)
    cache.appended([1, 2, 3, 4])
    cache.reset()
    assert len(cache) == 0 and cache.hf.get_seq_length() == 0
    with torch.inference_mode():
        k, v = _entries(2, gen)
        keys, _ = cache.hf.update(k, v, 0)
    assert torch.equal(keys, k)
