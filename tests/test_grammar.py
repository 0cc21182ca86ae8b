"""Constrained generation: the grammar value, the tree walk, losslessness and logprobs.

Losslessness is with respect to the constrained target: p masked by the grammar at every
position and renormalised (greedy: the masked argmax). Greedy constrained speculation must
equal constrained plain decoding token for token (tiny float64 models, several speculators);
sampled constrained output must follow the masked distribution (a chi-square test over a tiny
Markov target with the grammar ``(a|b)+c``, with power checks against two wrong constraints).
"""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter

import pytest
import torch

pytest.importorskip("llguidance")

from specdec import GenerationConfig, SamplingConfig, SpeculativeEngine  # noqa: E402
from specdec.errors import InvalidRequestError  # noqa: E402
from specdec.grammar import Grammar, GrammarCompiler, GrammarConstraint  # noqa: E402
from specdec.grammar.constraint import ConstrainedTree, bitmask_to_bool  # noqa: E402
from specdec.logprobs import token_logprobs  # noqa: E402
from specdec.testing import MarkovSpeculator, MarkovTarget  # noqa: E402
from specdec.tree import DraftTree  # noqa: E402
from specdec.verify import probs_from_logits  # noqa: E402
from tests.test_losslessness import SAMPLES, chi_square_pvalue  # noqa: E402

A, B, C, EOS = 0, 1, 2, 3


