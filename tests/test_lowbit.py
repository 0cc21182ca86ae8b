"""Low-bit CPU numerics (``--dtype int8-dynamic | int8 | int4 | int4-g128 | int4-ort``) on tiny
models.

What is checked: each swapped linear computes every output row from that row alone, bit for bit
(the property that keeps greedy speculation identical to plain decoding under these numerics);
the quantised model's logits stay within a stated distance of fp32; greedy speculative output
equals plain greedy output under the same numerics, with the draft in low-bit numerics too;
calibration keys on the numerics; shapes a kernel cannot take and non-CPU devices are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from specdec import SpeculativeEngine
from specdec.control.calibration import cost_calibration_path, measure_verify_costs
from specdec.errors import ConfigError
from specdec.target import ModelRunner, load_model
from specdec.target.lowbit import (
    SCHEMES,
    DynamicInt8Linear,
    Int4WeightLinear,
    Int8WeightLinear,
    q4k_to_int4,
    weight_bytes,
)
from specdec.target.numerics import check_numerics_device, get_numerics
from specdec.target.ort_int4 import OrtInt4Linear

LOWBIT = [name for name in SCHEMES if name != "kquant"]  # GGUF blocks: tests/test_kquant.py
PROMPTS = [
    "ROMEO: But soft, what light",
    "First Citizen:\nBefore we proceed any further, hear me speak. Speak, speak. Before we",
    "the the the the the the the",
]
# Largest logit difference from fp32 over one prompt's positions, as a fraction of the largest
# fp32 logit, and next-token agreement with fp32, on a random-weight model (Gaussian weights,
# the hardest case for 4 bits; real models: docs/lowbit.md). Measured: int8-dynamic 0.029 /
# 98%, int8 0.023 / 93%, int4 0.23 / 54%, int4-g128 0.26 / 66%; the bounds leave about 2x.
# int4-ort (int4 weights and int8 activation blocks): 0.26 / 61%.
LOGIT_BOUND = {"int8-dynamic": 0.06, "int8": 0.05, "int4": 0.45, "int4-g128": 0.5, "int4-ort": 0.5}
AGREEMENT = {"int8-dynamic": 0.85, "int8": 0.8, "int4": 0.35, "int4-g128": 0.4, "int4-ort": 0.4}
LAYERS = [DynamicInt8Linear, Int8WeightLinear, Int4WeightLinear, OrtInt4Linear]


def tiny_llama(out: Path, tokenizer_dir: Path, hidden: int, layers: int, init: float) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(3)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        initializer_range=init,
        eos_token_id=tok.eos_token_id,
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def smooth_dir(tmp_path_factory, tiny_tokenizer_dir: Path) -> Path:
    """Hidden size 128 (every group size divides it) and a trained model's weight scale
    (init 0.05), so that logit differences measure the quantisation, not the chaos of the
    large-init test models."""
    out = tmp_path_factory.mktemp("smooth")
    return tiny_llama(out, tiny_tokenizer_dir, hidden=128, layers=2, init=0.05)


@pytest.fixture(scope="module")
def fp32(smooth_dir: Path):
    return load_model(smooth_dir, dtype="float32-stock")


@pytest.mark.parametrize("make", LAYERS)
def test_each_row_is_computed_alone_bit_for_bit(make):
    torch.manual_seed(0)
    layer = make(nn.Linear(128, 96, bias=True))
    x = torch.randn(16, 128) * 3  # [T, K]
    together = layer(x)
    for k in (1, 2, 5, 16):
        alone = torch.cat([layer(x[i : i + 1]) for i in range(k)])
        assert torch.equal(together[:k], alone)
        assert torch.equal(layer(x[:k]), alone)


@pytest.mark.parametrize("make", LAYERS)
def test_swapped_layer_is_close_to_the_fp32_layer(make):
    torch.manual_seed(1)
    ref = nn.Linear(256, 64)
    x = torch.randn(4, 256)  # [T, K]
    with torch.no_grad():
        want = ref(x)
        got = make(ref)(x)
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < (0.08 if make in (Int4WeightLinear, OrtInt4Linear) else 0.02)


@pytest.mark.parametrize("dtype", LOWBIT)
def test_model_logits_close_to_fp32(fp32, smooth_dir, dtype):
    loaded = load_model(smooth_dir, dtype=dtype)
    assert loaded.dtype_name == dtype and loaded.numerics == SCHEMES[dtype].description
    swapped = [m for m in loaded.model.modules() if isinstance(m, nn.Linear)]
    assert not swapped  # every linear, lm_head included, runs the low-bit kernel
    ids = fp32.tokenizer(PROMPTS[1])["input_ids"]
    want = ModelRunner(fp32.model).forward(ids).double()  # [T, V]
    got = ModelRunner(loaded.model).forward(ids).double()
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < LOGIT_BOUND[dtype], rel
    agree = float((got.argmax(-1) == want.argmax(-1)).double().mean())
    assert agree >= AGREEMENT[dtype], agree
    assert weight_bytes(loaded.model) < weight_bytes(fp32.model) / (
        6 if dtype.startswith("int4") else 3
    )


@pytest.mark.parametrize(
    "dtype,spec",
    [
        ("int8-dynamic", "prompt-lookup"),
        ("int8-dynamic", "draft:model=DRAFT,dtype=int8-dynamic"),
        ("int8", "draft:model=DRAFT,dtype=int4"),
        ("int8-dynamic", "draft:model=DRAFT,dtype=int4,tree=2x2"),  # tree masks: gathered keys
        ("int4", "draft:model=DRAFT,dtype=float32"),
        ("int4-g128", "prompt-lookup"),
        ("int4-g128", "draft:model=SMOOTH,dtype=int8-dynamic"),
        ("int4-ort", "prompt-lookup"),
        ("int4-ort", "draft:model=DRAFT,dtype=int4-ort"),
        ("int4-ort", "draft:model=DRAFT,dtype=int4,tree=2x2"),
    ],
)
def test_greedy_speculation_equals_plain_under_the_same_numerics(
    tiny_model_dir, tiny_draft_dir, smooth_dir, dtype, spec
):
    # int4-g128 needs in_features divisible by 128: the smooth model, drafted by itself
    target = load_model(smooth_dir if dtype == "int4-g128" else tiny_model_dir, dtype=dtype)
    spec = spec.replace("SMOOTH", str(smooth_dir))
    spec = spec.replace("DRAFT", str(tiny_draft_dir))
    engine = SpeculativeEngine.from_pretrained(
        target, speculator=spec, num_draft_tokens=4, adaptive=False
    )
    drafted = 0
    for prompt in PROMPTS:
        plain = engine.generate(prompt, max_new_tokens=32, ignore_eos=True, speculate=False)
        fast = engine.generate(prompt, max_new_tokens=32, ignore_eos=True)
        assert fast.token_ids == plain.token_ids, (dtype, spec, prompt)
        drafted += fast.stats.drafted_tokens
    assert drafted > 0


def test_the_draft_takes_its_own_low_bit_numerics(tiny_model_dir, tiny_draft_dir):
    target = load_model(tiny_model_dir, dtype="float32")
    engine = SpeculativeEngine.from_pretrained(
        target, speculator=f"draft:model={tiny_draft_dir},dtype=int4"
    )
    draft_model = engine.speculator.runner.model  # type: ignore[attr-defined]
    kinds = {type(m) for m in draft_model.modules()}
    assert Int4WeightLinear in kinds and nn.Linear not in kinds
    with pytest.raises(ConfigError, match="unknown dtype 'int3'"):
        SpeculativeEngine.from_pretrained(
            target, speculator=f"draft:model={tiny_draft_dir},dtype=int3"
        )


def test_calibration_is_kept_per_numerics(tiny_model_dir):
    a = load_model(tiny_model_dir, dtype="int4")
    b = load_model(tiny_model_dir, dtype="int8-dynamic")
    assert cost_calibration_path(a) != cost_calibration_path(b)
    cal = measure_verify_costs(a, [2, 4], repeats=1)
    assert cal.dtype == "int4" and set(cal.chain) == {1, 2, 4}


def test_shapes_a_kernel_cannot_take_are_refused(tmp_path, tiny_tokenizer_dir):
    odd = tiny_llama(tmp_path / "odd", tiny_tokenizer_dir, hidden=40, layers=1, init=0.02)
    with pytest.raises(ConfigError, match=r"in_features divisible by 32.*int8"):
        load_model(odd, dtype="int4")
    with pytest.raises(ConfigError, match=r"in_features divisible by 16.*int8-dynamic"):
        load_model(odd, dtype="int8")
    loaded = load_model(odd, dtype="int8-dynamic")  # any shape
    assert isinstance(loaded.model.lm_head, DynamicInt8Linear)


@pytest.mark.parametrize("dtype", LOWBIT)
def test_low_bit_numerics_are_cpu_only(tiny_model_dir, dtype):
    with pytest.raises(ConfigError, match="CPU only"):
        check_numerics_device(get_numerics(dtype), torch.device("cuda"))
    with pytest.raises(ConfigError):  # CUDA absent, or present and refused: a clear error
        load_model(tiny_model_dir, dtype=dtype, device="cuda")


def test_gguf_q4_k_codes_map_onto_the_int4_layout():
    from gguf import GGMLQuantizationType, dequantize

    rng = np.random.default_rng(0)
    n, k = 32, 512  # two Q4_K super-blocks of 256 per row
    blocks = rng.integers(0, 256, size=(n * k // 256, 144), dtype=np.uint8)
    halves = rng.uniform(1e-3, 2e-2, size=(n * k // 256, 2)).astype(np.float16)
    blocks[:, :4] = halves.view(np.uint8)  # sane d and dmin (random bytes give inf/nan)
    want = dequantize(blocks.reshape(n, -1), GGMLQuantizationType.Q4_K)  # [N, K] fp32
    q, scale, zero = q4k_to_int4(blocks.reshape(n, -1))  # codes [N, K], [N, K/32] each
    assert q.shape == (n, k) and scale.shape == (n, k // 32) and int(q.max()) <= 15
    per_weight = (scale.double().repeat_interleave(32, 1), zero.double().repeat_interleave(32, 1))
    exact = (q.double() - 8) * per_weight[0] + per_weight[1]
    assert np.abs(exact.numpy() - want).max() < 1e-5  # fp32 scales: the same weights
    layer = Int4WeightLinear.from_codes(nn.Linear(k, n, bias=False), q, scale, zero, 32)
    got = layer(torch.eye(k)).T  # [N, K] as the kernel sees it: bf16 scales and zeros
    rel = np.abs(got.float().numpy() - want).max() / np.abs(want).max()
    assert rel < 0.02, rel


@pytest.mark.parametrize("dtype", ["int8-dynamic", "int4", "int4-ort"])
def test_the_whole_forward_is_row_invariant(tiny_model_dir, dtype):
    """A verification pass of k tokens gives, bit for bit, the logits of k one-token passes:
    what keeps speculative output equal to plain output despite activation rounding."""
    loaded = load_model(tiny_model_dir, dtype=dtype)
    assert loaded.model.config._attn_implementation == "specdec_rowwise_sdpa"
    runner = ModelRunner(loaded.model)
    prompt = loaded.tokenizer(PROMPTS[1])["input_ids"]
    runner.forward(prompt)
    chunk = [17, 23, 5, 99, 42, 7]
    together = runner.forward(chunk)  # [6, V]
    runner.cache.rollback(len(prompt))
    alone = torch.cat([runner.forward([tok]) for tok in chunk])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("make", [Int8WeightLinear, Int4WeightLinear])
def test_long_passes_take_the_dense_path_with_the_same_weights(make):
    from specdec.target.lowbit import DENSE_ROWS

    torch.manual_seed(2)
    layer = make(nn.Linear(128, 64))
    x = torch.randn(DENSE_ROWS + 1, 128)
    with torch.no_grad():
        dense = layer(x)  # one bf16 matmul over the dequantised weight
        kernel = torch.cat([layer(x[:DENSE_ROWS]), layer(x[DENSE_ROWS:])])
    assert float((dense - kernel).abs().max() / kernel.abs().max()) < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", [Int8WeightLinear, Int4WeightLinear])
def test_the_dense_path_multiplies_in_the_cpus_dense_dtype(monkeypatch, make, dtype):
    # An AVX2-only CPU emulates bf16 matmuls (9x slower than fp32 at 700 rows), so long
    # passes run in fp32 there; the kernel path below DENSE_ROWS stays bf16 either way.
    import specdec.target.lowbit as lowbit

    monkeypatch.setattr(lowbit, "dense_dtype", lambda: dtype)
    torch.manual_seed(3)
    layer = make(nn.Linear(128, 64, bias=False))
    x = torch.randn(lowbit.DENSE_ROWS + 1, 128)
    weight = layer.dense(dtype)
    with torch.no_grad():
        assert torch.equal(layer(x), nn.functional.linear(x.to(dtype), weight).float())
        kernel = torch.cat([layer(x[: lowbit.DENSE_ROWS]), layer(x[lowbit.DENSE_ROWS :])])
    assert float((layer(x) - kernel).abs().max() / kernel.abs().max()) < 0.02


def test_one_row_runs_through_the_multi_row_kernel():
    """onnxruntime runs a single row through a GEMV kernel whose sums are ordered differently
    from its multi-row kernel; the layer pads one row to two so that plain decoding and a
    verification pass use the same kernel. The raw session shows why (this can fail: if the
    two kernels ever agree, the padding is no longer needed)."""
    torch.manual_seed(4)
    layer = OrtInt4Linear(nn.Linear(1536, 256, bias=False))
    x = torch.randn(8, 1536)
    raw_one = layer._run(x[:1].numpy().copy())
    raw_many = layer._run(x.numpy().copy())
    alone = layer(x[:1])
    assert torch.equal(alone[0], torch.from_numpy(raw_many[0]))
    assert float(np.abs(raw_one[0] - raw_many[0]).max()) < 1e-4  # the same maths, reordered


def test_ort_weights_are_the_rounded_fp32_weights():
    torch.manual_seed(5)
    ref = nn.Linear(64, 48)
    layer = OrtInt4Linear(ref)
    w = ref.weight.detach()
    err = (layer.dense() - w).abs().reshape(48, 2, 32)
    scale = torch.from_numpy(layer.scales).reshape(48, 2)
    assert bool((err <= scale[..., None] / 2 + 1e-6).all())  # within half a step per group


def test_int4_ort_without_onnxruntime_is_a_clear_error(monkeypatch, tiny_model_dir):
    import specdec.target.ort_int4 as ort_int4

    monkeypatch.setattr(ort_int4, "ort_available", lambda: False)
    with pytest.raises(ConfigError, match=r"pip install 'specdec\[ort\]'"):
        load_model(tiny_model_dir, dtype="int4-ort")


def test_int4_ort_runs_torch_on_one_thread_and_restores_the_count(tiny_model_dir):
    """onnxruntime's pool spins between calls; torch's own workers spinning on the same cores
    made a forward 2.3x slower, so torch runs single-threaded inside the model's forward and
    gets the caller's thread count back afterwards, also when the forward fails."""
    loaded = load_model(tiny_model_dir, dtype="int4-ort")
    seen: list[int] = []
    layer = loaded.model.model.layers[0]
    handle = layer.register_forward_pre_hook(lambda m, a: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ids = torch.tensor([[1, 2, 3]])
        with torch.inference_mode():
            loaded.model(ids)
        assert seen == [1] and torch.get_num_threads() == 2
        with pytest.raises(IndexError), torch.inference_mode():
            loaded.model(torch.tensor([[10**9]]))  # past the vocabulary: the forward fails
        assert torch.get_num_threads() == 2
    finally:
        handle.remove()
        torch.set_num_threads(before)


def test_a_kernel_change_starts_a_new_cost_calibration(tiny_model_dir, monkeypatch):
    """Numerics that run specdec's own compiled kernel key their verification-cost curve by a
    digest of its sources: after an upgrade changes the kernel, the old curve (its T(n)/T(1))
    is neither read under the new key nor picked up as a thread-less legacy file."""
    import dataclasses

    from specdec.control import calibration
    from specdec.target import kquant

    loaded = load_model(tiny_model_dir, dtype="int4")
    as_kquant = dataclasses.replace(loaded, dtype_name="kquant")
    before = cost_calibration_path(as_kquant)
    assert f"kernel={kquant.kernel_digest()}" in calibration._kernel_key(as_kquant)
    monkeypatch.setattr(kquant, "kernel_digest", lambda: "another")
    assert cost_calibration_path(as_kquant) != before
    # other numerics are not keyed by it
    assert calibration._kernel_key(loaded) == []
    # a valid curve where files were kept before threads were in the key: read for other
    # numerics, not for the kernel's
    body = json.dumps(measure_verify_costs(loaded, [2], repeats=1).to_json())
    for model in (loaded, as_kquant):
        legacy = calibration.legacy_cost_calibration_path(model)
        legacy.parent.mkdir(parents=True, exist_ok=True)
        legacy.write_text(body)
    try:
        assert calibration.load_cost_calibration(loaded) is not None
        assert calibration.load_cost_calibration(as_kquant) is None
    finally:
        for model in (loaded, as_kquant):
            calibration.legacy_cost_calibration_path(model).unlink()
