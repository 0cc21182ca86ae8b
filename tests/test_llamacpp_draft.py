"""A draft run by llama.cpp from its GGUF file (``draft:...,dtype=gguf``).

The target is the bundled SmolLM2-135M-Instruct in float64, so a k-token verification pass and
k single-token passes agree to the last bit and greedy outputs compare for exact equality; the
draft is the same model's Q4_1 GGUF run by llama.cpp (other numerics, other engine), which
agrees with the target often but not always: both acceptance and rejection paths run.
"""

from __future__ import annotations

import pytest
import torch

from specdec import SpeculativeEngine
from specdec.errors import ConfigError
from specdec.speculators.spec import parse_spec
from specdec.target import llamacpp, load_model
from specdec.target.loading import default_gguf_path

pytestmark = pytest.mark.slow

needs_llama = pytest.mark.skipif(
    not llamacpp.available(),
    reason="llama-cpp-python is not installed (bash scripts/install.sh installs it)",
)

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Repeat after me exactly: the quick brown fox jumps over the lazy dog.",
    "What are three tips for staying healthy?",
]


def _accepted_where_greedy_equals_plain(engine, plain) -> int:
    """Asserts every prompt's greedy output equals plain decoding; returns the tokens accepted."""
    accepted = 0
    for prompt in PROMPTS:
        expected = plain.generate(prompt, chat=True, max_new_tokens=32, speculate=False)
        got = engine.generate(prompt, chat=True, max_new_tokens=32)
        assert got.token_ids == expected.token_ids, prompt
        accepted += got.stats.accepted_tokens
    return accepted


@pytest.fixture(scope="module")
def smol64(smol_dir):
    return load_model(smol_dir, dtype="float64")


def test_amx_is_read_from_the_cpu_flags_line_alone():
    """AMX CPUs load GGUF files without llama.cpp's extra buffer types (its AMX buffers crashed
    the first decode there); the detection reads whole flags, not substrings or other lines."""
    assert llamacpp.has_amx("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n")
    assert not llamacpp.has_amx("flags\t\t: fpu avx2 avx512f avx512_vnni avx512_bf16\n")
    assert not llamacpp.has_amx("model name\t: amx_tile\nflags\t\t: fpu avx2\n")
    assert not llamacpp.has_amx("flags\t\t: fpu no_amx_tile_here\n")


def test_bad_specs_fail_before_anything_loads():
    with pytest.raises(ConfigError, match="chains only"):
        parse_spec("draft:model=x.gguf,dtype=gguf,tree=auto")
    with pytest.raises(ConfigError, match="vocab="):
        parse_spec("draft:model=x.gguf,dtype=gguf,vocab=1024")
    with pytest.raises(
        ConfigError, match="dtype=gguf-q9 is not a llama.cpp draft numerics.*gguf-q4_0"
    ):
        parse_spec("draft:model=x.gguf,dtype=gguf-q9")
    with pytest.raises(ConfigError, match="chains only"):
        parse_spec("draft:model=x.gguf,dtype=gguf-q4_0,tree=auto")


@needs_llama
def test_greedy_output_equals_plain_decoding(smol64):
    plain = SpeculativeEngine.from_pretrained(smol64, speculator="none")
    spec = f"draft:model={default_gguf_path()},dtype=gguf,k=6"
    engine = SpeculativeEngine.from_pretrained(smol64, speculator=spec)
    accepted = _accepted_where_greedy_equals_plain(engine, plain)
    # the Q4_1 copy of the target agrees with it most of the time: the draft really drafted
    assert accepted >= 24


