"""A smaller causal LM drafts K tokens autoregressively over its own KV cache.

Greedy requests draft the draft model's argmax (deterministic, q = one-hot); sampled requests
sample each draft token from q (shaped by the request's temperature/top-k/top-p like p) and carry
q to the rejection-sampling rule. With ``min_confidence`` > 0 the chain stops early, after the
first token whose draft probability is below it (greedy: the top of softmax(logits); sampled: q
of the sampled token) -- Draft & Verify's dynamic draft length. The choice depends on the draft
alone, so verification stays lossless. The draft cache is synchronised with the committed tokens by
longest common prefix, so rejected drafts are rolled back without any bookkeeping in the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import torch

from specdec.cache import common_prefix_len
from specdec.errors import ConfigError, VocabularyMismatchError
from specdec.speculators.base import DraftContext, Speculator
from specdec.speculators.spec import SpeculatorOptions, option, register
from specdec.target import LoadedModel, ModelRunner, early_exit_model, load_model
from specdec.tree import DraftTree
from specdec.verify import probs_from_logits, sample


@dataclass(frozen=True, kw_only=True)
class DraftOptions(SpeculatorOptions):
    primary = "model"
    model: str = option(
        help="draft model directory (same vocabulary), or layers:N (the target's first N layers)"
    )
    min_confidence: float = option(
        0.0, help="stop a draft after a token whose draft probability is below this"
    )
    dtype: str | None = option(
        None,
        help="the draft's own numerics (float32, bfloat16, fp16-weights, ...; default: the "
        "target's); it cannot change the output, which the target verifies",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.min_confidence < 1.0:
            raise ConfigError(f"draft: min_confidence must be in [0, 1), got {self.min_confidence}")
        if self.model.startswith("layers:") and not self.model[7:].isdigit():
            raise ConfigError(f"draft: model={self.model!r}: expected layers:N with N an integer")
        if self.model.startswith("layers:") and self.dtype is not None:
            raise ConfigError(
                "draft: a layers:N draft shares the target's weights, so it runs in the "
                "target's numerics; drop dtype= or use a separate draft model"
            )
        if self.dtype is not None:
            from specdec.target.numerics import get_numerics

            get_numerics(self.dtype)  # an unknown name fails here, before anything loads


class DraftModelSpeculator(Speculator):
    name: ClassVar[str] = "draft"
    produces_q: ClassVar[bool] = True
    drafts_by_model: ClassVar[bool] = True

    def __init__(
        self, runner: ModelRunner, description: str = "draft model", min_confidence: float = 0.0
    ) -> None:
        if not 0.0 <= min_confidence < 1.0:
            raise ConfigError(f"min_confidence must be in [0, 1), got {min_confidence}")
        self.runner = runner
        self.description = description
        self.min_confidence = min_confidence
        self._step_seconds = 0.0  # running average of a first forward over <= 2 tokens
        self._catch_up = 0.0

    def reset(self) -> None:
        self.runner.reset()

    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        tokens = context.tokens
        if budget < 1:
            return DraftTree.root_only(tokens[-1])
        cache = self.runner.cache
        # Reuse the cached prefix; at least the last committed token is fed to get its logits.
        keep = min(common_prefix_len(cache.tokens, tokens), len(tokens) - 1)
        cache.rollback(keep)
        t0 = time.perf_counter()
        logits = self.runner.forward(tokens[keep:], logits_to_keep=1)[-1]  # [V]
        self._account_catch_up(len(tokens) - keep, time.perf_counter() - t0)
        greedy = context.sampling.greedy
        drafts: list[int] = []
        q_rows: list[torch.Tensor] = []
        for i in range(budget):
            if greedy:
                token = int(logits.argmax())
                confident = self._confident(logits)
            else:
                q = probs_from_logits(logits[None], context.sampling)[0]  # [V]
                token = sample(q, context.generator)
                q_rows.append(q)
                confident = float(q[token]) >= self.min_confidence
            drafts.append(token)
            if not confident:
                break
            if i + 1 < budget:
                logits = self.runner.forward([token])[-1]
        draft_probs = None
        if q_rows:
            draft_probs = torch.stack([torch.zeros_like(q_rows[0]), *q_rows])  # [N, V]
        return DraftTree.chain(tokens[-1], drafts, draft_probs)

    def _account_catch_up(self, fed: int, seconds: float) -> None:
        """Split the first forward of a draft into catch-up and drafting: feeding the root
        (and, after a fully accepted step, the last draft token) is what every draft costs;
        anything beyond is the gap since this speculator last drafted. The part beyond one
        single-token forward (a running average) counts as catch-up."""
        if fed <= 2:
            d = 0.8 if self._step_seconds > 0 else 0.0
            self._step_seconds = d * self._step_seconds + (1 - d) * seconds
            self._catch_up = 0.0
        else:
            self._catch_up = max(0.0, seconds - self._step_seconds)

    def catch_up_seconds(self) -> float:
        return self._catch_up

    def _confident(self, logits: torch.Tensor) -> bool:  # logits [V]
        if self.min_confidence <= 0.0:
            return True
        return float(torch.softmax(logits.float(), -1).max()) >= self.min_confidence


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft whose token ids mean other strings would be verified against the wrong text."""
    t_vocab, d_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if t_vocab != d_vocab:
        diff = len(set(t_vocab.items()) ^ set(d_vocab.items()))
        raise VocabularyMismatchError(
            f"the draft's tokenizer ({draft.source}, {len(d_vocab)} tokens) differs from the "
            f"target's ({target.source}, {len(t_vocab)} tokens) in {diff} entries; a draft must "
            "use the target's vocabulary"
        )
    t_size = target.model.config.vocab_size
    d_size = draft.model.config.vocab_size
    if t_size != d_size:
        raise VocabularyMismatchError(
            f"the draft's output layer has {d_size} logits, the target's {t_size}"
        )


@register("draft", DraftOptions)
def _build(target: LoadedModel, options: DraftOptions) -> DraftModelSpeculator:
    """a smaller model of the same vocabulary drafts a chain over its own KV cache"""
    spec = options.model
    if spec.startswith("layers:"):
        n = int(spec.split(":", 1)[1])
        model = early_exit_model(target.model, n)
        return DraftModelSpeculator(
            ModelRunner(model), f"first {n} layers of the target", options.min_confidence
        )
    draft = load_model(spec, dtype=options.dtype or target.dtype_name, device=target.device)
    check_same_vocabulary(target, draft)
    runner = ModelRunner(draft.model)
    return DraftModelSpeculator(runner, f"draft model {draft.source}", options.min_confidence)
