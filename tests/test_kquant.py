"""``--dtype kquant``: a GGUF file's own quantised blocks through specdec's small-row kernel.

What is checked: the blocks are read exactly (the layer's weight equals the gguf package's own
dequantisation, bit for bit); the kernel computes what its integer formula says (against a
float64 evaluation of the same formula) and stays close to the fp32 layer; every row is
computed from itself alone, bit for bit, whatever the row count (across the kernel's 8-row
chunks) and the thread count; the whole forward is row-invariant and greedy speculation equals
plain greedy decoding under these numerics; files and models it cannot run are refused with an
error naming what to use. The blocks are random (valid by construction: any bytes are codes);
a real Q4_K_M file is checked too where the Qwen pair is installed.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

from specdec import SpeculativeEngine
from specdec.errors import ConfigError, ModelNotFoundError
from specdec.target import ModelRunner, load_model
from specdec.target.attention import use_rowwise_attention
from specdec.target.kquant import KQuantEmbedding, KQuantLinear, attach_blocks, extension
from specdec.target.loading import LoadedModel
from specdec.target.lowbit import SCHEMES
from specdec.target.numerics import dense_weight, swap_linears
from specdec.target.packs import PACKS, part_paths
from specdec.tree import DraftTree

pytestmark = pytest.mark.slow(threads=1)  # the kernel compiles once per session: over a minute

KINDS = {"Q4_K": (144, GGMLQuantizationType.Q4_K), "Q6_K": (210, GGMLQuantizationType.Q6_K)}
# every type the kernel takes: bytes per block, weights per block
ALL_KINDS = {
    "Q4_0": (18, 32),
    "Q4_1": (20, 32),
    "Q5_0": (22, 32),
    "Q5_1": (24, 32),
    "Q8_0": (34, 32),
    "Q4_K": (144, 256),
    "Q5_K": (176, 256),
    "Q6_K": (210, 256),
}


def random_blocks(kind: str, n: int, k: int, seed: int, scale: float = 1.0) -> np.ndarray:
    """``[n, k / block * bytes]`` valid blocks: random codes and sub-scales, small fp16 d (and
    min, for the kinds that have one)."""
    size, per = ALL_KINDS[kind]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n * k // per, size), dtype=np.uint8)
    if kind in ("Q4_K", "Q5_K"):
        d = (rng.uniform(0.5, 1.5, (len(b), 2)) * [2e-3, 4e-3] * scale).astype(np.float16)
        b[:, 0:4] = d.view(np.uint8)
    elif per == 32:
        b[:, 0:2] = (
            (rng.uniform(0.5, 1.5, (len(b), 1)) * 1e-2 * scale).astype(np.float16).view(np.uint8)
        )
        if kind in ("Q4_1", "Q5_1"):
            m = rng.uniform(-1, 1, (len(b), 1)) * 5e-2 * scale
            b[:, 2:4] = m.astype(np.float16).view(np.uint8)
    else:
        b[:, 192:208] = rng.integers(-20, 21, (len(b), 16), dtype=np.int8).view(np.uint8)
        b[:, 208:210] = (
            (rng.uniform(0.5, 1.5, (len(b), 1)) * 1e-3 * scale).astype(np.float16).view(np.uint8)
        )
    return b.reshape(n, -1)


def reference_weight(kind: str, blocks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks, GGMLQuantizationType[kind]).astype(np.float32))


@pytest.mark.parametrize("kind", list(ALL_KINDS))
@pytest.mark.parametrize("k", [512, 576, 768])
def test_every_kind_is_read_exactly_and_computed_row_by_row(kind, k):
    """Each file type's blocks give the gguf package's own dequantisation bit for bit (rows
    of an odd number of blocks, 768 wide, end with a block the kernel takes alone; rows 576
    wide, as the bundled model's, are padded to 768 with zero weights), the layer stays close
    to the fp32 one, every row is computed alone, and the SIMD paths give the same bits while
    the portable loop agrees to float rounding."""
    if k % ALL_KINDS[kind][1]:
        pytest.skip(f"{kind} blocks are {ALL_KINDS[kind][1]} wide")
    blocks = random_blocks(kind, 24, k, seed=11)
    layer = KQuantLinear.from_gguf(kind, blocks, k)
    assert torch.equal(layer.exact_weight(), reference_weight(kind, blocks))
    torch.manual_seed(2)
    x = torch.randn(11, k)
    y = layer(x)
    fp32 = x @ reference_weight(kind, blocks).T
    assert ((y - fp32).norm() / fp32.norm()).item() < 0.02
    assert torch.equal(y, torch.cat([layer(x[i : i + 1]) for i in range(11)]))
    ext = extension()
    padded = torch.nn.functional.pad(x, (0, layer.padded_in - k))
    args = (layer.codes, layer.meta, layer.d, layer.dmin, layer.kind_id)
    paths = [ext.kquant_mm_on(padded, *args, p) for p in range(ext.best_path() + 1)]
    for simd in paths[1:]:
        assert torch.equal(simd, paths[-1])
    assert torch.allclose(paths[0], paths[-1], rtol=1e-5, atol=1e-5 * paths[0].abs().max().item())
    # the kernel pads narrower rows itself, to the same bits as rows padded beforehand
    for p in range(ext.best_path() + 1):
        assert torch.equal(ext.kquant_mm_on(x, *args, p), paths[p])
    with pytest.raises(RuntimeError, match="disagree on in_features"):
        ext.kquant_mm(x[:, : layer.padded_in - 256], *args, False)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_blocks_are_read_exactly(kind):
    blocks = random_blocks(kind, 48, 512, seed=1)
    layer = KQuantLinear.from_gguf(kind, blocks, 512)
    assert torch.equal(layer.exact_weight(), reference_weight(kind, blocks))
    assert torch.equal(dense_weight(layer), reference_weight(kind, blocks))
    # the file's bytes per 256-weight block (Q4_K 144, Q6_K 210), plus Q4_K's 6-bit scales
    # and mins unpacked to one byte each (16 bytes where the file packs them in 12)
    per_block = {"Q4_K": 148, "Q6_K": 210}[kind]
    assert layer.weight_bytes() == 48 * 2 * per_block


def _formula(kind: str, layer: KQuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in float64: int8 activation blocks of 32 (scale amax / 127,
    rounded to nearest even), dotted with the dequantised weight."""
    rows, k = x.shape
    xb = x.double().view(rows, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    iscale = (127.0 / amax.float()).double()  # the kernel computes 127 / amax in float32
    q = torch.round((xb.float() * iscale.float()).double()).clamp(-127, 127)
    da = (1.0 / iscale.float()).double()
    xq = (q * da).view(rows, k)
    return xq @ layer.exact_weight().double().T


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_kernel_computes_its_formula_and_stays_close_to_fp32(kind):
    blocks = random_blocks(kind, 40, 768, seed=2)
    layer = KQuantLinear.from_gguf(kind, blocks, 768)
    torch.manual_seed(0)
    x = torch.randn(11, 768)
    y = layer(x)
    exact = _formula(kind, layer, x)
    # float32 accumulation of exact int32 block sums: within 1e-5 of the float64 formula
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    fp32 = x @ reference_weight(kind, blocks).T
    rel = ((y - fp32).norm() / fp32.norm()).item()
    assert 0 < rel < 0.02  # int8 activation blocks: ~0.7% on Gaussian inputs


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_each_row_is_computed_alone_bit_for_bit(kind):
    layer = KQuantLinear.from_gguf(kind, random_blocks(kind, 72, 512, seed=3), 512)
    torch.manual_seed(1)
    x = torch.randn(20, 512) * 3
    together = layer(x)  # three chunks of 8 rows, the last one 4
    alone = torch.cat([layer(x[i : i + 1]) for i in range(20)])
    assert torch.equal(together, alone)
    for k in (2, 5, 9, 16):
        assert torch.equal(layer(x[:k]), alone[:k])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x), together)
    finally:
        torch.set_num_threads(threads)


