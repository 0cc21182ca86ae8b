"""Cross-tokenizer drafting (``draft:model=X`` with X's tokenizer other than the target's): the
draft continues the text in its own tokens and its text is re-tokenised for the target.

Greedy output equals plain greedy decoding (float64 targets) for pairs whose tokenizers differ
deliberately: different merges of the same text, SentencePiece-style byte fallback with a dummy
prefix, an added special token, a token the other vocabulary spells in two pieces, and a
permuted copy of the target (which drafts what the target says, so nearly every draft is
accepted). The mapping is checked piece by piece, the batch path and ``auto`` take the mode,
trees are refused, and sampled output follows exactly the target's distribution (chi-square,
with a power check against a rule that accepts every proposed token)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from specdec import GenerationConfig, SamplingConfig, SpeculativeEngine
from specdec.errors import ConfigError
from specdec.speculators.cross_vocab import CrossVocabSpeculator, encode_after
from specdec.target import HFTarget, LoadedModel, ModelRunner, load_model
from specdec.testing import word_tokenizer
from tests.conftest import build_tiny_model

PROMPTS = [
    "the cat sat on the mat",
    "First Citizen: we are accounted poor citizens, the patricians good.",
    "Voilà: café, naïve, 日本語 and ½ — the end",
]


# -- tokenizers and models that differ deliberately ------------------------------------------


def _save(tokenizer_json: dict, out: Path, eos: str = "<eos>") -> Path:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import TINY_CHAT_TEMPLATE

    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(tokenizer_json)),
        eos_token=eos,
        pad_token=eos,
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(out)
    return out


def _spec(tokenizer_dir: Path) -> dict:
    return json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))


def byte_fallback_tokenizer(out: Path) -> Path:
    """SentencePiece-style: spaces as ``▁`` starting a word's token, a dummy prefix on every
    text encoded, and bytes ``<0xNN>`` for every character outside a 60-character alphabet."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tests.conftest import corpus_lines

    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>", "<|user|>", "<|assistant|>", "<|system|>"],
        limit_alphabet=60,
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines()[:4000], trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    return _save(spec, out)


def permuted_tokenizer(
    src: Path, out: Path, *, seed: int, drop: str | None = None, special: str | None = None
) -> dict[int, int]:
    """``src``'s tokenizer with its ordinary token ids shuffled (old id -> new id returned);
    ``drop``: a token removed with the merge that made it (the text then takes two pieces);
    ``special``: an added special token the source does not have."""
    spec = _spec(src)
    vocab = spec["model"]["vocab"]
    specials = {a["content"] for a in spec["added_tokens"]}
    ordinary = sorted(i for t, i in vocab.items() if t not in specials)
    g = torch.Generator().manual_seed(seed)
    shuffled = [ordinary[j] for j in torch.randperm(len(ordinary), generator=g).tolist()]
    perm = dict(zip(ordinary, shuffled, strict=True))
    if drop is not None:
        merges = spec["model"]["merges"]
        spec["model"]["merges"] = [
            m for m in merges if (m if isinstance(m, str) else " ".join(m)).replace(" ", "") != drop
        ]
    spec["model"]["vocab"] = {t: perm.get(i, i) for t, i in vocab.items()}
    if special is not None:
        n = len(vocab)
        spec["model"]["vocab"][special] = n
        spec["added_tokens"].append(
            {"id": n, "content": special, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
        )  # fmt: skip
    _save(spec, out)
    if special is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(out)
        tok.add_special_tokens({"additional_special_tokens": [special]})
        tok.save_pretrained(out)
    return perm


def word_only_target(src: Path, out: Path) -> Path:
    """``src`` with every token but whole words (``" word"``, one token alone) silenced (zero
    embedding, tied to the LM head: logit 0), so its greedy text is tokenised canonically: the
    target's tokens are what re-tokenising its text gives."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(src)
    model = LlamaForCausalLM.from_pretrained(src)
    emb = model.model.embed_tokens.weight.data
    for token, i in tok.get_vocab().items():
        text = tok.convert_tokens_to_string([token])
        word = text.startswith(" ") and text[1:].isalpha() and len(text) > 2
        if not (word and tok.encode(text, add_special_tokens=False) == [i]):
            emb[i] = 0.0
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def permuted_copy(src: Path, out: Path, *, seed: int, **kwargs) -> Path:
    """The model ``src`` under a permuted tokenizer: the same model over the same text, every
    token id another (see :func:`permuted_tokenizer` for ``drop`` and ``special``)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    perm = permuted_tokenizer(src, out, seed=seed, **kwargs)
    model = LlamaForCausalLM.from_pretrained(src)
    size = len(AutoTokenizer.from_pretrained(out))
    old = model.model.embed_tokens.weight.data.clone()
    model.resize_token_embeddings(size)
    new = model.model.embed_tokens.weight.data
    for i, j in perm.items():
        new[j] = old[i]
    model.config.vocab_size = size
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_model_dir, tiny_tokenizer_dir) -> dict[str, Path]:
    mk = tmp_path_factory.mktemp
    bf_tok = byte_fallback_tokenizer(mk("bf_tok"))
    words = word_only_target(tiny_model_dir, mk("words"))
    return {
        "byte-fallback": build_tiny_model(mk("bf"), bf_tok, seed=3, layers=1),
        "byte-fallback-target": build_tiny_model(mk("bft"), bf_tok, seed=4),
        "words": words,
        "words-copy": permuted_copy(words, mk("words_copy"), seed=5),
        "split-and-special": permuted_copy(
            tiny_model_dir, mk("split"), seed=6, drop="Ġthe", special="<|tool|>"
        ),
    }


