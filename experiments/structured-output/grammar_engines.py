"""Compare grammar engines on the bundled model's tokenizer (49,152 tokens): JSON-schema compile
time and per-token mask time, the two costs constrained decoding adds to every request / step.

Engines: llguidance, xgrammar, outlines-core, whichever are importable (install them into a
scratch directory and put it on ``PYTHONPATH`` to compare without touching the venv). Run from
the repository root::

    PYTHONPATH=/tmp/gbench .venv/bin/python experiments/structured-output/grammar_engines.py

Mask time is the mean over every position of a valid instance of the schema, tokenized by the
model's tokenizer (the states constrained decoding actually visits), one matcher, one thread.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "names": {"type": "array", "items": {"type": "string"}},
        "dates": {"type": "array", "items": {"type": "string"}},
        "count": {"type": "integer"},
        "summary": {"type": "string", "maxLength": 200},
    },
    "required": ["names", "dates", "count"],
    "additionalProperties": False,
}
INSTANCE = json.dumps(
    {
        "names": ["Ada Lovelace", "Charles Babbage"],
        "dates": ["10 December 1815", "1842"],
        "count": 2,
        "summary": "Notes on the Analytical Engine, with the first published program.",
    },
    separators=(",", ":"),
)
REPEATS = 5


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def bench_llguidance(hf_tok: Any, ids: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import torch

    setup, tok = _timed(lambda: llguidance.hf.from_tokenizer(hf_tok))
    compiles = []
    for _ in range(REPEATS):
        dt, m = _timed(
            lambda: llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
        )
        compiles.append(dt)
    bitmask = torch.zeros((tok.vocab_size + 31) // 32, dtype=torch.int32)
    masks = []
    for t in ids:
        dt, _ = _timed(lambda: m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4))
        masks.append(dt)
        assert m.consume_token(t), m.get_error()
    return {"setup_s": setup, "compile_s": statistics.median(compiles), **_pass_stats(masks)}


def bench_xgrammar(hf_tok: Any, ids: list[int]) -> dict[str, float]:
    import xgrammar as xgr

    setup, info = _timed(lambda: xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=len(hf_tok)))
    compiles = []
    for _ in range(REPEATS):
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        dt, cg = _timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))  # noqa: B023
        compiles.append(dt)
    m = xgr.GrammarMatcher(cg)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    masks = []
    for t in ids:
        dt, _ = _timed(lambda: m.fill_next_token_bitmask(bitmask))
        masks.append(dt)
        assert m.accept_token(t)
    return {"setup_s": setup, "compile_s": statistics.median(compiles), **_pass_stats(masks)}


def bench_outlines(hf_tok: Any, ids: list[int]) -> dict[str, float]:
    import llguidance.hf  # only to read each token's bytes
    import outlines_core
    import torch
    from outlines_core.json_schema import build_regex_from_schema

    def vocabulary() -> Any:
        lltok = llguidance.hf.from_tokenizer(hf_tok)
        table: dict[bytes, list[int]] = {}
        eos = int(hf_tok.eos_token_id)
        for i in range(len(hf_tok)):
            if i == eos or lltok.is_special_token(i):
                continue
            table.setdefault(lltok.decode_bytes([i]), []).append(i)
        return outlines_core.Vocabulary(eos, table)

    setup, vocab = _timed(vocabulary)
    compiles = []
    for _ in range(REPEATS):
        dt, index = _timed(
            lambda: outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA)), vocab)
        )
        compiles.append(dt)
    guide = outlines_core.Guide(index)
    mask = torch.zeros((len(hf_tok) + 31) // 32, dtype=torch.int32)
    masks = []
    for t in ids:
        dt, _ = _timed(lambda: guide.write_mask_into(mask.data_ptr(), mask.numel(), 4))
        masks.append(dt)
        guide.advance(t)
    return {"setup_s": setup, "compile_s": statistics.median(compiles), **_pass_stats(masks)}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _pass_stats(masks: list[float]) -> dict[str, float]:
    return {"mask_s": _mean(masks), "mask_median_s": statistics.median(masks)}


def main() -> None:
    from specdec.target import load_model

    hf_tok = load_model(None).tokenizer
    ids = hf_tok.encode(INSTANCE, add_special_tokens=False)
    print(f"vocabulary {len(hf_tok)} tokens; instance {len(ids)} tokens")
    print(
        f"{'engine':<14} {'tokenizer setup':>16} {'schema compile':>15} {'mask mean':>10} "
        f"{'mask median':>12}"
    )
    for name, fn in (
        ("llguidance", bench_llguidance),
        ("xgrammar", bench_xgrammar),
        ("outlines-core", bench_outlines),
    ):
        try:
            r = fn(hf_tok, ids)
        except ImportError as e:
            print(f"{name:<14} not installed ({e})")
            continue
        print(
            f"{name:<14} {r['setup_s'] * 1e3:>13.1f} ms {r['compile_s'] * 1e3:>12.2f} ms "
            f"{r['mask_s'] * 1e6:>7.1f} µs {r['mask_median_s'] * 1e6:>9.1f} µs"
        )


if __name__ == "__main__":
    main()
