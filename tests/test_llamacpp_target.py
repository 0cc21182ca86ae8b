"""The target verified by llama.cpp from its GGUF file (``--dtype gguf``).

What the equality tests compare: speculative decoding verifies k tokens in one llama.cpp pass,
plain decoding one token per pass, and llama.cpp may use other kernels for other batch sizes
(for the Qwen2.5-Coder 1.5B Q4_K_M file an 8-token pass and eight one-token passes differ by up
to 0.4 in a logit; experiments/llamacpp/2026-12-04-llamacpp-target.md). So the tests first
measure that disagreement for the model under test on this machine (:func:`pass_disagreement`).
Where it is zero (the bundled Q4_1 model here: bitwise equal) greedy outputs must be identical;
otherwise they may differ only where the plain run's top two tokens were closer than twice the
measured disagreement, and any real verification error shows up as a difference at a clear margin.
"""

from __future__ import annotations

import json

import pytest
import torch

from specdec import SpeculativeEngine
from specdec.errors import ConfigError
from specdec.request import encode_prompt
from specdec.target import llamacpp, load_model
from specdec.target.loading import default_gguf_path

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not llamacpp.available(),
        reason="llama-cpp-python is not installed (bash scripts/install.sh installs it)",
    ),
]

PROMPTS = [
    "Repeat after me exactly: the quick brown fox jumps over the lazy dog.",
    "Write a Python function that returns the n-th Fibonacci number.",
]


@pytest.fixture(scope="module")
def smol_gguf():
    return load_model(dtype="gguf")


def pass_disagreement(loaded) -> float:
    """Largest logit difference between one 8-token llama.cpp pass and 8 one-token passes."""
    runner, _ = loaded.backend.verification_runner(loaded)
    runner.forward(list(range(100, 140)))
    batch = runner.forward_all(list(range(200, 208)))
    runner.cache.rollback(40)
    single = [runner.forward_all([t])[0] for t in range(200, 208)]
    return float((batch - torch.stack(single)).abs().max())


@pytest.fixture(scope="module")
def near_tie(smol_gguf) -> float:
    return 2 * pass_disagreement(smol_gguf)


def _same_or_near_tie(engine: SpeculativeEngine, prompt: str, near_tie: float, **kw) -> int:
    """Generate plainly and speculatively; equal, or first differing at a near-tie. Returns
    the drafted tokens accepted."""
    plain = engine.generate(prompt, speculate=False, logprobs=True, top_logprobs=2, **kw)
    ours = engine.generate(prompt, **kw)
    if ours.token_ids != plain.token_ids:
        pairs = zip(ours.token_ids, plain.token_ids, strict=False)
        i = next(j for j, (a, b) in enumerate(pairs) if a != b)
        assert plain.logprobs is not None
        top = plain.logprobs[i].top
        assert len(top) == 2 and top[0][1] - top[1][1] < near_tie, (prompt, i, top)
    return ours.stats.accepted_tokens


def test_the_target_runs_in_llama_cpp(smol_gguf):
    assert smol_gguf.dtype_name == "gguf" and "llama.cpp" in smol_gguf.numerics
    engine = SpeculativeEngine.from_pretrained(smol_gguf, speculator="prompt-lookup")
    assert type(engine.target).__name__ == "LlamaCppTarget"
    assert not engine.batchable


@pytest.mark.parametrize("spec", ["prompt-lookup", "suffix", "lookahead", "draft"])
def test_greedy_output_equals_plain_decoding(smol_gguf, near_tie, spec):
    """Chains (prompt lookup, the draft) and trees (suffix, lookahead: verified branch by
    branch). The draft is the target's own GGUF in llama.cpp at a fixed K, so it drafts every
    step and is accepted."""
    if spec == "draft":
        spec = f"draft:model={default_gguf_path()},k=4"
    engine = SpeculativeEngine.from_pretrained(smol_gguf, speculator=spec, adaptive=False)
    accepted = sum(
        _same_or_near_tie(engine, p, near_tie, chat=chat, max_new_tokens=32, ignore_eos=True)
        for p in PROMPTS
        for chat in (False, True)
    )
    assert accepted >= 4  # drafts were verified and accepted, not only the plain path