def test_the_kernel_lets_other_python_threads_run():
    """The kernel releases the GIL while it computes, so a server's HTTP thread can write the
    last step's chunks meanwhile (holding it, every chunk waited for kernel calls to end)."""
    import threading

    layer = KQuantLinear.from_gguf("Q4_K", random_blocks("Q4_K", 4096, 2048, seed=4), 2048)
    x = torch.randn(256, 2048)
    ext = extension()  # built or loaded before anything is timed
    ticks: list[float] = []
    stop = threading.Event()

    def spin() -> None:  # a Python thread noting the time whenever it gets to run
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0)  # hands the GIL over at once: the caller never waits for it

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        windows = []
        for _ in range(3):
            t0 = time.perf_counter()
            ext.kquant_mm(x, layer.codes, layer.meta, layer.d, layer.dmin, 0, False)
            t1 = time.perf_counter()
            windows.append((t0 + 0.25 * (t1 - t0), t1 - 0.25 * (t1 - t0)))
    finally:
        stop.set()
        thread.join()
    # with the GIL held through the call, the thread could not run in its middle half at all
    inside = [sum(lo < t < hi for t in ticks) for lo, hi in windows]
    assert all(n > 0 for n in inside), inside


def test_the_simd_and_portable_paths_agree():
    ext = extension()
    if not ext.has_simd():
        pytest.skip("no AVX2 or AVX-512 VNNI on this CPU: only the portable path runs")
    for kind in KINDS:
        layer = KQuantLinear.from_gguf(kind, random_blocks(kind, 32, 512, seed=4), 512)
        x = torch.randn(5, 512)
        args = (layer.codes, layer.meta, layer.d, layer.dmin, layer.kind_id)
        simd, portable = ext.kquant_mm(x, *args, False), ext.kquant_mm(x, *args, True)
        # same integers; the float sums are ordered differently (lanes against one running sum)
        assert torch.allclose(simd, portable, rtol=1e-5, atol=1e-5 * portable.abs().max().item())


