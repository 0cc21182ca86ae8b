"""Calibrate self-speculation: choose the draft layers and the confidence stop by measured speed.

Each candidate ``self_draft`` spec is run greedily on a few training prompts, each run paired with
a plain decoding run of the same prompt right before it, so that both see the same machine load;
the figure of merit is the ratio of their total times (plain / speculative), which on a shared
CPU is far steadier than either tokens/s alone. Greedy output is identical either way, so both
runs produce the same number of tokens.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import DataError
from specdec.prompts import prompt_text, refuse_eval_set
from specdec.speculators import build_speculator, options_for
from specdec.target import HFTarget, LoadedModel
from specdec.training.progress import NullBar, ProgressFactory


@dataclass(frozen=True)
class CalibrationRow:
    spec: str
    speedup: float  # plain time / speculative time, paired runs
    tokens_per_s: float
    plain_tokens_per_s: float
    mean_accepted: float  # τ: tokens per target forward
    acceptance_rate: float


def pick_prompts(path: str | Path, n: int, category: str | None = None, seed: int = 0) -> list[str]:
    """``n`` prompts (seeded choice) from a JSONL training prompt file, optionally of one
    ``category``; evaluation sets are refused."""
    p = Path(path)
    refuse_eval_set(p)
    if not p.is_file():
        raise DataError(f"prompt file {str(p)!r} does not exist")
    rows = []
    for line in p.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        obj = json.loads(line)
        text = prompt_text(obj)
        if text and (category is None or obj.get("category") == category):
            rows.append(text)
    if not rows:
        raise DataError(
            f"{p} holds no prompts" + (f" of category {category!r}" if category else "")
        )
    return random.Random(seed).sample(rows, min(n, len(rows)))


def default_candidates(num_layers: int) -> list[str]:
    """Training-free drafts worth measuring for an ``num_layers``-layer target: early exits at
    2/3 and 4/5 of the depth, and middle skip windows of a fifth of the layers (Draft & Verify
    / SWIFT), each with no stop and with confidence stops.

    >>> default_candidates(30)[:3]
    ['exit:20', 'exit:24', 'skip:4-9']
    """
    n = num_layers
    w = max(1, n // 5)
    layers = [f"exit:{round(n * 2 / 3)}", f"exit:{round(n * 4 / 5)}"]
    for start in (n // 7, n // 3, n // 2 + 1):
        if 1 <= start and start + w < n:
            layers.append(f"skip:{start}-{start + w - 1}")
    return list(dict.fromkeys(layers))


def measure(
    loaded: LoadedModel,
    specs: Sequence[str],
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 48,
    num_draft_tokens: int = 6,
    progress: ProgressFactory = NullBar,
) -> list[CalibrationRow]:
    """Measure every spec on every prompt (greedy, chat template), paired with plain runs."""
    from specdec.engine import SpeculativeEngine

    rows: list[CalibrationRow] = []
    bar = progress(total=len(specs) * len(prompts), desc="calibrating self", unit="run")
    try:
        for spec in specs:
            engine = SpeculativeEngine(
                HFTarget(loaded),
                loaded.tokenizer,
                build_speculator(loaded, options_for("self", layers=spec)),
                num_draft_tokens=num_draft_tokens,
                loaded=loaded,
            )
            plain_s = spec_s = 0.0
            tokens = forwards = drafted = accepted = 0
            for prompt in prompts:
                t0 = time.perf_counter()
                plain = engine.generate(prompt, max_new_tokens=max_new_tokens, speculate=False)
                t1 = time.perf_counter()
                out = engine.generate(prompt, max_new_tokens=max_new_tokens)
                t2 = time.perf_counter()
                plain_s += t1 - t0
                spec_s += t2 - t1
                tokens += len(out.token_ids)
                assert len(plain.token_ids) == len(out.token_ids)
                forwards += out.stats.target_forwards
                drafted += out.stats.drafted_tokens
                accepted += out.stats.accepted_tokens
                bar.update(1)
            rows.append(
                CalibrationRow(
                    spec=spec,
                    speedup=plain_s / spec_s,
                    tokens_per_s=tokens / spec_s,
                    plain_tokens_per_s=tokens / plain_s,
                    mean_accepted=(accepted + forwards) / max(forwards, 1),
                    acceptance_rate=accepted / max(drafted, 1),
                )
            )
            bar.set_postfix(best=max(rows, key=lambda r: r.speedup).spec)
    finally:
        bar.close()
    return rows
