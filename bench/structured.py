"""Structured output on the bundled model: validity with and without constraints, and the
speed of constrained speculative decoding over constrained plain decoding.

Twenty extraction prompts ("return the people, places and dates in this text as JSON matching
this schema") are built from the first training news articles
(``/work/shared/data/train/self_instruct_t0/cnn_dailymail_3_0_0_news_summary.jsonl``; never
the eval split). Greedy decoding, chat template on. For each prompt: unconstrained plain
decoding, constrained plain decoding, and constrained speculation per method; reported: the
valid-JSON and schema-valid rates, speedup (total plain seconds / total speculative seconds),
τ, the grammar's cost (pruning + masking + advancing) per target forward and per token, and the
draft / verify split. Constrained speculative output must equal constrained plain output.
Run from the repository root::

    .venv/bin/python bench/structured.py --threads 1 --out bench-out/structured.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

DATA = Path("/work/shared/data/train/self_instruct_t0/cnn_dailymail_3_0_0_news_summary.jsonl")
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "people": {"type": "array", "items": {"type": "string", "maxLength": 32}, "maxItems": 4},
        "places": {"type": "array", "items": {"type": "string", "maxLength": 32}, "maxItems": 4},
        "dates": {"type": "array", "items": {"type": "string", "maxLength": 32}, "maxItems": 4},
    },
    "required": ["people", "places", "dates"],
    "additionalProperties": False,
}


def prompts(n: int, chars: int) -> list[str]:
    out = []
    with DATA.open(encoding="utf-8") as f:
        for line in f:
            article = json.loads(line)["prompt"].split("\n\n", 1)[-1][:chars]
            article = article.rsplit(" ", 1)[0]
            out.append(
                "Return the names of the people, the places and the dates in this text as JSON "
                f"matching this schema:\n{json.dumps(SCHEMA)}\n\nText: {article}"
            )
            if len(out) == n:
                break
    return out


def schema_valid(value: Any) -> bool:
    """The bench schema's rules, checked by hand (no jsonschema dependency)."""
    if not isinstance(value, dict) or set(value) != set(SCHEMA["required"]):
        return False
    for key, rule in SCHEMA["properties"].items():
        items = value[key]
        if not isinstance(items, list) or len(items) > rule["maxItems"]:
            return False
        limit = rule["items"]["maxLength"]
        if not all(isinstance(s, str) and len(s) <= limit for s in items):
            return False
    return True


def validity(texts: list[str]) -> tuple[float, float]:
    ok_json = ok_schema = 0
    for text in texts:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            continue
        ok_json += 1
        ok_schema += schema_valid(value)
    return ok_json / len(texts), ok_schema / len(texts)


def run(engine: Any, items: list[str], max_new: int, **kwargs: Any) -> dict[str, Any]:
    texts, ids, seconds, forwards, tokens = [], [], 0.0, 0, 0
    grammar_s = draft_s = verify_s = accepted = 0.0
    for prompt in items:
        r = engine.generate(prompt, max_new_tokens=max_new, **kwargs)
        texts.append(r.text)
        ids.append(r.token_ids)
        s = r.stats
        seconds += s.seconds - s.prefill_seconds  # decoding only: prefill is the same
        forwards += s.target_forwards
        tokens += s.new_tokens
        grammar_s += s.grammar_seconds
        draft_s += s.draft_seconds
        verify_s += s.verify_seconds
        accepted += s.accepted_tokens
    json_rate, schema_rate = validity(texts)
    return {
        "json_valid": json_rate,
        "schema_valid": schema_rate,
        "decode_seconds": round(seconds, 3),
        "tokens": tokens,
        "target_forwards": forwards,
        "tau": round((accepted + forwards) / forwards, 3) if forwards else 0.0,
        "grammar_ms_per_forward": round(1e3 * grammar_s / forwards, 3) if forwards else 0.0,
        "grammar_ms_per_token": round(1e3 * grammar_s / tokens, 3) if tokens else 0.0,
        "draft_seconds": round(draft_s, 3),
        "verify_seconds": round(verify_s, 3),
        "grammar_seconds": round(grammar_s, 3),
        "ids": ids,
        "sample": texts[0][:200],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--chars", type=int, default=700, help="article characters per prompt")
    # the schema bounds the answer (3 arrays of at most 4 strings of at most 32 characters), so
    # a constrained answer always ends well inside 200 tokens
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--methods", default="prompt-lookup,suffix,auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import torch

    from specdec import SpeculativeEngine
    from specdec.grammar import Grammar
    from specdec.target import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(None)
    items = prompts(args.prompts, args.chars)
    grammar = Grammar.json_schema(SCHEMA)
    plain_engine = SpeculativeEngine.from_pretrained(loaded, speculator="none")
    plain_engine.generate(items[0], max_new_tokens=4, grammar=grammar, speculate=False)  # warm
    t0 = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {}
    rows["unconstrained plain"] = run(plain_engine, items, args.max_new_tokens, speculate=False)
    rows["constrained plain"] = run(
        plain_engine, items, args.max_new_tokens, speculate=False, grammar=grammar
    )
    base = rows["constrained plain"]
    for method in args.methods.split(","):
        engine = SpeculativeEngine.from_pretrained(loaded, speculator=method)
        row = run(engine, items, args.max_new_tokens, grammar=grammar)
        row["speedup"] = round(base["decode_seconds"] / row["decode_seconds"], 3)
        row["identical_to_constrained_plain"] = row["ids"] == base["ids"]
        rows[f"constrained {method}"] = row
    print(f"{len(items)} prompts, {args.max_new_tokens} new tokens max, greedy")
    header = (
        f"{'run':<26} {'json ok':>7} {'schema ok':>9} {'decode s':>9} {'tok':>5} {'τ':>5} "
        f"{'speedup':>7} {'grammar ms/fwd':>14} {'draft s':>7} {'verify s':>8} identical"
    )
    print(header)
    for name, r in rows.items():
        print(
            f"{name:<26} {r['json_valid']:>7.0%} {r['schema_valid']:>9.0%} "
            f"{r['decode_seconds']:>9.2f} {r['tokens']:>5} {r['tau']:>5.2f} "
            f"{r.get('speedup', 1.0):>7.2f} {r['grammar_ms_per_forward']:>14.2f} "
            f"{r['draft_seconds']:>7.2f} {r['verify_seconds']:>8.2f} "
            f"{r.get('identical_to_constrained_plain', '-')}"
        )
    print(f"wall {time.perf_counter() - t0:.0f} s")
    if args.out is not None:
        slim = {k: {kk: vv for kk, vv in v.items() if kk != "ids"} for k, v in rows.items()}
        args.out.write_text(json.dumps(slim, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