def _engine(target: LoadedModel, draft: Path, **kwargs) -> SpeculativeEngine:
    return SpeculativeEngine.from_pretrained(target, speculator=f"draft:model={draft}", **kwargs)


def _check_greedy(engine: SpeculativeEngine, prompts=PROMPTS, n: int = 40) -> tuple[int, int]:
    """Every output equal to plain greedy decoding's; (drafted, accepted) tokens summed."""
    drafted = accepted = 0
    for prompt in prompts:
        got = engine.generate(prompt, max_new_tokens=n, ignore_eos=True)
        plain = engine.generate(prompt, max_new_tokens=n, ignore_eos=True, speculate=False)
        assert got.token_ids == plain.token_ids, prompt
        drafted += sum(got.stats.drafted_at)
        accepted += sum(got.stats.accepted_at)
    return drafted, accepted


# -- greedy: identical output ------------------------------------------------------------------


def test_another_tokenizer_switches_to_drafting_through_text(tiny64, other_vocab_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="specdec.speculators.cross_vocab"):
        engine = _engine(tiny64, other_vocab_model_dir, num_draft_tokens=4, adaptive=False)
    assert isinstance(engine.speculator, CrossVocabSpeculator)
    assert "differs from the target's" in caplog.text and "through text" in caplog.text
    drafted, _ = _check_greedy(engine)
    assert drafted > 0


def test_a_permuted_copy_of_the_target_drafts_what_the_target_says(dirs):
    """The same model under shuffled token ids: through text it drafts the target's own greedy
    continuation, so nearly every drafted token is accepted."""
    target = load_model(dirs["words"], dtype="float64")
    engine = _engine(target, dirs["words-copy"], num_draft_tokens=4, adaptive=False)
    assert isinstance(engine.speculator, CrossVocabSpeculator)
    prompts = ["the cat sat on the mat", "we are accounted poor citizens"]
    drafted, accepted = _check_greedy(engine, prompts, n=48)
    assert drafted > 20 and accepted >= 0.9 * drafted, (drafted, accepted)
    # the draft's cache holds the committed text in the draft's own tokens
    spec = engine.speculator
    assert spec.runner.cache.tokens[: len(spec._mirror.d_ids) - 1] == spec._mirror.d_ids[:-1]
    draft_tok = spec.draft_tokenizer
    assert spec._mirror.d_ids == draft_tok.encode(spec._mirror.text, add_special_tokens=False)