@needs_llama
def test_a_requantized_draft_is_made_once_and_stays_lossless(smol64):
    """dtype=gguf-q4_0 (the default for a GGUF draft on a CPU) requantizes the draft's file once
    into the cache: another build reuses it, and the output is still the target's own."""
    from specdec.target.loading import cache_root

    plain = SpeculativeEngine.from_pretrained(smol64, speculator="none")
    spec = f"draft:model={default_gguf_path()},dtype=gguf-q4_0,k=6"
    engine = SpeculativeEngine.from_pretrained(smol64, speculator=spec)
    (made,) = (cache_root() / "requant").glob("*.q4_0.*.gguf")
    assert "requantized to Q4_0" in engine.speculator.description
    assert made.stat().st_size < default_gguf_path().stat().st_size  # Q4_1 -> Q4_0: smaller
    mtime = made.stat().st_mtime_ns
    SpeculativeEngine.from_pretrained(smol64, speculator=spec)
    assert made.stat().st_mtime_ns == mtime and not list(made.parent.glob("*.tmp"))
    accepted = _accepted_where_greedy_equals_plain(engine, plain)
    assert accepted >= 16  # the twice-rounded copy still agrees with the target often


@needs_llama
def test_runner_rolls_back_exactly_and_requests_have_their_own_cache():
    model = llamacpp.LlamaModel(default_gguf_path())
    runner = llamacpp.LlamaCppRunner(model, threads=1)
    prefix = list(range(100, 160))
    runner.forward(prefix)
    first = runner.forward([5, 6, 7])
    runner.forward([9, 9, 9, 9])
    runner.cache.rollback(len(prefix))
    assert runner.cache.tokens == prefix
    # the same batches after a rollback: bit for bit the same logits
    assert torch.equal(runner.forward([5, 6, 7]), first)
    other = runner.sibling()
    assert len(other.cache) == 0
    other.forward(prefix)
    assert torch.equal(other.forward([5, 6, 7]), first)
    assert len(runner.cache) == len(prefix) + 3
    with pytest.raises(ValueError, match="roll back"):
        runner.cache.rollback(1000)
    with pytest.raises(ConfigError, match="holds"):
        runner.forward([1] * (runner.context_length + 1))
    assert len(runner.cache) == len(prefix) + 3  # a refused forward leaves the cache alone


