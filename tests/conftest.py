"""Shared fixtures: real tiny models on disk, and the real bundled model.

Tiny models are genuine Hugging Face model directories (config.json + safetensors + a BPE
tokenizer trained here on Tiny Shakespeare), with random weights, so the whole loading and
decoding path runs exactly as for a user's model, in milliseconds per token.

No test sees the developer's cache (``~/.cache/specdec``: saved calibrations, converted models).
Each test gets its own empty cache home (``XDG_CACHE_HOME``, which subprocesses inherit), whose
``specdec/gguf`` (the GGUF -> safetensors conversions, keyed by the GGUF's content hash) links
to one store shared by all tests and kept between runs in pytest's cache directory, so the
bundled model is converted once, not once per test or per run.
"""

from __future__ import annotations

import functools
import lzma
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# The CLI pins its process to the cores that are not busy (specdec.cores); CLI commands run
# inside the test process would pin the whole session. tests/test_cores.py switches it on.
os.environ.setdefault("SPECDEC_PIN_THREADS", "0")
# The team's public data sets (training corpora and prompt sets; see its README.md), kept beside
# the checkout rather than in it. A clone without them still passes: the tests that need them
# skip (see shared_data). SPECDEC_SHARED_DATA points elsewhere, or at a missing path to check that.
SHARED_DATA = Path(os.environ.get("SPECDEC_SHARED_DATA", REPO.parent / "shared" / "data"))
SHARED = SHARED_DATA.parent
# Tiny Shakespeare (karpathy/char-rnn, public-domain text; shared/data/README.md lists it), a
# copy in the repository: the tiny tokenizers are trained on it, and a tokenizer trained on other
# text would change which tokens the fixtures' models draft, so every clone must train on it.
CORPUS_XZ = REPO / "tests" / "data" / "tinyshakespeare.txt.xz"
SHARED_DATA_HINT = (
    "the team's shared data sets (../shared/data beside the checkout, or SPECDEC_SHARED_DATA; "
    "each file is a public data set listed with its source in shared/data/README.md)"
)

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def shared_data(relative: str) -> Path:
    """``SHARED_DATA / relative``, or skip the test saying what is missing and where to get it."""
    path = SHARED_DATA / relative
    if not path.exists():
        pytest.skip(f"needs {path}: {relative} from {SHARED_DATA_HINT}")
    return path


def spec_bench_questions() -> list[dict]:
    """Spec-Bench's questions, shipped with the package (specdec/bench/data)."""
    import json

    from specdec.bench.workloads import SPEC_BENCH_QUESTIONS

    lines = SPEC_BENCH_QUESTIONS.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@functools.cache
def corpus_lines() -> tuple[str, ...]:
    """The lines of the repository's copy of Tiny Shakespeare (what the tiny tokenizers and
    prompts are made from, whether or not the shared data sets are beside the checkout)."""
    return tuple(lzma.decompress(CORPUS_XZ.read_bytes()).decode("utf-8").splitlines())


def build_tokenizer(vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<eos>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(out)


def build_tiny_model(
    out: Path,
    tokenizer_dir: Path,
    *,
    seed: int,
    layers: int = 4,
    hidden: int = 64,
    init_range: float = 0.25,
    context: int = 512,
) -> Path:
    """A random-weight Llama with peaked distributions (large init) so argmax ties are rare."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        initializer_range=init_range,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        pad_token_id=tok.eos_token_id,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(autouse=True)
def _threads_for_size(request: pytest.FixtureRequest):
    """Tiny models and tables: one thread, since waking a second OpenMP thread costs more than
    their maths (and far more on a loaded machine). Tests of the real model (``slow``) keep all
    threads; ``slow(threads=1)`` marks a test in the slow tier for its length alone, which keeps
    the one thread it had in the fast tier."""
    slow = request.node.get_closest_marker("slow")
    if slow is not None and slow.kwargs.get("threads") != 1:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass(frozen=True)
class CacheLocations:
    real_root: Path  # the developer's cache root, as the library computes it outside the tests
    models: Path  # a cache root holding only ``gguf/``: conversions shared by every test
    session_home: Path  # the XDG_CACHE_HOME of session-scoped subprocesses (the test servers)


def cache_home_sharing_models(home: Path, models: Path) -> Path:
    """``home`` as an empty XDG cache home whose ``specdec/gguf`` is the shared ``models/gguf``."""
    (home / "specdec").mkdir(parents=True)
    (home / "specdec" / "gguf").symlink_to(models / "gguf", target_is_directory=True)
    return home


@pytest.fixture(scope="session", autouse=True)
def specdec_cache(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CacheLocations]:
    from specdec.target import loading

    real_root = loading.cache_root()
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    models = cache.mkdir("specdec-models") if cache else tmp_path_factory.mktemp("models")
    (models / "gguf").mkdir(exist_ok=True)
    home = cache_home_sharing_models(tmp_path_factory.mktemp("cache-home-session"), models)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(home))
        yield CacheLocations(real_root, models, home)


@pytest.fixture(autouse=True)
def isolated_cache(
    specdec_cache: CacheLocations,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> Path:
    """This test's own, initially empty, specdec cache root (converted models aside). A test
    may still point XDG_CACHE_HOME elsewhere; the real user cache is refused outright."""
    from specdec.target import files, loading

    home = cache_home_sharing_models(tmp_path_factory.mktemp("cache-home"), specdec_cache.models)
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    computed = files.cache_root
    real = specdec_cache.real_root.resolve()

    def cache_root() -> Path:
        root = computed()
        if root.resolve().is_relative_to(real):
            pytest.fail(f"a test reached the real user cache {root}")
        return root

    monkeypatch.setattr(files, "cache_root", cache_root)  # what specdec.target reads
    monkeypatch.setattr(loading, "cache_root", cache_root)  # its old home, still imported
    return home / "specdec"


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tokenizer(384, out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_target"), tiny_tokenizer_dir, seed=0)


@pytest.fixture(scope="module")
def tiny64(tiny_model_dir: Path):
    """The tiny target in float64, where a k-token pass and k single passes agree to ~1e-15,
    so greedy outputs compare for exact equality."""
    from specdec.target import load_model

    return load_model(tiny_model_dir, dtype="float64")


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """A second, smaller model with the target's vocabulary (different random weights)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny_draft"), tiny_tokenizer_dir, seed=1, layers=1
    )


@pytest.fixture(scope="session")
def other_vocab_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok_dir = tmp_path_factory.mktemp("other_tokenizer")
    build_tokenizer(320, tok_dir)
    return build_tiny_model(tmp_path_factory.mktemp("other_vocab"), tok_dir, seed=2, layers=1)


@pytest.fixture(scope="session")
def smol_dir(specdec_cache: CacheLocations) -> Path:
    """The bundled SmolLM2-135M-Instruct, converted once into the shared store (slow tests)."""
    from specdec.errors import ModelNotFoundError
    from specdec.target.loading import convert_gguf, default_gguf_path

    try:
        gguf = default_gguf_path()
    except ModelNotFoundError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))
    return convert_gguf(gguf, root=specdec_cache.models)