@pytest.mark.parametrize(
    "target_key, draft_key",
    [
        ("tiny", "byte-fallback"),  # byte-level BPE target, SentencePiece-style draft
        ("byte-fallback-target", "other"),  # and the other way round
        ("tiny", "split-and-special"),  # " the" in two pieces, an added special token
    ],
)
def test_tokenizers_that_differ_deliberately_keep_greedy_output(
    dirs, tiny64, other_vocab_model_dir, target_key, draft_key
):
    if target_key == "tiny":
        target = tiny64
    else:
        target = load_model(dirs[target_key], dtype="float64")
    draft = other_vocab_model_dir if draft_key == "other" else dirs[draft_key]
    engine = _engine(target, draft, num_draft_tokens=4, adaptive=False)
    assert isinstance(engine.speculator, CrossVocabSpeculator)
    prompts = [*PROMPTS, "<|tool|> the theatre, then <|tool|>"]
    drafted, _ = _check_greedy(engine, prompts)
    assert drafted > 0


def test_the_adaptive_budget_and_a_min_confidence_stay_lossless(tiny64, dirs):
    engine = SpeculativeEngine.from_pretrained(
        tiny64, speculator=f"draft:model={dirs['split-and-special']},min_confidence=0.3"
    )
    assert engine.speculator.min_confidence == 0.3
    _check_greedy(engine, PROMPTS[:2])


# -- the mapping, piece by piece --------------------------------------------------------------


