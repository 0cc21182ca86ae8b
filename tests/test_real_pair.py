"""The real Qwen2.5-Coder 1.5B/0.5B pair, only where its chunk wheels are installed
(`scripts/install.sh --qwen-pair`; CI does not install them, so this module skips there).

The default draft (the GGUF run by llama.cpp; without llama-cpp-python int4 with an LM head
over the 32,768 most frequent tokens plus the context's) and the int4 draft must
leave greedy output identical to plain decoding: both are the fp32 target's own argmax, the
speculative one from verification passes of several tokens, which can differ from single-token
passes in the last bits; over 28 prompts x 128 tokens x 4 draft variants no token differed
(experiments/draft-model/2026-12-03-draft-vocab.md), so equality is asserted outright here.
"""

from __future__ import annotations

import pytest

from specdec import SpeculativeEngine
from specdec.errors import ModelNotFoundError
from specdec.speculators.draft_vocab import SubsetHead
from specdec.target import llamacpp, load_model

pytestmark = pytest.mark.slow

PROMPT = "Write a Python function merge_intervals(intervals) that merges overlapping intervals."


@pytest.fixture(scope="module")
def qwen():
    try:
        return load_model("qwen2.5-coder-1.5b")
    except ModelNotFoundError as e:  # the pair's parts are not installed
        pytest.skip(str(e))


@pytest.mark.parametrize("draft", ["default", "int4"])
def test_the_default_draft_on_the_real_pair_is_lossless_and_accepted(qwen, draft):
    """``default``: the GGUF run by llama.cpp where llama-cpp-python is installed;
    ``int4``: torch's int4 kernels with the reduced LM head."""
    spec_name = "draft:qwen2.5-coder-0.5b" + ("" if draft == "default" else ",dtype=int4")
    engine = SpeculativeEngine.from_pretrained(qwen, speculator=spec_name)
    runner = engine.speculator.runner
    if draft == "default" and llamacpp.available():
        assert isinstance(runner, llamacpp.LlamaCppRunner)
    else:
        head = runner.model.get_output_embeddings()
        assert isinstance(head, SubsetHead) and 32_768 <= len(head.ids) < 32_768 + 64 + 64
    spec = engine.generate(PROMPT, max_new_tokens=32)
    plain = engine.generate(PROMPT, max_new_tokens=32, speculate=False)
    assert spec.token_ids == plain.token_ids
    # the 0.5B sibling's first drafted token is accepted most of the time on code (how many
    # steps draft at all is the cost policy's choice, which reads measured timings)
    drafted, accepted = spec.stats.drafted_at, spec.stats.accepted_at
    assert drafted and drafted[0] > 0 and accepted[0] / drafted[0] > 0.5


def test_a_draft_with_another_vocabulary_drafts_through_text_on_the_real_pair(qwen, smol_dir):
    """SmolLM2-135M (49k-token vocabulary) drafting for the Qwen 1.5B (151k): greedy output
    identical to plain decoding."""
    from specdec.speculators.cross_vocab import CrossVocabSpeculator

    engine = SpeculativeEngine.from_pretrained(qwen, speculator=f"draft:model={smol_dir}")
    assert isinstance(engine.speculator, CrossVocabSpeculator)
    prompt = "Write a Python function that returns the sum of a list of numbers."
    plain = engine.generate(prompt, max_new_tokens=24, speculate=False)
    got = engine.generate(prompt, max_new_tokens=24)
    assert got.token_ids == plain.token_ids
