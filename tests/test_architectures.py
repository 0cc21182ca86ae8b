"""The architecture matrix: tiny random-weight models of each supported family, built from configs.

For every architecture: the capability probe accepts it; a branching tree's logits equal those of
transformers' own forward of each root-to-node path (an independent reference that builds its
own, windowed, masks); committing a non-contiguous path leaves the cache equal to a fresh prefill;
and greedy output equals plain decoding for every training-free speculator that applies, chains
and trees, with the KV-cache invariant checked after every step. Sliding-window models use a
window shorter than the test sequences, so the window matters (checked too).

Everything runs in float64, where a batched verification pass and single-token passes agree to
~1e-15, so token ids must be equal. ``docs/architectures.md`` is generated from :data:`MATRIX`
(``python bench/arch_table.py``) and checked here, so it cannot drift from what is tested.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
)

from specdec import SpeculativeEngine
from specdec.config import GenerationConfig
from specdec.target import HFTarget, ModelRunner, load_model
from specdec.tree import DraftTree

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "docs" / "architectures.md"
WINDOW = 8  # sliding window of the sliding models: shorter than every test sequence
COMMON = {"initializer_range": 0.25, "max_position_embeddings": 256, "tie_word_embeddings": True}
LAYERED = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}


@dataclass(frozen=True)
class Arch:
    """One row of the matrix: how to build its config, and what it exercises."""

    name: str  # as shown in the table
    config: Callable[[int, int], PretrainedConfig]  # (vocab size, eos id) -> config
    attention: str  # what the table says about its attention layers
    layered: bool = True  # decoder layers at `.model.layers`: layer-subset drafts apply


def _ids(vocab: int, eos: int) -> dict[str, int | None]:
    return {"vocab_size": vocab, "eos_token_id": eos, "pad_token_id": eos, "bos_token_id": None}


MATRIX: tuple[Arch, ...] = (
    Arch(
        "Llama",
        lambda v, e: LlamaConfig(
            **_ids(v, e), **COMMON, **LAYERED, intermediate_size=128, num_hidden_layers=3
        ),
        "full",
    ),
    Arch(
        "Qwen2",
        lambda v, e: Qwen2Config(
            **_ids(v, e), **COMMON, **LAYERED, intermediate_size=128, num_hidden_layers=3
        ),
        "full",
    ),
    Arch(
        "Qwen2 (use_sliding_window)",
        lambda v, e: Qwen2Config(
            **_ids(v, e),
            **COMMON,
            **LAYERED,
            intermediate_size=128,
            num_hidden_layers=4,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=2,
        ),
        f"full + sliding ({WINDOW}), per-layer-type masks",
    ),
    Arch(
        "Mistral",
        lambda v, e: MistralConfig(
            **_ids(v, e),
            **COMMON,
            **LAYERED,
            intermediate_size=128,
            num_hidden_layers=3,
            sliding_window=WINDOW,
        ),
        f"sliding ({WINDOW}) in every layer",
    ),
    Arch(
        "Gemma-3",
        lambda v, e: Gemma3TextConfig(
            **_ids(v, e),
            **COMMON,
            **LAYERED,
            head_dim=16,
            intermediate_size=128,
            num_hidden_layers=4,
            sliding_window=WINDOW,
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
        ),
        f"local sliding ({WINDOW}) + global, per-layer-type masks",
    ),
    Arch(
        "Phi-3",
        lambda v, e: Phi3Config(
            **_ids(v, e), **COMMON, **LAYERED, intermediate_size=128, num_hidden_layers=3
        ),
        "full, fused qkv",
    ),
    Arch(
        "GPT-2",
        lambda v, e: GPT2Config(
            **_ids(v, e),
            initializer_range=0.25,
            n_positions=256,
            n_embd=64,
            n_layer=3,
            n_head=4,
        ),
        "full, learned absolute positions",
        layered=False,
    ),
    Arch(
        "Mixtral (MoE)",
        lambda v, e: MixtralConfig(
            **_ids(v, e),
            **COMMON,
            **LAYERED,
            intermediate_size=64,
            num_hidden_layers=2,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        "full, 4 experts top-2",
    ),
)

# every training-free speculator: (spec, whether it drafts trees, needs `.model.layers`)
SPECULATORS: tuple[tuple[str, bool, bool], ...] = (
    ("prompt-lookup", False, False),
    ("suffix", True, False),
    ("lookahead:window=3,ngram=3,guesses=4", True, False),
    ("draft:model=layers:1", False, True),
    ("self:layers=exit:1", False, True),
)
PROMPTS = (
    "ROMEO: But soft, what light through yonder window breaks? It is the east, and",
    "the the the the the the the the the the",
)
NEW_TOKENS = 20
BY_NAME = {a.name: a for a in MATRIX}


def applies(arch: Arch, spec: str) -> bool:
    return next(layered for s, _, layered in SPECULATORS if s == spec) <= arch.layered


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path):
    """Each architecture saved once as a real model directory (config + safetensors + the
    tiny tokenizer), built lazily."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
            torch.manual_seed(0)
            cfg = BY_NAME[name].config(len(tok), int(tok.eos_token_id))
            model = AutoModelForCausalLM.from_config(cfg)
            out = tmp_path_factory.mktemp(name.split()[0].lower())
            model.save_pretrained(out)
            tok.save_pretrained(out)
            built[name] = out
        return built[name]

    return get