def test_the_context_holds_the_committed_tokens(smol_gguf):
    """The cache invariant on token ids: after a request the context holds the prompt and every
    committed token but the last (the next step's root)."""
    engine = SpeculativeEngine.from_pretrained(smol_gguf, speculator="lookahead", adaptive=False)
    prompt_ids = encode_prompt(engine.tokenizer, PROMPTS[0])
    out = engine.generate(PROMPTS[0], max_new_tokens=24, ignore_eos=True)
    held = engine.target.runner.cache.tokens
    assert held[: len(prompt_ids)] == list(prompt_ids)
    assert held == list(prompt_ids) + out.token_ids[:-1]


def test_seeded_sampling_repeats(smol_gguf):
    engine = SpeculativeEngine.from_pretrained(smol_gguf, speculator="prompt-lookup")
    a = engine.generate(PROMPTS[0], max_new_tokens=20, temperature=0.8, seed=5)
    b = engine.generate(PROMPTS[0], max_new_tokens=20, temperature=0.8, seed=5)
    assert a.token_ids == b.token_ids


def test_bad_uses_are_clear_errors(smol_gguf, smol_dir):
    with pytest.raises(ConfigError, match="model directory"):
        load_model(smol_dir, dtype="gguf")
    with pytest.raises(ConfigError, match="on the CPU"):
        load_model(dtype="gguf", device="cuda:0")
    with pytest.raises(ConfigError, match="hidden states"):
        SpeculativeEngine.from_pretrained(smol_gguf, speculator="eagle")  # the shipped head
    engine = SpeculativeEngine.from_pretrained(smol_gguf, speculator="none")
    with pytest.raises(ConfigError, match="batched decoding"):
        engine.generate_batch(PROMPTS, max_new_tokens=4)


def test_cost_calibration_times_llama_cpp(smol_gguf):
    """`specdec calibrate cost --dtype gguf` times llama.cpp's passes (the verifier), keyed
    apart from the torch numerics' calibration."""
    from specdec.control.calibration import measure_verify_costs

    cal = measure_verify_costs(smol_gguf, sizes=(1, 2, 4), repeats=1, prefix_len=16)
    assert cal.dtype == "gguf" and set(cal.chain) == {1, 2, 4} and set(cal.tree) == {1, 2, 4}
    assert all(t > 0 for t in cal.chain.values())


def test_serving_never_loads_the_torch_copy(smol_gguf):
    """The float32 torch model beside llama.cpp loads only for what reads its weights: the
    tokenizer, config, identity and weight bytes come from files, so serving through llama.cpp
    holds the GGUF's bytes only. The identity (which keys trained speculators and calibrations)
    equals the torch-loaded model's, read from the file in slices."""
    loaded = load_model(dtype="gguf")
    assert not loaded.materialised
    for spec in (
        "prompt-lookup",
        "suffix",
        "lookahead",
        "auto",
        "draft:" + str(default_gguf_path()),
    ):
        engine = SpeculativeEngine.from_pretrained(loaded, speculator=spec)
        out = engine.generate(PROMPTS[0], max_new_tokens=8)
        assert out.token_ids
    assert not loaded.materialised, "a llama.cpp-served request loaded the torch copy"
    torch_loaded = load_model(dtype="float32-stock")
    assert loaded.identity() == torch_loaded.identity()  # maybe the digest saved earlier
    assert loaded.compute_embedding_digest() == torch_loaded._embedding_digest()
    assert loaded.eos_token_ids == torch_loaded.eos_token_ids
    assert loaded.parameter_count() == sum(p.numel() for p in torch_loaded.model.parameters())
    assert loaded.weight_bytes() == default_gguf_path().stat().st_size
    # what reads the target's own layers loads the copy on demand and works
    engine = SpeculativeEngine.from_pretrained(loaded, speculator="draft:layers:8")
    assert engine.generate(PROMPTS[0], max_new_tokens=8).token_ids
    assert loaded.materialised