def kquant_model(
    tiny_tokenizer_dir: Path,
    tmp_path: Path,
    seed: int,
    lean: bool = False,
    attention_bias: bool = False,
) -> LoadedModel:
    """A 2-layer llama-shaped model (hidden 256, every width a multiple of 256) whose linears
    are random Q4_K (attention, gate/up, head) and Q6_K (v, down) blocks, as a Q4_K_M file
    mixes them; the fp32 checkpoint holds their exact dequantisation. ``lean``: with the
    kquant modules of :mod:`specdec.target.kquant_layers`, as ``load_model`` gives them;
    ``attention_bias``: q/k/v/o with biases (as Qwen2's q/k/v have)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        attention_bias=attention_bias,
    )
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    if attention_bias:
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn_like(param) * 0.1)
    blocks = {}
    for i, (path, linear) in enumerate(model.named_modules()):
        if isinstance(linear, nn.Linear):
            kind = "Q6_K" if path.endswith(("v_proj", "down_proj")) else "Q4_K"
            scale = 8.0 if path == "lm_head" else 1.0  # logits with real margins
            data = random_blocks(kind, linear.out_features, linear.in_features, seed + i, scale)
            linear.weight.copy_(reference_weight(kind, data))
            blocks[path] = (kind, data)
    attach_blocks(model, blocks, "test blocks")
    swap_linears(model, SCHEMES["kquant"].make)
    use_rowwise_attention(model)
    if lean:
        SCHEMES["kquant"].after_swap(model)
    return LoadedModel(
        model=model, tokenizer=tok, source="test", numerics="kquant", dtype_name="kquant"
    )


@pytest.mark.parametrize("lean", [False, True], ids=["hf-modules", "lean-modules"])
def test_the_whole_forward_is_row_invariant(tiny_tokenizer_dir, tmp_path, lean):
    loaded = kquant_model(tiny_tokenizer_dir, tmp_path, seed=5, lean=lean)
    assert all(not isinstance(m, nn.Linear) for m in loaded.model.modules()), (
        "every linear runs the kernel"
    )
    runner = ModelRunner(loaded.model)
    prompt = loaded.tokenizer("First Citizen:\nBefore we proceed any further")["input_ids"]
    runner.forward(prompt)
    chunk = [17, 23, 5, 99, 42, 7, 8, 11, 12, 300]  # 10 rows: two kernel chunks
    together = runner.forward(chunk)
    runner.cache.rollback(len(prompt))
    alone = torch.cat([runner.forward([t]) for t in chunk])
    assert torch.equal(together, alone)
    # a tree's branch gets the bits of its own chain (attention over the keys it may see)
    runner.cache.rollback(len(prompt))
    tree = runner.forward_tree(DraftTree(tokens=(17, 23, 5, 99), parents=(-1, 0, 0, 2)))
    runner.cache.rollback(len(prompt))
    assert torch.equal(tree[[0, 2, 3]], runner.forward([17, 5, 99]))


@pytest.mark.parametrize("lean", [False, True], ids=["hf-modules", "lean-modules"])
@pytest.mark.parametrize("spec", ["prompt-lookup", "draft:model=DRAFT,dtype=float32"])
def test_greedy_speculation_equals_plain_under_kquant(
    tiny_tokenizer_dir, tiny_draft_dir, tmp_path, spec, lean
):
    target = kquant_model(tiny_tokenizer_dir, tmp_path, seed=6, lean=lean)
    engine = SpeculativeEngine.from_pretrained(
        target,
        speculator=spec.replace("DRAFT", str(tiny_draft_dir)),
        num_draft_tokens=4,
        adaptive=False,
    )
    drafted = 0
    for prompt in ("the the the the the the", "ROMEO: But soft, what light through yonder"):
        plain = engine.generate(prompt, max_new_tokens=24, ignore_eos=True, speculate=False)
        fast = engine.generate(prompt, max_new_tokens=24, ignore_eos=True)
        assert fast.token_ids == plain.token_ids, (spec, prompt)
        drafted += fast.stats.drafted_tokens
    assert drafted > 0


def test_what_kquant_cannot_run_is_refused(tiny_model_dir):
    # a model directory: no file blocks to run
    with pytest.raises(ConfigError, match="pass --gguf FILE or a model pack"):
        load_model(tiny_model_dir, dtype="kquant")
    # blocks that do not hold the checkpoint's weight (a permuted layout) are not run
    linear = nn.Linear(256, 4, bias=False)
    model = nn.Sequential()
    model.add_module("proj", linear)
    data = random_blocks("Q4_K", 4, 256, seed=7)
    linear.weight.data.copy_(reference_weight("Q4_K", data).flip(0))
    with pytest.raises(ConfigError, match="a row order this reader does not know"):
        attach_blocks(model, {"proj": ("Q4_K", data)}, "test")
    # a linear without blocks
    with pytest.raises(ConfigError, match="has none"):
        KQuantLinear.from_attached(nn.Linear(256, 8))


QWEN = Path.home() / ".cache" / "specdec" / "packs" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


@pytest.mark.skipif(not QWEN.is_file(), reason="the Qwen pair is not installed (--qwen-pair)")
def test_a_real_q4_k_m_file_is_read_exactly():
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(QWEN)).tensors}
    for name in ("blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "blk.3.attn_v.weight"):
        t = tensors[name]
        data = np.asarray(t.data)[:64]
        layer = KQuantLinear.from_gguf(t.tensor_type.name, data, int(t.shape[0]))
        assert torch.equal(layer.exact_weight(), torch.from_numpy(dequantize(data, t.tensor_type)))


def test_the_avx2_path_gives_the_avx512_bits():
    """CPUs with AVX2 but no AVX-512 VNNI (the 2026-12-03 EPYC) run the same lanes as two
    256-bit halves, with maddubs/madd for the dot products: the same integers, the same
    per-lane float sums and the same final reduction, so a file decodes to the same bits on
    either machine. Includes the worst case for the 16-bit partial sums (every code at its
    maximum, activations at +-127), where a saturating sum would show."""
    ext = extension()
    if ext.best_path() < 1:
        pytest.skip("no AVX2 on this CPU: only the portable path runs")
    code_bytes = {
        "Q4_K": slice(16, 144),
        "Q6_K": slice(0, 192),
        "Q5_K": slice(16, 176),
        "Q4_0": slice(2, 18),
        "Q5_1": slice(4, 24),
        "Q8_0": slice(2, 34),  # 0x7F: code 127 + 128 = 255, the widest 8-bit code
    }
    for kind in code_bytes:
        blocks = random_blocks(kind, 40, 768, seed=7)
        worst = blocks.reshape(-1, ALL_KINDS[kind][0]).copy()
        worst[:, code_bytes[kind]] = 0x7F if kind == "Q8_0" else 0xFF
        for b in (blocks, worst.reshape(40, -1)):
            layer = KQuantLinear.from_gguf(kind, b, 768)
            args = (layer.codes, layer.meta, layer.d, layer.dmin, layer.kind_id)
            x = torch.randn(11, 768)
            x[0], x[1] = 1.0, -1.0
            avx2 = ext.kquant_mm_on(x, *args, 1)
            alone = torch.cat([ext.kquant_mm_on(x[i : i + 1], *args, 1) for i in range(11)])
            assert torch.equal(avx2, alone)  # row-invariant, as the AVX-512 path
            if ext.best_path() == 2:
                assert torch.equal(avx2, ext.kquant_mm_on(x, *args, 2)), kind
            portable = ext.kquant_mm_on(x, *args, 0)
            assert torch.allclose(
                avx2, portable, rtol=1e-5, atol=1e-5 * portable.abs().max().item()
            )
    with pytest.raises(RuntimeError, match="does not run on this CPU"):
        ext.kquant_mm_on(torch.randn(1, 768), *args, 3)


BATCH_PROMPTS = (
    "the the the the the the",
    "ROMEO: But soft, what light through yonder",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "KING RICHARD III: Now is the winter of our discontent",
)


@pytest.mark.parametrize("lean", [False, True], ids=["hf-modules", "lean-modules"])
@pytest.mark.parametrize("spec", ["none", "prompt-lookup"])
def test_a_batch_through_kquant_equals_each_sequence_alone(
    tiny_tokenizer_dir, tmp_path, spec, lean
):
    """The batch scheduler drives the GGUF-native numerics: its packed passes route attention
    through their own function (each row over its own cache), which the kquant attention must
    call rather than its single-sequence kernel. Greedy output per sequence equals its solo
    output under the same numerics, whoever it is batched with."""
    target = kquant_model(tiny_tokenizer_dir, tmp_path, seed=6, lean=lean)
    engine = SpeculativeEngine.from_pretrained(
        target, speculator=spec, num_draft_tokens=4, adaptive=False
    )
    assert engine.batchable
    kw = {"max_new_tokens": 20, "ignore_eos": True}
    solo = [engine.generate(p, **kw).token_ids for p in BATCH_PROMPTS]
    for max_batch in (2, 4):  # 2: sequences join and leave mid-run
        batched = engine.generate_batch(list(BATCH_PROMPTS), max_batch=max_batch, **kw)
        assert [r.token_ids for r in batched] == solo, max_batch
        if spec != "none":
            assert sum(r.stats.drafted_tokens for r in batched) > 0


def test_auto_runs_the_bundled_file_in_its_own_blocks(tiny_model_dir):
    """``--dtype auto`` (the default): the bundled SmolLM2 file (llama architecture, Q4_1
    linears, a Q8_0 tied head, rows 576 wide) runs its own blocks; its q/k rows, which
    llama.cpp's converter permutes, are put back in the checkpoint's order (else the logits
    would be far from the fp32 model's); greedy speculation equals plain decoding in these
    numerics. A model directory runs float32, and a file the kernel cannot take says why."""
    from specdec.target.base import ModelSource
    from specdec.target.loading import choose_dtype

    loaded = load_model(None)
    assert loaded.dtype_name == "kquant"
    assert all(not isinstance(m, nn.Linear) for m in loaded.model.modules())
    fp32 = load_model(None, dtype="float32")
    ids = loaded.tokenizer("def quicksort(arr):\n    if len(arr) <= 1:", return_tensors="pt")
    with torch.no_grad():
        a, b = loaded.model(ids.input_ids).logits[0], fp32.model(ids.input_ids).logits[0]
    assert ((a - b).norm() / b.norm()).item() < 0.05
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.8
    # the tied Q8_0 table stays quantised: its lookups are the fp32 table's rows, bit for bit,
    # and the model keeps its identity (the digest reads the table in slices)
    table = loaded.model.get_input_embeddings()
    assert isinstance(table, KQuantEmbedding)
    some = ids.input_ids[0]
    assert torch.equal(table(some), fp32.model.get_input_embeddings()(some))
    # a pass of no new tokens (Hugging Face's assisted generation hands its assistant one)
    assert table(some[:0].view(1, 0)).shape == (1, 0, table.embedding_dim)
    assert loaded.identity()["embedding_sha256"] == fp32.identity()["embedding_sha256"]
    engine = SpeculativeEngine.from_pretrained(loaded, speculator="prompt-lookup")
    prompt = "Repeat: the cat sat on the mat, the cat sat on the mat, the cat sat on the"
    plain = engine.generate(prompt, max_new_tokens=24, speculate=False)
    fast = engine.generate(prompt, max_new_tokens=24)
    assert fast.token_ids == plain.token_ids and fast.stats.drafted_tokens > 0
    assert choose_dtype(ModelSource(tiny_model_dir)) == ("float32", None)


def test_auto_falls_back_with_the_reason_and_the_cost(tmp_path):
    """A GGUF file whose architecture the kernel does not place falls back to float32, with
    one note naming why and what the dequantised copy reads per token."""
    import gguf

    from specdec.target.base import ModelSource
    from specdec.target.loading import choose_dtype

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((64, 256), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    dtype, note = choose_dtype(ModelSource(gguf=path))
    assert dtype == "float32"
    assert note is not None and "architecture is mamba" in note and "GB a token" in note


def _pack_installed(alias: str) -> bool:
    """Whether the pack's parts are installed: an assembled file left in the cache by another
    environment is not enough, since loading by alias checks the parts."""
    try:
        part_paths(PACKS[alias])
    except ModelNotFoundError:
        return False
    return True


PACKS_HERE = [alias for alias in ("gemma-3-270m", "qwen2.5-coder-0.5b") if _pack_installed(alias)]


@pytest.mark.skipif(not PACKS_HERE, reason="no Gemma 3 / Qwen 0.5B pack installed")
@pytest.mark.parametrize("alias", PACKS_HERE)
def test_real_files_of_other_types_run_their_own_blocks(alias):
    """Gemma 3 270M (gemma3: Q5_0/Q8_0/Q4_K/Q6_K, rows 640 wide, sliding-window layers) and
    the Qwen 0.5B (Q5_0/Q8_0 rows 896 wide) run their own blocks by default, and greedy
    speculation equals plain decoding in those numerics."""
    loaded = load_model(alias)
    assert loaded.dtype_name == "kquant"
    if alias.startswith("qwen"):  # Gemma's scaled embedding keeps its own table
        assert isinstance(loaded.model.get_input_embeddings(), KQuantEmbedding)
    engine = SpeculativeEngine.from_pretrained(loaded, speculator="prompt-lookup")
    prompt = "Repeat: the cat sat on the mat, the cat sat on the mat, the cat sat on the"
    plain = engine.generate(prompt, max_new_tokens=24, speculate=False)
    fast = engine.generate(prompt, max_new_tokens=24)
    assert fast.token_ids == plain.token_ids and fast.stats.drafted_tokens > 0


def test_a_batch_of_the_bundled_file_equals_each_sequence_alone():
    """The default numerics of the bundled file, batched: each sequence's greedy output equals
    its solo output (its rows' attention runs the kernel of its solo passes whoever its batch
    mates are; before, a packed pass's attention summed in another order and int8 activation
    rounding turned that into other tokens in 3 of 8 answers on the Qwen 1.5B)."""
    engine = SpeculativeEngine.from_pretrained(None, speculator="prompt-lookup")
    assert engine.loaded is not None and engine.loaded.dtype_name == "kquant"
    prompts = [*BATCH_PROMPTS, "Write a haiku about caches.", "Summarize: the cat sat on the mat."]
    kw = {"max_new_tokens": 32, "ignore_eos": True}
    solo = [engine.generate(p, **kw).token_ids for p in prompts]
    batched = engine.generate_batch(prompts, max_batch=6, **kw)
    assert [r.token_ids for r in batched] == solo


def test_a_draft_head_over_a_subset_keeps_the_file_blocks_and_their_bits(
    tiny_tokenizer_dir, tmp_path
):
    """``vocab=N`` on a kquant draft: the subset head is the chosen rows' own blocks (no float
    copy), each kept logit has the full head's bits, the rest are ``-inf``, and the request's
    context tokens outside the subset are scored from the head's exact rows."""
    from specdec.speculators.draft_vocab import SubsetHead, with_subset_head

    loaded = kquant_model(tiny_tokenizer_dir, tmp_path, seed=8, lean=True)
    ids = torch.tensor([3, 7, 11, 40, 41, 200])
    view = with_subset_head(loaded.model, ids, "kquant")
    head = view.get_output_embeddings()
    assert isinstance(head, SubsetHead) and isinstance(head.head, KQuantLinear)
    assert head.head.out_features == len(ids) and head.head.kind == "Q4_K"
    assert isinstance(loaded.model.get_output_embeddings(), KQuantLinear)  # left as it was
    x = torch.tensor([[5, 9, 14, 2, 300]])
    with torch.inference_mode():
        full = loaded.model(input_ids=x).logits
        part = view(input_ids=x).logits
    keep = torch.zeros(full.shape[-1], dtype=torch.bool)
    keep[ids] = True
    assert torch.equal(part[..., ids], full[..., ids])
    assert torch.isinf(part[..., ~keep]).all() and (part[..., ~keep] < 0).all()
    head.include([300, 301])
    with torch.inference_mode():
        extra = view(input_ids=x).logits[..., [300, 301]]
    # float32 rows against int8-rounded activations: close, not the same bits
    torch.testing.assert_close(extra, full[..., [300, 301]], rtol=0.05, atol=0.05)
    assert torch.isinf(view(input_ids=x).logits[..., 302]).all()
