"""Greedy equivalence on tiny random-weight models built from a config.

Reference: plain greedy decoding by the same engine with no speculation (one token per
forward), and independently Hugging Face ``model.generate`` greedy. Both run in float64, where a
k-token verification pass and k single-token passes agree to ~1e-15, so no argmax near-tie can
flip; the comparison is therefore exact equality of token ids.
"""

from __future__ import annotations

import pytest
import torch

from specdec import SpeculativeEngine

PROMPTS = [
    "ROMEO: But soft, what light",
    "First Citizen:\nBefore we proceed any further, hear me speak. Speak, speak. Before we",
    "the the the the the the the",
    "KING RICHARD III: Now is the winter of our discontent made glorious summer by",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind",
]


def hf_greedy(loaded, prompt_ids: list[int], n: int) -> list[int]:
    model = loaded.model
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize(
    "method,draft,k,adaptive",
    [
        ("prompt-lookup", None, 1, False),
        ("prompt-lookup", None, 4, False),
        ("prompt-lookup", None, 6, True),
        ("draft", "layers:1", 3, False),
        ("draft", "layers:3", 1, False),
        ("draft", "layers:3", 5, False),
        ("draft", "layers:3", 6, True),
        ("draft", "DIR", 4, False),
    ],
)
def test_greedy_equals_plain(tiny64, tiny_draft_dir, method, draft, k, adaptive):
    if draft == "DIR":
        draft = str(tiny_draft_dir)
    spec = method if draft is None else f"{method}:model={draft}"
    engine = SpeculativeEngine.from_pretrained(
        tiny64, speculator=spec, num_draft_tokens=k, adaptive=adaptive
    )
    accepted_total = drafted_total = 0
    for prompt in PROMPTS:
        plain = engine.generate(prompt, max_new_tokens=40, ignore_eos=True, speculate=False)
        spec = engine.generate(prompt, max_new_tokens=40, ignore_eos=True)
        assert spec.token_ids == plain.token_ids, (method, draft, k, prompt)
        assert spec.text == plain.text
        assert spec.stats.target_forwards <= plain.stats.target_forwards
        accepted_total += spec.stats.accepted_tokens
        drafted_total += spec.stats.drafted_tokens
    assert drafted_total > 0
    if draft == "layers:3":
        assert accepted_total > 0  # the accept path was exercised, not only rejections


def test_plain_equals_hf_generate(tiny64):
    engine = SpeculativeEngine.from_pretrained(tiny64)
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        ours = engine.generate(prompt, max_new_tokens=30, ignore_eos=True, speculate=False)
        assert ours.token_ids == hf_greedy(tiny64, ids, 30)