@pytest.fixture(scope="module")
def loaded(arch_dirs):
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_model(arch_dirs(name), dtype="float64")
        return cache[name]

    return get


def assert_cache_equals_prefill(runner: ModelRunner) -> None:
    ref = ModelRunner(runner.model)
    ref.forward(runner.cache.tokens)
    assert len(runner.cache.hf.layers) == len(ref.cache.hf.layers)
    for got, want in zip(runner.cache.hf.layers, ref.cache.hf.layers, strict=True):
        if want.keys is None:
            assert got.keys is None
            continue
        assert got.keys.shape == want.keys.shape
        torch.testing.assert_close(got.keys, want.keys, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(got.values, want.values, atol=1e-9, rtol=1e-9)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' own forward, no cache, its own masks: the independent reference.  # [V]"""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


ARCH_IDS = [a.name for a in MATRIX]


@pytest.mark.parametrize("name", ARCH_IDS)
def test_probe_accepts_and_tree_matches_transformers(loaded, name):
    target = HFTarget(loaded(name))  # runs the capability probe
    runner = ModelRunner(target.loaded.model)
    model = runner.model
    prefix = list(range(5, 5 + WINDOW + 4))  # longer than the window
    runner.forward(prefix)
    tree = DraftTree(
        tokens=(9, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39),
        parents=(-1, 0, 0, 1, 2, 2, 5, 6, 7, 8, 9),  # branching, deeper than the window
    )
    logits = runner.forward_tree(tree)
    for node in range(len(tree)):
        path = [tree.tokens[i] for i in tree.path_to(node)]
        torch.testing.assert_close(logits[node], hf_logits(model, prefix + path), atol=1e-9, rtol=0)
    runner.cache.commit(len(prefix), [0, 2, 5, 6, 7, 8, 9, 10])
    assert runner.cache.tokens == prefix + [9, 31, 34, 35, 36, 37, 38, 39]
    assert_cache_equals_prefill(runner)


@pytest.mark.parametrize("name", [a.name for a in MATRIX if "sliding" in a.attention])
def test_the_window_matters(loaded, name):
    """The same weights with an unbounded window compute other logits past the window, so the
    tests above do check windowed attention."""
    model = loaded(name).model
    cfg = copy.deepcopy(model.config)
    cfg.sliding_window = 10_000
    wide = type(model)(cfg).to(torch.float64).eval()
    wide.load_state_dict(model.state_dict())
    ids = list(range(5, 5 + 3 * WINDOW))
    assert not torch.allclose(hf_logits(model, ids), hf_logits(wide, ids), atol=1e-6)


@pytest.mark.parametrize("name", ARCH_IDS)
def test_plain_equals_hf_generate(loaded, name):
    """Plain decoding through the engine equals transformers' greedy generate, which uses its
    own (evicting) sliding-window cache."""
    from tests.test_equivalence_tiny import hf_greedy

    lm = loaded(name)
    engine = SpeculativeEngine.from_pretrained(lm)
    ids = engine.encode(PROMPTS[0])
    ours = engine.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS, ignore_eos=True, speculate=False)
    assert ours.token_ids == hf_greedy(lm, ids, NEW_TOKENS)


