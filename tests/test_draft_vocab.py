"""A draft that scores only the most frequent tokens (``draft:...,vocab=N``): it never drafts a
token outside them, greedy output stays the target's own (float64, exact), sampled output
follows the target's distribution (chi-square through a draft-model tree whose draft leaves
tokens out), and the ranking it needs comes from ``specdec calibrate vocab`` or a clear error."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from specdec import SpeculativeEngine
from specdec.cli.main import app
from specdec.errors import ConfigError
from specdec.speculators import DraftModelSpeculator
from specdec.speculators.draft_model import TreeShape
from specdec.speculators.draft_vocab import (
    ROW_MULTIPLE,
    SubsetHead,
    count_tokens,
    draft_vocabulary,
    load_ranking,
    ranking_from_counts,
    save_ranking,
    with_subset_head,
)
from specdec.speculators.spec import parse_spec
from specdec.target import load_model
from tests.test_draft_trees import (
    ALPHA,
    exact_joint,
    sample_joint,
    sampling_pair,  # noqa: F401 - a fixture
    tree_engine,
    tree_pvalue,
)

PROMPTS = ["the cat sat on the mat", "one two three four five six", "a b c a b c a b"]
TEXT = " ".join(PROMPTS) + " the king and the queen of the land went to the sea " * 3


def test_ranking_counts_and_vocabulary(tiny_model_dir):
    tok = load_model(str(tiny_model_dir)).tokenizer
    counts = count_tokens(tok, [TEXT, "the the the"], len(tok))
    ranking = ranking_from_counts(counts)
    assert len(ranking) == len(tok)  # every id ranked (fewer than RANKING_TOKENS)
    assert int(ranking[0]) == int(np.argmax(counts))  # "the" (or its BPE piece) first
    assert list(counts[ranking[:5]]) == sorted(counts[ranking[:5]], reverse=True)
    with pytest.raises(ConfigError, match="calibrate vocab"):
        draft_vocabulary(tok, 10, len(tok))
    save_ranking(tok, ranking)
    assert np.array_equal(load_ranking(tok), ranking.astype(np.int64))
    ids = draft_vocabulary(tok, 10, len(tok), keep=[tok.eos_token_id])
    assert len(ids) == ROW_MULTIPLE and tok.eos_token_id in ids.tolist()
    assert set(ranking[:10].tolist()) <= set(ids.tolist())  # the 10 most frequent, then padding
    assert ids.tolist() == sorted(ids.tolist())


def test_a_subset_head_scores_only_its_tokens_and_leaves_the_model_alone(tiny_model_dir):
    draft = load_model(str(tiny_model_dir))
    ids = torch.tensor([3, 7, 11, 40, 41, 200])
    view = with_subset_head(draft.model, ids, "float32")
    assert view.get_output_embeddings() is not draft.model.get_output_embeddings()
    assert view.model is draft.model.model  # every other weight shared
    assert not isinstance(draft.model.get_output_embeddings(), SubsetHead)
    x = torch.tensor([[5, 9, 14, 2]])
    with torch.inference_mode():
        full = draft.model(input_ids=x).logits
        part = view(input_ids=x).logits
    assert part.shape == full.shape
    keep = torch.zeros(full.shape[-1], dtype=torch.bool)
    keep[ids] = True
    assert torch.isinf(part[..., ~keep]).all() and (part[..., ~keep] < 0).all()
    torch.testing.assert_close(part[..., ids], full[..., ids], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tree", ["chain", "2x2"])
def test_a_reduced_vocabulary_draft_is_lossless_and_drafts_only_kept_tokens(
    tiny64, tiny_draft_dir, tree
):
    """float64 target and draft (the draft follows a float64 target), so plain and speculative
    decoding are compared for exact equality."""
    tok = tiny64.tokenizer
    save_ranking(tok, ranking_from_counts(count_tokens(tok, [TEXT], len(tok))))
    engine = SpeculativeEngine.from_pretrained(
        tiny64, speculator=f"draft:model={tiny_draft_dir},vocab=40,tree={tree}"
    )
    spec = engine.speculator
    head = spec.runner.model.get_output_embeddings()
    assert isinstance(head, SubsetHead) and len(head.ids) == ROW_MULTIPLE
    kept = set(head.ids.tolist())  # and the request's own tokens (see the next test)
    drafted: set[int] = set()
    original = spec.propose

    def propose(context, budget):
        t = original(context, budget)
        drafted.update(t.tokens[1:])
        kept.update(context.tokens)
        return t

    spec.propose = propose
    for prompt in PROMPTS:
        got = engine.generate(prompt, max_new_tokens=32)
        plain = engine.generate(prompt, max_new_tokens=32, speculate=False)
        assert got.token_ids == plain.token_ids, prompt
    assert drafted and drafted <= kept
    # a draft with its full head drafts tokens this one never may (the test could fail)
    full = SpeculativeEngine.from_pretrained(
        tiny64, speculator=f"draft:model={tiny_draft_dir},tree={tree}"
    )
    everything: set[int] = set()
    full_propose = full.speculator.propose

    def propose_full(context, budget):
        t = full_propose(context, budget)
        everything.update(t.tokens[1:])
        return t

    full.speculator.propose = propose_full
    for prompt in PROMPTS:
        full.generate(prompt, max_new_tokens=32)
    assert everything - kept


@pytest.mark.slow(threads=1)
def test_sampled_output_through_a_reduced_vocabulary_draft_follows_the_target(sampling_pair):  # noqa: F811
    """The draft scores 3 of the 7 tokens (q = 0 elsewhere); siblings drawn without
    replacement from that q, verified by the multi-draft rule: the joint distribution of 3
    sampled tokens must still be the target's exactly."""
    target, draft = sampling_pair
    ids = torch.tensor([0, 2, 5])
    view = with_subset_head(draft, ids, "float32")
    view.get_output_embeddings().rows = None  # no context extras: 7 tokens would all be in it
    engine, trees = tree_engine((target, view))
    prompt = [1, 4]
    joint = exact_joint(target.model, prompt)
    counts = sample_joint(engine, prompt)
    pvalue = tree_pvalue(counts, joint)
    assert pvalue > ALPHA, f"a reduced-vocabulary draft departs from p (p = {pvalue:.2e})"
    drafted = {tok for t in trees for tok in t.tokens[1:]}
    assert drafted <= set(ids.tolist()) and len(drafted) > 1
    assert isinstance(engine.speculator, DraftModelSpeculator)
    assert engine.speculator.tree == TreeShape(3, 2)


