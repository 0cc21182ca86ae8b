"""The lean kquant modules (:mod:`specdec.target.kquant_layers`): each extension call against
the torch computation it replaces, the fused projections bit for bit against the separate ones,
and the forward close to HF's modules. tests/test_kquant.py checks, with and without these
modules, that the forward is row-invariant bit for bit (chains and trees) and that greedy
speculation equals plain greedy decoding.
Tiny random-block models only (tests/test_kquant.py builds them).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specdec.cache.buffer import BufferLayer
from specdec.target import ModelRunner, load_model
from specdec.target.attention import rowwise_sdpa_attention
from specdec.target.kquant import KQuantLinear, extension
from specdec.target.kquant_layers import (
    FusedRows,
    KQuantAttention,
    KQuantMLP,
    KQuantRMSNorm,
    fuse_runs,
    use_lean_layers,
)
from specdec.tree import DraftTree
from tests.test_kquant import kquant_model, random_blocks

pytestmark = pytest.mark.slow(threads=1)  # the kernel compiles once per session: over a minute


def _lean_model(tiny_tokenizer_dir, tmp_path, seed):
    return kquant_model(tiny_tokenizer_dir, tmp_path, seed, lean=True)


def test_the_scheme_swaps_in_the_lean_modules(tiny_tokenizer_dir, tmp_path):
    loaded = _lean_model(tiny_tokenizer_dir, tmp_path, seed=3)
    for layer in loaded.model.model.layers:
        assert isinstance(layer.self_attn, KQuantAttention)
        assert isinstance(layer.mlp, KQuantMLP)
        assert isinstance(layer.input_layernorm, KQuantRMSNorm)
        assert isinstance(layer.self_attn.q_proj, KQuantLinear)  # the same module paths
    assert isinstance(loaded.model.model.norm, KQuantRMSNorm)


def test_other_models_keep_their_modules(tiny_model_dir):
    loaded = load_model(tiny_model_dir, dtype="int8-dynamic")
    assert use_lean_layers(loaded.model) == 0


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_fused_rows_give_each_layer_its_own_bits(kind):
    widths = (256, 64, 128)
    layers = [
        KQuantLinear.from_gguf(kind, random_blocks(kind, n, 512, seed=i), 512, torch.randn(n))
        for i, n in enumerate(widths)
    ]
    x = torch.randn(5, 512)
    alone = [layer(x) for layer in layers]
    fused = FusedRows(layers)
    for got, want in zip(fused(x), alone, strict=True):
        assert torch.equal(got, want)
    for layer, want in zip(layers, alone, strict=True):  # the layers now view the fused rows
        assert torch.equal(layer(x), want)
    assert layers[0].codes.data_ptr() == fused.linear.codes.data_ptr()


def test_runs_of_one_kind_are_fused():
    q4 = [KQuantLinear.from_gguf("Q4_K", random_blocks("Q4_K", 16, 256, s), 256) for s in (1, 2)]
    q6 = KQuantLinear.from_gguf("Q6_K", random_blocks("Q6_K", 16, 256, 3), 256)
    groups = fuse_runs([*q4, q6])
    assert [len(g.widths) for g in groups] == [2, 1] and groups[1].linear is q6


def test_rms_norm_is_hfs_bit_for_bit():
    x = torch.randn(7, 1536) * 3
    w = torch.randn(1536)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    got = extension().rms_norm(x, w, 1e-6)
    assert torch.equal(got, want)  # HF's operators in HF's order: the same bits
    assert torch.equal(extension().rms_norm(x[3:4], w, 1e-6), got[3:4])


def test_rope_is_hfs_bit_for_bit():
    t, heads, d = 5, 3, 64
    x = torch.randn(t, heads, d)
    angles = torch.randn(t, d // 2).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    want, _ = apply_rotary_pos_emb(
        x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None]
    )
    got = x.clone()
    extension().rope_(got, cos, sin)
    assert torch.equal(got, want[0].transpose(0, 1))  # the same roundings, bit for bit


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("masked", ["causal", "tree"])
def test_attention_matches_rowwise_attention(masked, portable):
    t, n, heads, kv_heads, d = 4, 37, 6, 2, 32
    q = torch.randn(t, heads, d)
    buffer = torch.randn(2, kv_heads, 64, d)  # views of a bigger buffer, as the cache gives
    keys, values = buffer[0, :, :n], buffer[1, :, :n]
    allowed = None
    if masked == "tree":
        allowed = torch.ones(t, n, dtype=torch.bool).tril(n - t)
        allowed[2, n - t + 1] = False  # node 2 does not see node 1
    got = extension().attention(q, keys, values, allowed, d**-0.5, portable)
    mask = None if allowed is None else allowed[None, None]
    want, _ = rowwise_sdpa_attention(
        None, q.transpose(0, 1)[None], keys[None], values[None], mask, scaling=d**-0.5
    )
    torch.testing.assert_close(got, want[0].reshape(t, -1), rtol=1e-5, atol=1e-6)


def test_the_lean_forward_stays_close_to_hf_modules(tiny_tokenizer_dir, tmp_path):
    hf = kquant_model(tiny_tokenizer_dir, tmp_path, seed=4)
    lean = _lean_model(tiny_tokenizer_dir, tmp_path, seed=4)
    prompt = hf.tokenizer("First Citizen:\nBefore we proceed any further")["input_ids"]
    long = prompt * 8  # over ROWWISE_MAX_ROWS: the prefill path
    for tokens in (prompt, long):
        want = ModelRunner(hf.model).forward(tokens)
        got = ModelRunner(lean.model).forward(tokens)
        scale = want.abs().max()
        assert (got - want).abs().max() < 0.05 * scale
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_hidden_states_are_still_recorded(tiny_tokenizer_dir, tmp_path):
    """The lean layers stay instances of the model's decoder-layer class, so transformers still
    records their outputs as hidden states (what EAGLE and Medusa read)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    states = []
    for lean in (False, True):
        loaded = kquant_model(tiny_tokenizer_dir, tmp_path, seed=4, lean=lean)
        assert isinstance(loaded.model.model.layers[0], LlamaDecoderLayer)
        runner = ModelRunner(loaded.model)
        runner.output_hidden = True
        runner.hidden_layers = (1, 2, -1)
        prompt = loaded.tokenizer("First Citizen:\nBefore we proceed")["input_ids"]
        runner.forward(prompt)
        runner.forward([17, 23, 5])  # a verification-sized pass: the lean forward
        assert runner.last_hidden is not None
        states.append(runner.last_hidden)
    assert states[0].shape == states[1].shape == (3, 3 * 256)
    torch.testing.assert_close(states[1], states[0], rtol=0.05, atol=0.05 * states[0].abs().max())