def test_encode_after_aligns_at_a_token_boundary(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.encode(" the cat", add_special_tokens=False)
    got = encode_after(tok, " the cat", ids[:1])
    assert got is not None and got[0] == ids[1:]
    # a tail the text after it would merge into a longer token does not come back
    pieces = tok.encode(" th", add_special_tokens=False) + tok.encode("e", add_special_tokens=False)
    assert tok.encode(" the", add_special_tokens=False) != pieces
    assert encode_after(tok, " the cat", pieces[:1]) is None


def _speculator(target: LoadedModel, draft_dir: Path) -> CrossVocabSpeculator:
    draft = load_model(draft_dir, dtype="float64")
    return CrossVocabSpeculator(ModelRunner(draft.model), draft.tokenizer, target.tokenizer)


CONTINUATIONS = [
    ("the cat sat on", " the mat and the dog"),
    ("First Citizen: we are", " accounted poor citizens, the"),
    ("Voilà: café", ", naïve, 日本語 and more"),
]


@pytest.mark.parametrize(
    "target_key, draft_key",
    [("tiny", "other"), ("tiny", "byte-fallback"), ("byte-fallback-target", "other"),
     ("tiny", "split-and-special")],
)  # fmt: skip
def test_a_draft_continuation_maps_to_the_target_tokens_of_its_text(
    dirs, tiny64, other_vocab_model_dir, target_key, draft_key
):
    """The draft's tokens of a continuation, as the draft would spell it, come back as the
    target's own tokens of the whole text after the committed ones, less a last token the text
    after it could still merge into a longer one (``" dog"`` into ``" dogs"``); kept when the
    draft ended its text there. The draft's view of the committed text is the draft's own
    tokenisation of it."""
    target = tiny64 if target_key == "tiny" else load_model(dirs[target_key], dtype="float64")
    spec = _speculator(target, other_vocab_model_dir if draft_key == "other" else dirs[draft_key])
    t_tok, d_tok = target.tokenizer, spec.draft_tokenizer
    for head, tail in CONTINUATIONS:
        spec.reset()
        committed = t_tok.encode(head, add_special_tokens=False)
        assert spec.sync(committed)
        assert spec._mirror.text == head
        d_ids = spec._mirror.d_ids
        assert d_ids == d_tok.encode(head, add_special_tokens=False)
        full_d = d_tok.encode(head + tail, add_special_tokens=False)
        assert full_d[: len(d_ids)] == d_ids  # the draft spells the head alike in context
        drafted = full_d[len(d_ids) :]
        full = t_tok.encode(head + tail, add_special_tokens=False)
        assert full[: len(committed)] == committed
        mapped = spec.map_draft(drafted, ended=False)
        assert mapped is not None and committed + mapped.tokens == full[:-1], (head, tail)
        ended = spec.map_draft(drafted, ended=True)
        assert ended is not None and committed + ended.tokens == full


def test_a_tail_the_draft_text_merges_into_does_not_align(tiny64, other_vocab_model_dir):
    """Committed ``" th"`` then drafted ``"e cat"``: the target would spell ``" the"`` whole,
    so the committed tokens are no prefix of the re-tokenisation and nothing is proposed."""
    spec = _speculator(tiny64, other_vocab_model_dir)
    t_tok, d_tok = tiny64.tokenizer, spec.draft_tokenizer
    committed = t_tok.encode("the cat sat on", add_special_tokens=False) + t_tok.encode(
        " th", add_special_tokens=False
    )
    assert spec.sync(committed)
    assert spec.map_draft(d_tok.encode("e cat", add_special_tokens=False), ended=False) is None


def test_target_tokens_of_an_unfinished_character_wait(tiny64, dirs):
    """Byte-level pieces of "日" arrive one step at a time: the draft reads the character once
    it is whole, and nothing is drafted meanwhile."""
    spec = _speculator(tiny64, dirs["byte-fallback"])
    t_tok = tiny64.tokenizer
    head = t_tok.encode("the end of", add_special_tokens=False)
    char = t_tok.encode(" 日", add_special_tokens=False)
    assert len(char) >= 2  # spelt in byte pieces by the tiny vocabulary
    assert spec.sync(head)
    assert not spec.sync(head + char[:-1])  # incomplete: waits
    assert spec._mirror.text in ("the end of", "the end of ")  # the space is whole text
    assert spec.sync(head + char)
    assert spec._mirror.text == "the end of 日"
    d_tok = spec.draft_tokenizer
    assert d_tok.decode(spec._mirror.d_ids) == "the end of 日"


# -- the batch, auto, trees -------------------------------------------------------------------


def test_generate_batch_with_a_draft_through_text(tiny64, other_vocab_model_dir):
    engine = _engine(tiny64, other_vocab_model_dir, num_draft_tokens=4)
    batch = engine.generate_batch(PROMPTS, max_batch=3, max_new_tokens=24, ignore_eos=True)
    for prompt, got in zip(PROMPTS, batch, strict=True):
        plain = engine.generate(prompt, max_new_tokens=24, ignore_eos=True, speculate=False)
        assert got.token_ids == plain.token_ids


def test_auto_takes_a_draft_through_text_as_an_arm(tiny64, other_vocab_model_dir):
    engine = SpeculativeEngine.from_pretrained(
        tiny64, speculator=f"auto:arms=[prompt-lookup,draft:model={other_vocab_model_dir}]"
    )
    assert engine.arms is not None
    assert any(isinstance(s, CrossVocabSpeculator) for s in engine.arms.speculators)
    _check_greedy(engine, PROMPTS[:2], n=24)


def test_trees_are_refused_for_a_draft_through_text(tiny64, other_vocab_model_dir):
    with pytest.raises(ConfigError, match="chains only"):
        SpeculativeEngine.from_pretrained(
            tiny64, speculator=f"draft:model={other_vocab_model_dir},tree=2x2"
        )


# -- sampling: the target's distribution ------------------------------------------------------


def char_tokenizer():
    """The text of :func:`word_tokenizer` (``t0 t3 t5``) spelt another way: characters, ``▁``
    for a space, ``t1``/``t3`` merged whole and ``▁t1``/``▁t3`` too, every other ``▁tN`` in two
    pieces (``▁t`` + ``N``); ``<eos>`` at another id."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    chars = ["▁", "t", *[str(i) for i in range(7)]]
    merges = [("▁", "t"), ("▁t", "1"), ("▁t", "3"), *[("t", str(i)) for i in range(7)]]
    vocab: dict[str, int] = {}
    for t in [*chars, *["".join(m) for m in merges], "<eos>"]:
        vocab.setdefault(t, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse()])
    tok.add_special_tokens(["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def tiny_lm(tokenizer, seed: int, layers: int):
    """A random-weight Llama over ``tokenizer`` (test_draft_trees' sampling models' shape)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, initializer_range=0.6, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def _sampling_engine(rule=None):
    from tests.test_draft_trees import V

    target_tok, draft_tok = word_tokenizer(V), char_tokenizer()
    target = LoadedModel(tiny_lm(target_tok, 0, 2), target_tok, "tiny target", "fp32", "float32")
    spec = CrossVocabSpeculator(ModelRunner(tiny_lm(draft_tok, 11, 1)), draft_tok, target_tok)
    engine = SpeculativeEngine(
        HFTarget(target),
        target_tok,
        spec,
        loaded=target,
        num_draft_tokens=3,
        adaptive=False,
        acceptance_rule=rule,
    )
    return engine, target, spec


@pytest.mark.slow(threads=1)
def test_sampled_output_through_text_follows_the_target_and_the_test_has_power():
    from tests.test_draft_trees import ALPHA, SAMPLING, exact_joint, sample_joint, tree_pvalue
    from tests.test_losslessness import AlwaysAcceptRule

    engine, target, spec = _sampling_engine()
    prompt = [1, 4]
    joint = exact_joint(target.model, prompt)
    counts = sample_joint(engine, prompt)
    pvalue = tree_pvalue(counts, joint)
    assert pvalue > ALPHA, f"drafting through text departs from p (chi-square p = {pvalue:.2e})"
    assert spec.mapped_steps > 1000  # proposals were made, and some accepted:
    accepted = 0
    for seed in range(5):
        config = GenerationConfig(
            max_new_tokens=40, ignore_eos=True, sampling=SamplingConfig(**SAMPLING, seed=seed)
        )
        *_, last = engine.stream_ids(prompt, config)
        accepted += sum(last.stats.accepted_at)
    assert accepted > 0
    wrong, _, _ = _sampling_engine(AlwaysAcceptRule())
    bad = tree_pvalue(sample_joint(wrong, prompt), joint)
    assert bad < ALPHA, f"a rule accepting every proposed token went undetected ({bad:.2e})"


@pytest.mark.slow
def test_hf_universal_assisted_generation_baseline(tiny_model_dir):
    """``hf-assisted:draft=X`` with X's tokenizer other than the target's runs Hugging Face's
    universal assisted generation (both tokenizers passed to ``generate``), the baseline the
    cross-tokenizer draft is measured against; its greedy output is the target's, with the
    bundled model as the assistant."""
    from specdec.bench.methods import build_runners, parse_methods
    from specdec.target.loading import default_gguf_path

    target = load_model(tiny_model_dir, dtype="float64")
    specs = parse_methods(f"none,hf-assisted:draft={default_gguf_path()}")
    plain, uag = build_runners(target, specs, 4)
    assert "assistant_tokenizer" in uag.kwargs  # type: ignore[attr-defined]
    prompt = target.tokenizer("ROMEO: But soft, what light through yonder")["input_ids"]
    assert uag.run(prompt, 16).token_ids == plain.run(prompt, 16).token_ids


def test_hf_universal_assisted_generation_runs_past_a_pass_of_no_new_tokens(tiny64, dirs):
    """transformers' UAG hands its assistant a pass of no new tokens when the target's tokens
    bring none (an assistant that agrees with the target, as a permuted copy does, meets it
    within a few steps); the baseline re-reads one token there and runs to the end, its greedy
    output the target's."""
    from specdec.bench.methods import build_runners, parse_methods

    specs = parse_methods(f"none,hf-assisted:draft={dirs['split-and-special']}")
    plain, uag = build_runners(tiny64, specs, 4)
    assert "assistant_tokenizer" in uag.kwargs  # type: ignore[attr-defined]
    for prompt in PROMPTS:
        ids = tiny64.tokenizer(prompt)["input_ids"]
        assert uag.run(ids, 40).token_ids == plain.run(ids, 40).token_ids, prompt
