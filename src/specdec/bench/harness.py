"""Running a benchmark: warm-up, then methods interleaved per prompt, one record per run.

Order: for each repeat, for each prompt, every method in turn (A, B, C, A, B, C, ...). A slow
minute on a shared machine then lands on all methods of a prompt alike instead of on whichever
method happened to run then, and per-prompt ratios cancel most of it.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec.bench.methods import REFERENCE, MethodRunner, RunOutput
from specdec.bench.stats import first_difference
from specdec.bench.workloads import Question
from specdec.control.calibration import cost_calibration_path
from specdec.errors import InvalidRequestError
from specdec.request import encode_prompt
from specdec.target import LoadedModel

Record = dict[str, Any]


@dataclass(frozen=True)
class BenchConfig:
    """How long and how often each method runs."""

    max_new_tokens: int = 128
    repeats: int = 1
    num_draft_tokens: int | None = None  # None: the engine's default
    warmup_tokens: int = 8  # per method, on the first prompt, before anything is recorded
    chat: bool | None = None  # None: use the chat template when the tokenizer has one

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidRequestError(
                f"--max-new-tokens must be >= 1, got {self.max_new_tokens}", "max_new_tokens"
            )
        if self.repeats < 1:
            raise InvalidRequestError(f"--repeats must be >= 1, got {self.repeats}", "repeats")
        if self.warmup_tokens < 0:
            raise InvalidRequestError("warm-up tokens must be >= 0", "warmup_tokens")


def environment(loaded: LoadedModel) -> dict[str, Any]:
    """What a tokens/s number depends on besides the method, stored with every record."""
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "dtype": loaded.dtype_name,
        "numerics": loaded.numerics,
        "model": loaded.source,
        # auto and the adaptive draft length start from it; without it, a generic prior
        "cost_calibration": cost_calibration_path(loaded).is_file(),
    }


def encode_questions(
    loaded: LoadedModel, questions: Sequence[Question], chat: bool | None
) -> list[list[int]]:
    """First turns as token ids, through the target's chat template when it has one."""
    use_chat = chat if chat is not None else bool(getattr(loaded.tokenizer, "chat_template", None))
    return [encode_prompt(loaded.tokenizer, q.prompt, use_chat) for q in questions]


def top2_margin(loaded: LoadedModel, context: Sequence[int]) -> tuple[float, int, int]:
    """The target's top-1 minus top-2 logit after ``context``, and those two tokens.

    A tiny margin at the first differing position means two numerically different but equally
    valid computations (a k-token verification pass vs a 1-token step) may pick either token.
    """
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([list(context)])).logits[0, -1].float()  # [V]
    top = torch.topk(logits, 2)
    return (
        float(top.values[0] - top.values[1]),
        int(top.indices[0]),
        int(top.indices[1]),
    )


def make_record(
    out: RunOutput,
    *,
    method: str,
    question: Question,
    prompt_len: int,
    repeat: int,
    env: dict[str, Any],
) -> Record:
    s = out.stats
    n = len(out.token_ids)
    return {
        "question_id": question.question_id,
        "line": question.line,
        "group": question.group,
        "category": question.category,
        "method": method,
        "repeat": repeat,
        "prompt_tokens": prompt_len,
        "new_tokens": n,
        "seconds": out.seconds,
        "tokens_per_s": n / out.seconds if out.seconds > 0 else 0.0,
        "finish_reason": out.finish_reason,
        "target_forwards": s.target_forwards if s else None,
        "mean_accepted": s.mean_accepted if s else None,
        "drafted_at": list(s.drafted_at) if s else None,
        "accepted_at": list(s.accepted_at) if s else None,
        "acceptance_by_position": s.acceptance_by_position if s else None,
        "prefill_seconds": s.prefill_seconds if s else None,
        "draft_seconds": s.draft_seconds if s else None,
        "verify_seconds": s.verify_seconds if s else None,
        "draft_fraction": s.draft_seconds / s.seconds if s and s.seconds > 0 else None,
        "choices": dict(s.choices) if s and s.choices else None,
        "token_ids": list(out.token_ids),
        "identical": None,
        "first_diff": None,
        "diff_margin": None,
        "diff_tokens": None,
        "load_avg_1m": _load_average(),
        "env": env,
    }


def _load_average() -> float | None:
    """The machine's 1-minute load average: on a shared machine it explains outlier timings."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def _check_identity(
    record: Record, reference: list[int], prompt_ids: list[int], loaded: LoadedModel
) -> None:
    """Fill the identity fields of ``record`` against plain decoding's output."""
    pos = first_difference(reference, record["token_ids"])
    record["identical"] = pos is None
    record["first_diff"] = pos
    if pos is None:
        return
    ref_tok = reference[pos] if pos < len(reference) else None
    got_tok = record["token_ids"][pos] if pos < len(record["token_ids"]) else None
    margin, top1, top2 = top2_margin(loaded, prompt_ids + reference[:pos])
    record["diff_margin"] = margin
    record["diff_tokens"] = {"reference": ref_tok, "method": got_tok, "top1": top1, "top2": top2}


ProgressFn = Callable[[str, Record | None], None]


def run_benchmark(
    loaded: LoadedModel,
    runners: Sequence[MethodRunner],
    questions: Sequence[Question],
    prompt_ids: Sequence[list[int]],
    config: BenchConfig,
    *,
    env: dict[str, Any] | None = None,
    on_run: ProgressFn | None = None,
    warmup_ids: list[int] | None = None,
) -> list[Record]:
    """Warm up, then run every method on every prompt, interleaved; returns the records.

    ``on_run(phase, record)`` is called after each run (phase ``"warmup"`` with ``None``, or
    ``"run"`` with the record) so that the caller can draw progress and write rows as they come.
    The reference method (``none``) must be first: the others are compared with its output.
    ``warmup_ids`` is the warm-up prompt; pass one outside the benchmark's prompts, so that a
    speculator that learns across requests (the suffix cache) has seen no benchmark answer
    before the first recorded run (default: the first prompt).
    """
    if not runners or runners[0].spec.label != REFERENCE:
        raise InvalidRequestError("the first method must be the reference, 'none'")
    env = env if env is not None else environment(loaded)
    if config.warmup_tokens and prompt_ids:
        for runner in runners:
            runner.run(warmup_ids or prompt_ids[0], config.warmup_tokens)
            if on_run:
                on_run("warmup", None)
    records: list[Record] = []
    for repeat in range(config.repeats):
        for question, ids in zip(questions, prompt_ids, strict=False):
            reference: list[int] | None = None
            for runner in runners:
                out = runner.run(ids, config.max_new_tokens)
                rec = make_record(
                    out,
                    method=runner.spec.label,
                    question=question,
                    prompt_len=len(ids),
                    repeat=repeat,
                    env=env,
                )
                if reference is None:
                    reference = list(out.token_ids)
                    rec["identical"] = True
                    rec["first_diff"] = None
                elif runner.spec.lossless:
                    _check_identity(rec, reference, list(ids), loaded)
                records.append(rec)
                if on_run:
                    on_run("run", rec)
    return records


def total_runs(n_methods: int, n_prompts: int, config: BenchConfig) -> int:
    """Runs the progress bar counts: warm-up runs plus measured runs."""
    warm = n_methods if config.warmup_tokens and n_prompts else 0
    return warm + n_methods * n_prompts * config.repeats