def test_a_pass_of_no_rows_is_empty_not_an_error(tiny_tokenizer_dir, tmp_path):
    """Hugging Face's universal assisted generation can feed its assistant a pass of no new
    tokens; the lean attention derives its head counts from the widths, so that pass returns
    empty projections rather than failing to infer a -1 dimension from 0 elements."""
    loaded = _lean_model(tiny_tokenizer_dir, tmp_path, seed=4)
    attn = loaded.model.model.layers[0].self_attn
    d = attn.head_dim
    q, k, v = attn.project(torch.zeros(0, 256), torch.zeros(0, d), torch.zeros(0, d))
    assert q.shape == (0, 256 // d, d) and k.shape[0] == 0 and v.shape[0] == 0
    runner_input = torch.zeros(1, 0, dtype=torch.long)
    with torch.no_grad():
        assert loaded.model(runner_input).logits.shape[:2] == (1, 0)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "qkv-o-bias"])
def test_the_one_call_layer_gives_the_python_layers_bits(
    tiny_tokenizer_dir, tmp_path, monkeypatch, bias
):
    """``lean_layer`` (the whole decoder layer in one extension call, writing the cache in
    place) against the same lean layer run from Python, bit for bit: decoding steps, a chain,
    a tree with its mask, and a step after a rollback."""
    loaded = kquant_model(tiny_tokenizer_dir, tmp_path, seed=5, lean=True, attention_bias=bias)
    prompt = loaded.tokenizer("First Citizen:\nBefore we proceed any further")["input_ids"]
    tree = DraftTree(tokens=(5, 9, 11, 3), parents=(-1, 0, 0, 2))

    def run() -> list[torch.Tensor]:
        runner = ModelRunner(loaded.model)
        out = [runner.forward(prompt)]
        out += [runner.forward([token]) for token in (17, 23, 5)]
        out.append(runner.forward([7, 8, 9]))
        out.append(runner.forward_tree(tree))
        runner.cache.rollback(len(prompt) + 3)
        out.append(runner.forward([42]))
        return out

    calls: list[int] = []
    extend = BufferLayer.extend_to
    monkeypatch.setattr(
        BufferLayer, "extend_to", lambda self, n: (calls.append(n), extend(self, n))[1]
    )
    one_call = run()
    assert len(calls) == 2 * 6  # every pass after the prompt's, in both layers
    monkeypatch.setattr(BufferLayer, "room", lambda self, tokens: None)
    from_python = run()
    assert len(calls) == 2 * 6
    for got, want in zip(one_call, from_python, strict=True):
        assert torch.equal(got, want)


def test_a_batch_of_one_row_takes_the_one_call_layer(tiny_tokenizer_dir, tmp_path, monkeypatch):
    """A batched pass over a single sequence (a server with one client) runs each decoder
    layer in one extension call on that row of the batch's cache, as a single sequence's pass
    does, and gives the Python layers' bits: a prompt with a chain, a tree, a step after the
    tree's path was committed. A pass of two rows keeps the per-module path."""
    from specdec.batch.cache import SlotLayer
    from specdec.batch.target import BatchTarget

    loaded = kquant_model(tiny_tokenizer_dir, tmp_path, seed=8, lean=True, attention_bias=True)
    prompt = loaded.tokenizer("First Citizen:\nBefore we proceed any further")["input_ids"]
    tree = DraftTree(tokens=(5, 9, 11, 3), parents=(-1, 0, 0, 2))

    def run(rows: int) -> list[torch.Tensor]:
        target = BatchTarget(loaded)
        for _ in range(rows):
            prefill = target.start_prefill(prompt)
            assert target.prefill_chunk(prefill, len(prompt)) is not None
        out: list[torch.Tensor] = []
        for step in (DraftTree.chain(prompt[-1], [17, 23]), tree, DraftTree.chain(7, [])):
            logits = target.verify([step] * rows)
            out += [x for x in logits if x is not None]
            target.commit([[0, 2, 3] if step is tree else list(range(len(step)))] * rows)
        return out

    calls: list[int] = []
    monkeypatch.setattr(SlotLayer, "extend_to", lambda self, n: calls.append(n))
    one_call = run(1)
    assert len(calls) == 2 * 3  # both layers, every pass of the single row
    two_rows = run(2)
    assert len(calls) == 2 * 3  # a pass of two rows writes through update
    monkeypatch.setattr(SlotLayer, "room", lambda self, tokens: None)
    from_python = run(1)
    for got, want in zip(one_call, from_python, strict=True):
        assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(one_call, two_rows[::2], strict=True))