CASES = [
    pytest.param(a.name, s, id=f"{a.name}-{s.split(':')[0]}")
    for a in MATRIX
    for s, _, _ in SPECULATORS
    if applies(a, s)
]


@pytest.mark.parametrize("name,spec", CASES)
def test_greedy_equals_plain_with_cache_invariant(loaded, name, spec):
    engine = SpeculativeEngine.from_pretrained(
        loaded(name), speculator=spec, num_draft_tokens=4, adaptive=False
    )
    runner = engine.target.runner  # type: ignore[attr-defined]
    drafted = 0  # over all prompts: the speculator did draft, the accept walk ran
    for prompt in PROMPTS:
        plain = engine.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, speculate=False)
        ids = engine.encode(prompt)
        committed = list(ids)
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        for event in engine.stream_ids(ids, config):
            committed.extend(event.token_ids)
            if event.finish_reason is None:
                assert runner.cache.tokens == committed[:-1]
            assert_cache_equals_prefill(runner)
            if event.finish_reason is not None:
                drafted += event.stats.drafted_tokens
        assert committed[len(ids) :] == plain.token_ids, (name, spec, prompt)
    assert drafted > 0


def render_table() -> str:
    """docs/architectures.md, from :data:`MATRIX` and :data:`SPECULATORS`."""
    short = [s.split(":")[0] + (":layers:N" if "layers" in s else "") for s, _, _ in SPECULATORS]
    short = [
        {"draft:layers:N": "draft `layers:N`", "self:layers:N": "self `exit:N`"}.get(s, s)
        for s in short
    ]
    head = "| architecture | attention | " + " | ".join(short) + " |"
    rule = "|" + "---|" * (2 + len(SPECULATORS))
    rows = []
    for a in MATRIX:
        cells = ["yes" if applies(a, s) else "n/a" for s, _, _ in SPECULATORS]
        rows.append(f"| {a.name} | {a.attention} | " + " | ".join(cells) + " |")
    return "\n".join(
        [
            "# Supported architectures",
            "",
            "Generated by `python bench/arch_table.py` from the matrix in",
            "`tests/test_architectures.py`, which checks that it is current. Every row is a tiny",
            "random-weight model built from that family's config and run in CI: the capability",
            "probe, tree verification against transformers' own forward, cache compaction, the",
            "KV-cache invariant after every step, and greedy output equal to plain decoding for",
            "each speculator marked `yes` (chains and branching trees). `n/a`: the speculator",
            "needs decoder layers at `.model.layers`. Trained speculators (EAGLE, Medusa, OSD)",
            "work on the Llama-family bundled model; see docs/models.md for sliding windows,",
            "memory and what is refused.",
            "",
            head,
            rule,
            *rows,
            "",
        ]
    )


def test_architecture_table_is_current():
    assert TABLE.is_file(), "run `python bench/arch_table.py` to write docs/architectures.md"
    assert TABLE.read_text(encoding="utf-8") == render_table(), (
        "docs/architectures.md is stale: run `python bench/arch_table.py`"
    )


def test_layers_that_cannot_roll_back_are_refused_by_name():
    from transformers import Qwen3NextConfig

    from specdec.cache import KVCache
    from specdec.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="'linear_attention' layer"):
        KVCache(Qwen3NextConfig(num_hidden_layers=4))
    chunked = LlamaConfig(num_hidden_layers=2)
    chunked.layer_types = ["chunked_attention", "full_attention"]
    chunked.attention_chunk_size = 4
    with pytest.raises(UnsupportedModelError, match="'chunked_attention' layer"):
        KVCache(chunked)


def test_sliding_cache_keeps_the_whole_context(loaded):
    """Sliding layers keep every entry (no eviction): memory grows with the context."""
    runner = ModelRunner(loaded("Gemma-3").model)
    runner.forward(list(range(5, 5 + 3 * WINDOW)))
    assert runner.cache.layout.window == WINDOW
    assert {layer.keys.shape[-2] for layer in runner.cache.hf.layers} == {3 * WINDOW}