def test_the_kv_cache_grows_on_demand(smol_gguf, near_tie, monkeypatch):
    """A context starts with INITIAL_CONTEXT KV slots and doubles when a request outgrows it,
    decoding what it held into the new cache. Those K/V come from one replay pass instead of the
    passes that first computed them, so later logits equal a never-grown context's up to
    llama.cpp's pass-shape rounding (``near_tie`` is twice that, measured: zero here for the
    bundled model, which makes this an exact comparison on this machine)."""
    model = llamacpp.shared_model(default_gguf_path())
    roomy = llamacpp.LlamaCppRunner(model)
    monkeypatch.setattr(llamacpp, "INITIAL_CONTEXT", 32)
    small = llamacpp.LlamaCppRunner(model)
    assert small.allocated == 32 and roomy.allocated > 128
    tokens = list(range(100, 190))
    outs = []
    for runner in (small, roomy):
        first = runner.forward(tokens[:20])
        middle = runner.forward_all(tokens[20:50])  # past 32 slots: grows to 64
        runner.cache.rollback(45)  # rollback works on the grown cache
        last = runner.forward(tokens[45:90])  # past 64: grows to 128
        outs.append((first, middle, last))
        assert runner.cache.tokens == tokens
    assert small.allocated == 128
    for a, b in zip(outs[0], outs[1], strict=True):
        assert float((a - b).abs().max()) <= near_tie / 2
    with pytest.raises(ConfigError, match="context holds"):
        small.forward([5] * small.context_length)


def test_verification_rows_come_back_in_order_across_passes(smol_gguf, near_tie, monkeypatch):
    """forward_all reuses one batch of PASS slots and reads every row in a single copy; a
    request longer than PASS takes several passes. Each row must be its own token's logits, in
    order: compared with one-token passes (equal up to llama.cpp's pass-shape rounding, which
    ``near_tie`` doubles; measured zero here for the bundled model)."""
    model = llamacpp.shared_model(default_gguf_path())
    monkeypatch.setattr(llamacpp, "PASS", 8)
    runner = llamacpp.LlamaCppRunner(model)
    tokens = list(range(300, 320))
    runner.forward([1, 2, 3])
    rows = runner.forward_all(tokens)  # passes of 8, 8 and 4
    assert rows.shape == (20, runner.vocab_size) and runner.cache.tokens == [1, 2, 3] + tokens
    runner.cache.rollback(3)
    single = torch.cat([runner.forward_all([t]) for t in tokens])
    assert float((rows - single).abs().max()) <= near_tie / 2
    assert rows.argmax(-1).tolist() == single.argmax(-1).tolist()
    # the rows differ from one another: a mix-up of rows could not pass the comparison above
    assert float((rows[0] - rows[1]).abs().max()) > 1.0


def test_llamacpp_plain_is_the_reference_our_plain_gguf_decoding_reproduces(smol_gguf):
    """plain_greedy (llama.cpp's own sampler, one token per decode) gives the tokens of our
    plain decoding through the llama.cpp backend, one-token passes in both, so --compare's
    ratio sets like against like."""
    engine = SpeculativeEngine.from_pretrained(smol_gguf)
    for prompt in PROMPTS:
        ids = encode_prompt(smol_gguf.tokenizer, prompt, True)
        ours = engine.generate(prompt, chat=True, max_new_tokens=24, speculate=False)
        peer = llamacpp.plain_greedy(default_gguf_path(), ids, 24, smol_gguf.eos_token_ids)
        assert peer.token_ids == ours.token_ids
        assert peer.seconds > 0 and peer.tokens_per_s > 0


def test_compare_times_llamacpp_on_the_targets_gguf_file(tiny_model_dir):
    """`generate --compare` on a GGUF target reports llama.cpp's plain speed on that file and
    our ratio to it; a model directory has no file to compare, and says so."""
    from typer.testing import CliRunner

    from specdec.cli.main import app

    args = ["generate", "--speculator", "prompt-lookup", "--compare", "-n", "16", "--json"]
    run = CliRunner().invoke(app, [*args, "--threads", "1", "Count from one to ten."])
    assert run.exit_code == 0, run.output
    doc = json.loads(run.stdout)
    assert doc["llamacpp_plain"]["new_tokens"] >= 1 and doc["llamacpp_plain"]["tokens_per_s"] > 0
    ours = doc["stats"]["tokens_per_s"]
    assert doc["vs_llamacpp"] == pytest.approx(ours / doc["llamacpp_plain"]["tokens_per_s"], 1e-3)
    run = CliRunner().invoke(app, [*args, "--model", str(tiny_model_dir), "hello"])
    assert run.exit_code == 0, run.output
    assert "llamacpp_plain" not in json.loads(run.stdout)
    assert "no GGUF file" in run.stderr