def abc_tokenizer():
    """Tokens ``a``, ``b``, ``c`` and ``<eos>``: one character each, so a regex over them is a
    regex over tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"a": A, "b": B, "c": C, "<eos>": EOS}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def abc_compiler() -> GrammarCompiler:
    return GrammarCompiler(abc_tokenizer(), [EOS])


def allowed_rows(ct: ConstrainedTree) -> list[list[int]]:
    flags = bitmask_to_bool(ct.bitmask, 4)
    return [[t for t in range(4) if flags[i, t]] for i in range(len(ct.tree))]


# -- the value and the walk -----------------------------------------------------------------------
def test_grammar_value_validates():
    assert Grammar.json_schema('{"type": "object"}') == Grammar.json_schema({"type": "object"})
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        Grammar.json_schema("{nope")
    with pytest.raises(InvalidRequestError, match="kind"):
        Grammar("yaml", "x")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="empty"):
        Grammar.regex("  ")


def test_invalid_grammar_is_refused_before_decoding(abc_compiler):
    with pytest.raises(InvalidRequestError) as info:
        abc_compiler.constraint(Grammar.regex("(a|"))
    assert info.value.param == "grammar"
    with pytest.raises(InvalidRequestError):
        abc_compiler.constraint(Grammar.ebnf("start: nosuchrule"))


def test_tree_walk_prunes_and_masks_each_node_on_its_own_path(abc_compiler):
    c = abc_compiler.constraint(Grammar.regex("(a|b)+c"))
    # root -> c (forbidden first), root -> a -> b -> c, and root -> a -> c (a sibling branch)
    tree = DraftTree((A, C, A, B, C, C), (-1, 0, 0, 2, 3, 2))
    ct = c.prepare(tree, extend=False)
    assert ct.tree.tokens == (A, A, B, C, C)
    assert ct.origin == (0, 2, 3, 4, 5)
    assert ct.tree.parents == (-1, 0, 1, 2, 1)
    # start: a|b; after a / ab: a|b|c; after abc and ac: only EOS (the sibling did not see "b")
    assert allowed_rows(ct) == [[A, B], [A, B, C], [A, B, C], [EOS], [EOS]]
    logits = torch.zeros(5, 4)
    masked = ct.mask(logits)
    assert torch.isinf(masked[0, C]) and masked[0, A] == 0
    # the walk leaves the matcher where it was: the root's state is unchanged
    assert allowed_rows(c.prepare(DraftTree.root_only(A), extend=False)) == [[A, B]]


def test_forced_tokens_extend_the_draft(abc_compiler):
    c = abc_compiler.constraint(Grammar.regex("abab(a|c)"))
    ct = c.prepare(DraftTree.root_only(C))
    assert ct.tree.tokens == (C, A, B, A, B)  # forced; the last choice is the target's
    assert ct.origin == (0, -1, -1, -1, -1)
    assert c.prepare(DraftTree.root_only(C), extend=False).tree.tokens == (C,)


def test_sampled_draft_q_is_restricted_to_the_grammar(abc_compiler):
    c = abc_compiler.constraint(Grammar.regex("(a|b)+c"))
    q = torch.tensor([[0.0] * 4, [0.4, 0.1, 0.3, 0.2]], dtype=torch.float64)
    tree = DraftTree((C, A), (-1, 0), q)
    ct = c.prepare(tree, extend=False)
    assert ct.tree is not tree
    assert ct.tree.draft_probs is not None
    assert ct.tree.draft_probs[1].tolist() == pytest.approx([0.8, 0.2, 0.0, 0.0])


def test_ignore_eos_with_a_grammar_is_refused():
    engine = SpeculativeEngine(MarkovTarget(torch.zeros(4, 4)), abc_tokenizer())
    with pytest.raises(InvalidRequestError) as info:
        engine.stream_ids([A], GenerationConfig(ignore_eos=True), grammar=Grammar.regex("a+"))
    assert info.value.param == "ignore_eos"


# -- greedy: constrained speculation == constrained plain decoding --------------------------------
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
GRAMMARS = [
    Grammar.regex(r"(the |of |and |to )+(end|stop)\."),
    Grammar.json_schema(SCHEMA),
    Grammar.ebnf('start: "ROMEO" ": " word (" " word)* "."\nword: /[a-z]{1,8}/'),
]
PROMPTS = [
    "ROMEO: But soft, what light the the of the to and of the",
    'Give JSON: {"name": "Tybalt", "age": 3} and again {"name": "Tybalt", "age":',
]


@pytest.mark.parametrize(
    "spec", ["prompt-lookup", "draft:model=layers:2", "lookahead", "suffix", "auto"]
)
def test_greedy_constrained_speculation_equals_constrained_plain(tiny64, spec):
    engine = SpeculativeEngine.from_pretrained(tiny64, speculator=spec, num_draft_tokens=4)
    forwards_spec = forwards_plain = 0
    for grammar, prompt in itertools.product(GRAMMARS, PROMPTS):
        plain = engine.generate(prompt, max_new_tokens=30, grammar=grammar, speculate=False)
        fast = engine.generate(prompt, max_new_tokens=30, grammar=grammar)
        assert fast.token_ids == plain.token_ids, (spec, grammar, prompt)
        assert fast.text == plain.text
        forwards_spec += fast.stats.target_forwards
        forwards_plain += plain.stats.target_forwards
        if plain.finish_reason == "stop" and grammar.kind == "json_schema":
            value = json.loads(plain.text)
            assert set(value) == {"name", "age"} and isinstance(value["age"], int)
        if plain.finish_reason == "stop" and grammar.kind == "regex":
            assert re.fullmatch(grammar.source, plain.text)
    assert forwards_spec < forwards_plain  # forced tokens and drafts did save passes


# -- sampled: the output follows the masked distribution ------------------------------------------
V4, N_NEW, ALPHA = 4, 4, 1e-3  # SAMPLES (6,000) and the chi-square: test_losslessness
SAMPLING = SamplingConfig(temperature=0.8, top_p=0.9)
ALLOWED = {0: (A, B), 1: (A, B, C), 2: (EOS,)}  # the DFA of (a|b)+c: start, looping, done


def markov_tables() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    target = torch.randn(V4, V4, generator=g, dtype=torch.float64)
    draft = torch.randn(V4, V4, generator=g, dtype=torch.float64) * 1.5
    target[:, C] += 2.0  # so that outputs end (c, then EOS) often, inside the nucleus
    return target, draft


def masked_p(table: torch.Tensor, prev: int, state: int) -> torch.Tensor:
    row = torch.full((V4,), float("-inf"), dtype=torch.float64)
    allowed = list(ALLOWED[state])
    row[allowed] = table[prev, allowed]
    return probs_from_logits(row[None], SAMPLING)[0]


def exact_outputs(table: torch.Tensor, start: int) -> dict[tuple[int, ...], float]:
    """Every output (EOS ends it, unemitted; or N_NEW tokens) with its exact probability."""
    out: dict[tuple[int, ...], float] = {}

    def walk(seq: tuple[int, ...], prev: int, state: int, prob: float) -> None:
        if len(seq) == N_NEW:
            out[seq] = out.get(seq, 0.0) + prob
            return
        p = masked_p(table, prev, state)
        for t in range(V4):
            if float(p[t]) == 0.0:
                continue
            if t == EOS:
                out[seq] = out.get(seq, 0.0) + prob * float(p[t])
                continue
            walk((*seq, t), t, 2 if t == C else 1, prob * float(p[t]))

    walk((), start, 0, 1.0)
    return out


class UnrestrictedQ(GrammarConstraint):
    """Wrong on purpose: prunes sampled drafts but keeps their original q (not q')."""

    def prepare(self, tree, *, extend=True):
        ct = super().prepare(tree, extend=extend)
        if tree.draft_probs is not None and ct.tree is not tree:
            rows = [
                tree.draft_probs[o] if o >= 0 else ct.tree.draft_probs[i]
                for i, o in enumerate(ct.origin)
            ]
            ct.tree = DraftTree(ct.tree.tokens, ct.tree.parents, torch.stack(rows))
        return ct


class RootMaskOnly(GrammarConstraint):
    """Wrong on purpose: masks only the root's logits, as if every node shared its state."""

    def prepare(self, tree, *, extend=True):
        ct = super().prepare(tree, extend=extend)
        ct.bitmask = ct.bitmask[:1].expand_as(ct.bitmask).clone()
        return ct


def sampled_pvalue(constraint_class: type[GrammarConstraint]) -> tuple[float, int]:
    target, draft = markov_tables()
    engine = SpeculativeEngine(
        MarkovTarget(target),
        abc_tokenizer(),
        MarkovSpeculator(draft),
        num_draft_tokens=3,
        adaptive=False,
    )
    compiler = GrammarCompiler(abc_tokenizer(), [EOS])
    grammar = Grammar.regex("(a|b)+c")
    counts: Counter = Counter()
    accepted = 0
    original = engine._constraint
    for seed in range(SAMPLES):
        config = GenerationConfig(
            max_new_tokens=N_NEW, sampling=SamplingConfig(temperature=0.8, top_p=0.9, seed=seed)
        )
        good = compiler.constraint(grammar)
        wrapped = constraint_class(good.matcher, good.eos_token_ids)
        engine._constraint = lambda g, c, w=wrapped: w  # type: ignore[method-assign]
        ids: list[int] = []
        try:
            for event in engine.stream_ids([A], config, grammar=grammar):
                ids.extend(event.token_ids)
        except RuntimeError:  # the constraint's own guard: a token outside the grammar
            return 0.0, accepted
        accepted += event.stats.accepted_tokens
        counts[tuple(ids)] += 1
    engine._constraint = original  # type: ignore[method-assign]
    return chi_square_pvalue(counts, exact_outputs(target, A)), accepted


@pytest.mark.slow(threads=1)
def test_sampled_constrained_output_follows_the_masked_distribution():
    pvalue, accepted = sampled_pvalue(GrammarConstraint)
    assert pvalue > ALPHA, f"constrained sampling departs from masked p (p = {pvalue:.2e})"
    assert accepted > SAMPLES // 2  # drafts were accepted, not only rejected or pruned


@pytest.mark.slow(threads=1)
@pytest.mark.parametrize("wrong", [UnrestrictedQ, RootMaskOnly])
def test_the_test_has_power_against_wrong_constraints(wrong):
    pvalue, _ = sampled_pvalue(wrong)
    assert pvalue < ALPHA, f"{wrong.__name__} went undetected (p = {pvalue:.2e})"


# -- logprobs from the verification pass ----------------------------------------------------------
def reference_logprobs(loaded, prompt_ids, output, sampling, grammar, compiler):
    """Teacher-forced: one forward over prompt + output, each row masked by a fresh matcher."""
    ids = torch.tensor([prompt_ids + output])
    with torch.inference_mode():
        logits = loaded.model(ids).logits[0, len(prompt_ids) - 1 : -1]  # [M, V]
    if grammar is not None:
        c = compiler.constraint(grammar)
        rows = []
        for i, t in enumerate(output):
            ct = c.prepare(DraftTree.root_only(0), extend=False)
            rows.append(ct.mask(logits[i : i + 1])[0])
            c.advance([t])
        logits = torch.stack(rows)
    return [lp.logprob for lp in token_logprobs(logits, output, sampling, 0)]


@pytest.mark.parametrize("grammar", [None, GRAMMARS[0], GRAMMARS[1]])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_equal_plain_decoding(tiny64, grammar, temperature):
    engine = SpeculativeEngine.from_pretrained(
        tiny64, speculator="prompt-lookup", num_draft_tokens=4
    )
    prompt = PROMPTS[0] if grammar is None or grammar.kind == "regex" else PROMPTS[1]
    kwargs = dict(
        max_new_tokens=20,
        grammar=grammar,
        logprobs=True,
        top_logprobs=3,
        temperature=temperature,
        top_p=0.9,
        seed=7,
    )
    fast = engine.generate(prompt, **kwargs)
    plain = engine.generate(prompt, speculate=False, **kwargs)
    assert fast.logprobs is not None and len(fast.logprobs) == len(fast.token_ids)
    assert all(lp.token_id == t for lp, t in zip(fast.logprobs, fast.token_ids, strict=True))
    assert all(len(lp.top) == 3 for lp in fast.logprobs)
    sampling = SamplingConfig(temperature=temperature, top_p=0.9)
    ids = engine.encode(prompt)
    for result in (fast, plain):
        want = reference_logprobs(
            tiny64, ids, result.token_ids, sampling, grammar, engine._grammar_compiler
        )
        got = [lp.logprob for lp in result.logprobs]
        assert got == pytest.approx(want, abs=1e-6)
    if temperature == 0.0:
        assert fast.token_ids == plain.token_ids
        for a, b in zip(fast.logprobs, plain.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-6)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.top[0][0] == a.token_id  # greedy: the chosen token is the most likely


# -- the CLI --------------------------------------------------------------------------------------
def test_cli_generate_with_json_schema_and_regex(tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    from specdec.cli.main import app

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA), encoding="utf-8")
    base = ["generate", "Give JSON:", "--model", str(tiny_model_dir), "--json", "-n", "40"]
    result = CliRunner().invoke(app, [*base, "--json-schema", str(schema)])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["text"].startswith('{"name": "')
    result = CliRunner().invoke(app, [*base, "--regex", "(yes|no)"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["text"] in ("yes", "no")
    both = CliRunner().invoke(app, [*base, "--regex", "a", "--json-schema", str(schema)])
    assert both.exit_code == 2 and "not several" in both.output