def test_bad_vocab_options_fail_before_loading():
    with pytest.raises(ConfigError, match="vocab must be >= 0"):
        parse_spec("draft:model=/nowhere,vocab=-1")
    with pytest.raises(ConfigError, match="layers:N draft shares"):
        parse_spec("draft:model=layers:2,vocab=64")
    assert parse_spec("draft:model=/nowhere,dtype=kquant,vocab=64").vocab == 64  # its rows' blocks
    assert parse_spec("draft:model=/nowhere,dtype=kquant,vocab=0").vocab == 0
    assert parse_spec("draft:model=/nowhere").vocab is None  # the default: see below
    assert parse_spec("draft:model=/nowhere,vocab=0").vocab == 0


def test_a_vocab_draft_without_a_ranking_says_how_to_make_one(tiny_model_dir, tiny_draft_dir):
    target = load_model(str(tiny_model_dir))
    with pytest.raises(ConfigError, match="specdec calibrate vocab"):
        SpeculativeEngine.from_pretrained(
            target, speculator=f"draft:model={tiny_draft_dir},vocab=32"
        )


def test_calibrate_vocab_cli_saves_a_ranking_and_refuses_eval_sets(tiny_model_dir, tmp_path):
    text = tmp_path / "answers.jsonl"
    text.write_text('{"answer": "the cat sat on the mat"}\n{"answer": ["the", "the end"]}\n')
    result = CliRunner().invoke(
        app, ["calibrate", "vocab", "--model", str(tiny_model_dir), str(text)]
    )
    assert result.exit_code == 0, result.output
    assert "saved the token ranking" in result.output
    tok = load_model(str(tiny_model_dir)).tokenizer
    ranking = load_ranking(tok)
    assert ranking is not None
    counts = Counter(
        i
        for t in ("the cat sat on the mat", "the", "the end")
        for i in tok(t, add_special_tokens=False)["input_ids"]
    )
    top = max(counts.values())
    assert counts[int(ranking[0])] == top and counts[int(ranking[-1])] == 0
    evaluation = tmp_path / "eval" / "question.jsonl"
    evaluation.parent.mkdir()
    evaluation.write_text('{"turns": ["the question"]}\n')
    bad = CliRunner().invoke(
        app, ["calibrate", "vocab", "--model", str(tiny_model_dir), str(evaluation)]
    )
    assert bad.exit_code == 2 and "evaluation set" in bad.output
    empty = CliRunner().invoke(app, ["calibrate", "vocab", "--model", str(tiny_model_dir)])
    assert empty.exit_code == 2 and "--sharegpt" in empty.output


def test_context_tokens_outside_the_subset_are_scored_with_the_tied_rows(tiny_model_dir):
    """A prompt's rare tokens (names a summary copies) are draftable: the head scores the
    request's context tokens besides its subset, from the tied embedding rows."""
    draft = load_model(str(tiny_model_dir), dtype="float64")
    ids = torch.arange(0, 64)
    view = with_subset_head(draft.model, ids, "float64")
    head = view.get_output_embeddings()
    assert head.rows is not None  # the tiny models tie their embeddings
    x = torch.tensor([[5, 9, 300, 301]])
    head.include([5, 300, 301, 301])
    with torch.inference_mode():
        full = draft.model(input_ids=x).logits
        part = view(input_ids=x).logits
    scored = [*range(64), 300, 301]
    torch.testing.assert_close(part[..., scored], full[..., scored])
    assert torch.isinf(part[..., 302]).all()


def test_the_default_reduces_only_a_large_vocabulary_with_a_ranking(
    tiny64, tiny_draft_dir, monkeypatch
):
    """32768 of Qwen's 151,936 tokens by default; here the threshold scales to the tiny
    tokenizer (384 tokens): no ranking or too small a vocabulary keeps the full head, and
    vocab=0 always does."""
    from specdec.speculators import draft_model

    def head(spec: str):
        engine = SpeculativeEngine.from_pretrained(tiny64, speculator=spec)
        return engine.speculator.runner.model.get_output_embeddings()

    spec = f"draft:model={tiny_draft_dir}"
    monkeypatch.setattr(draft_model, "DEFAULT_DRAFT_VOCAB", 128)
    assert not isinstance(head(spec), SubsetHead)  # no ranking yet
    tok = tiny64.tokenizer
    save_ranking(tok, ranking_from_counts(count_tokens(tok, [TEXT], len(tok))))
    reduced = head(spec)
    assert isinstance(reduced, SubsetHead) and len(reduced.ids) == 128
    assert not isinstance(head(f"{spec},vocab=0"), SubsetHead)
    monkeypatch.setattr(draft_model, "DEFAULT_DRAFT_VOCAB", 192)  # 384 is not over twice that
    assert not isinstance(head(spec), SubsetHead)