@needs_llama
def test_a_finished_requests_draft_context_is_freed_at_once(monkeypatch):
    """A request's llama.cpp context (its draft KV cache, tens of MB for the Qwen 0.5B) goes
    when the request does, not when the cyclic garbage collector next runs: a server's RSS
    grew from 3 to 15 GB over 500 requests while runner and cache referred to each other."""
    import gc
    import weakref

    from specdec.batch.scheduler import BatchScheduler
    from specdec.config import GenerationConfig

    runners: weakref.WeakSet[llamacpp.LlamaCppRunner] = weakref.WeakSet()
    init = llamacpp.LlamaCppRunner.__init__

    def tracked(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        runners.add(self)

    monkeypatch.setattr(llamacpp.LlamaCppRunner, "__init__", tracked)
    engine = SpeculativeEngine.from_pretrained(
        None, speculator=f"draft:model={default_gguf_path()}"
    )
    sched = BatchScheduler(engine, max_batch=4)
    ids = engine.tokenizer("Write a short poem about the sea.")["input_ids"]

    def live() -> int:
        return len(runners)

    gc.collect()
    before = live()
    gc.disable()
    try:
        for _ in range(3):
            for _ in range(4):
                sched.add(ids, GenerationConfig(max_new_tokens=6, ignore_eos=True))
            while not sched.idle:
                sched.step()
        assert live() == before  # the requests' forked runners are gone without a collection
    finally:
        gc.enable()


@needs_llama
def test_a_model_directory_is_refused_and_another_vocabulary_drafts_through_text(
    smol64, tiny_model_dir, tiny64
):
    with pytest.raises(ConfigError, match="not a GGUF file"):
        SpeculativeEngine.from_pretrained(
            smol64, speculator=f"draft:model={tiny_model_dir},dtype=gguf"
        )
    from specdec.speculators.cross_vocab import CrossVocabSpeculator

    # the bundled GGUF in llama.cpp drafting for a target with another tokenizer: through text
    engine = SpeculativeEngine.from_pretrained(
        tiny64, speculator=f"draft:model={default_gguf_path()},dtype=gguf"
    )
    assert isinstance(engine.speculator, CrossVocabSpeculator)
    for prompt in ("the the the the", "ROMEO: But soft, what light"):
        plain = engine.generate(prompt, max_new_tokens=16, ignore_eos=True, speculate=False)
        got = engine.generate(prompt, max_new_tokens=16, ignore_eos=True)
        assert got.token_ids == plain.token_ids


def test_missing_llama_cpp_names_the_install_step(monkeypatch, smol64):
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    with pytest.raises(ConfigError, match="install.sh"):
        SpeculativeEngine.from_pretrained(
            smol64, speculator=f"draft:model={default_gguf_path()},dtype=gguf"
        )


@needs_llama
def test_past_the_drafts_context_the_request_goes_on_without_drafts(smol64):
    """A llama.cpp draft holds 16,384 tokens; a longer request must not fail, only stop drafting
    (shown with the context cut to 40 tokens)."""
    plain = SpeculativeEngine.from_pretrained(smol64, speculator="none")
    engine = SpeculativeEngine.from_pretrained(
        smol64, speculator=f"draft:model={default_gguf_path()},dtype=gguf"
    )
    engine.speculator.runner.context_length = 40
    prompt = PROMPTS[1]
    expected = plain.generate(prompt, chat=True, max_new_tokens=24, speculate=False)
    got = engine.generate(prompt, chat=True, max_new_tokens=24)
    assert got.token_ids == expected.token_ids
    assert got.stats.prompt_tokens > 40 and got.stats.drafted_tokens == 0


@needs_llama
def test_a_gguf_draft_defaults_to_the_requantized_file_on_a_cpu(smol_dir):
    """With no dtype= a GGUF draft for a CPU target runs in llama.cpp, requantized to Q4_0 (the
    fastest measured: experiments/draft-model/2026-12-05-draft-requant.md); dtype=gguf keeps
    the file as it is."""
    target = load_model(smol_dir)
    default = SpeculativeEngine.from_pretrained(target, speculator=f"draft:{default_gguf_path()}")
    assert default.speculator.description.endswith("(llama.cpp, requantized to Q4_0)")
    as_is = SpeculativeEngine.from_pretrained(
        target, speculator=f"draft:model={default_gguf_path()},dtype=gguf"
    )
    assert as_is.speculator.description.endswith("(llama.cpp)")


@needs_llama
def test_a_failed_requantization_falls_back_only_for_the_default(smol_dir, monkeypatch):
    """A requantization the user did not ask for never stops the draft: it runs the file as it
    is. One asked for with dtype=gguf-q4_0 fails with the reason."""

    def no_room(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(llamacpp, "requantized", no_room)
    target = load_model(smol_dir)
    default = SpeculativeEngine.from_pretrained(target, speculator=f"draft:{default_gguf_path()}")
    assert default.speculator.description.endswith("(llama.cpp)")
    with pytest.raises(OSError, match="No space left"):
        SpeculativeEngine.from_pretrained(
            target, speculator=f"draft:model={default_gguf_path()},dtype=gguf-q4_0"
        )


def test_a_gguf_draft_in_a_torch_dtype_is_loaded_from_its_file(smol64):
    """``draft:model=FILE.gguf,dtype=float32`` runs the file's weights in torch (the file is
    converted, as a GGUF target is); it was read as a model directory and refused."""
    from specdec.target import ModelRunner

    spec = f"draft:model={default_gguf_path()},dtype=float32"
    engine = SpeculativeEngine.from_pretrained(smol64, speculator=spec)
    assert isinstance(engine.speculator.runner, ModelRunner)  # type: ignore[attr-defined]
    prompt = "Repeat: the cat sat on the mat, the cat sat on the mat, the cat"
    fast = engine.generate(prompt, max_new_tokens=16)
    assert fast.token_ids == engine.generate(prompt, max_new_tokens=16, speculate=False).token_ids
    assert fast.stats.accepted_tokens > 0
