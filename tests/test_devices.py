"""Device handling: device names, per-device numerics, the sampling generator's device, chat
templates for models without one. Device-generic code is tested on the CPU; tests marked
``cuda`` run where a CUDA GPU is present and are skipped elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec import SpeculativeEngine
from specdec.errors import ConfigError, InvalidRequestError
from specdec.request import default_chat, encode_prompt, read_chat_template
from specdec.target import load_model
from specdec.target.numerics import check_numerics_device, get_numerics, resolve_device
from specdec.verify import make_generator

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
PROMPT = "ROMEO: But soft, what light through yonder window breaks?"


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path):
    return load_model(tiny_model_dir, device="cpu")


def test_device_names():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if HAS_CUDA else "cpu")
    for bad in ("tpu", "gpu0", "cuda:x"):
        with pytest.raises(ConfigError, match="cpu, cuda, cuda:N or auto"):
            resolve_device(bad)
    if not HAS_CUDA:
        with pytest.raises(ConfigError, match="no CUDA GPU.*--device cpu"):
            resolve_device("cuda")
    with pytest.raises(ConfigError):
        resolve_device(f"cuda:{torch.cuda.device_count() + 3}")


def test_cpu_only_numerics_are_refused_elsewhere_before_loading(tiny_model_dir):
    with pytest.raises(ConfigError, match="CPU only"):
        check_numerics_device(get_numerics("fp16-weights"), torch.device("cuda"))
    check_numerics_device(get_numerics("float32"), torch.device("cuda"))  # stock cuBLAS there
    if not HAS_CUDA:
        with pytest.raises(ConfigError, match="no CUDA GPU"):
            load_model(tiny_model_dir, device="cuda")


def test_model_generator_and_seeded_sampling_live_on_the_device(tiny):
    assert tiny.device == torch.device("cpu")
    engine = SpeculativeEngine.from_pretrained(tiny, speculator="draft:layers:2")
    assert engine.target.device == tiny.device  # type: ignore[attr-defined]
    assert make_generator(1, tiny.device).device == tiny.device
    runs = [
        engine.generate(PROMPT, max_new_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
        for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids


def test_chat_template_missing_given_and_explicit(tiny, tiny_model_dir, tmp_path, caplog):
    tok = tiny.tokenizer
    assert default_chat(tok).chat  # the tiny tokenizer has a template
    bare = load_model(tiny_model_dir)
    bare.tokenizer.chat_template = None
    with caplog.at_level("WARNING"):
        first, second = default_chat(bare.tokenizer), default_chat(bare.tokenizer)
    assert not first.chat and first.note and "plain text" in first.note
    assert second == first
    assert sum("no chat template" in r.message for r in caplog.records) == 1  # said once
    with pytest.raises(InvalidRequestError, match="chat_template=.*--chat-template FILE"):
        default_chat(bare.tokenizer, chat=True)
    with pytest.raises(InvalidRequestError, match="--chat-template FILE"):
        encode_prompt(bare.tokenizer, PROMPT, chat=True)
    assert encode_prompt(bare.tokenizer, PROMPT) == encode_prompt(tok, PROMPT)  # plain completion

    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    for given in (template, path, str(path)):
        assert read_chat_template(given) == template
    with_file = load_model(tiny_model_dir, chat_template=path)
    assert (
        encode_prompt(with_file.tokenizer, "hi", chat=True)
        == with_file.tokenizer("[hi]")["input_ids"]
    )
    with pytest.raises(ConfigError, match="neither a file nor a Jinja template"):
        read_chat_template(tmp_path / "missing.jinja")
    with pytest.raises(ConfigError, match="does not parse"):
        read_chat_template("{% for m in messages %}")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize(
    "spec", ["prompt-lookup", "suffix", "lookahead", "draft:model=layers:2", "self:layers=exit:2"]
)
def test_cuda_greedy_equals_plain(tiny_model_dir, spec):
    loaded = load_model(tiny_model_dir, dtype="float64", device="cuda")
    assert loaded.device.type == "cuda"
    engine = SpeculativeEngine.from_pretrained(loaded, speculator=spec, num_draft_tokens=4)
    plain = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True, speculate=False)
    ours = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    assert ours.token_ids == plain.token_ids


@pytest.mark.cuda
@cuda
def test_cuda_seeded_sampling_repeats(tiny_model_dir):
    loaded = load_model(tiny_model_dir, device="cuda")
    engine = SpeculativeEngine.from_pretrained(loaded, speculator="draft:layers:2")
    runs = [
        engine.generate(PROMPT, max_new_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
        for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("spec", ["prompt-lookup", "draft:model=layers:2"])
def test_cuda_batched_greedy_equals_solo(tiny_model_dir, spec):
    """The batched path (one pass verifies every sequence's draft) on the GPU: each sequence
    equals its solo greedy output (float64, so a k-token pass and k single ones agree)."""
    loaded = load_model(tiny_model_dir, dtype="float64", device="cuda")
    engine = SpeculativeEngine.from_pretrained(loaded, speculator=spec, num_draft_tokens=4)
    prompts = [PROMPT, "To be, or not to be", PROMPT + " It is the east", "Once more unto"]
    solo = [engine.generate(p, max_new_tokens=20, ignore_eos=True).token_ids for p in prompts]
    batched = engine.generate_batch(prompts, max_new_tokens=20, ignore_eos=True, max_batch=3)
    assert [r.token_ids for r in batched] == solo
