"""Trivial fakes of the engine's protocols, for fast tests of the loop and the rules.

A table-driven Markov target (p depends on the last token only) and a Markov speculator (q
likewise) make exact target distributions computable in closed form, which the statistical
losslessness tests need. They use a real (word-level) tokenizer, so the engine runs unchanged.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import ClassVar

import torch
from transformers import PreTrainedTokenizerFast

from specdec.speculators.base import DraftContext, Feedback, Speculator
from specdec.target import LoadedModel
from specdec.tree import DraftTree
from specdec.verify import probs_from_logits, sample


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Tokens ``t0 .. t{V-1}`` plus ``<eos>`` (id V), whitespace-separated."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    vocab["<eos>"] = vocab_size
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


class MarkovTarget:
    """p(next | context) = softmax(table[last token]).  ``table``: [V, V] logits."""

    provides_features: ClassVar[bool] = False

    def __init__(self, table: torch.Tensor, context_length: int = 4096) -> None:
        self.table = table
        self._context_length = context_length
        self.forwards = 0

    @property
    def context_length(self) -> int:
        return self._context_length

    @property
    def device(self) -> torch.device:
        return self.table.device

    def begin(self, prompt: Sequence[int]) -> None:
        pass

    def verify(self, tree: DraftTree) -> torch.Tensor:
        self.forwards += 1
        return self.table[list(tree.tokens)]  # [N, V]

    def commit(self, path: Sequence[int]) -> None:
        pass

    def enable_features(self, layers: Sequence[int] = (-1,)) -> None:
        raise NotImplementedError("a Markov table target has no hidden states")

    @property
    def features(self) -> torch.Tensor | None:
        return None


class MarkovSpeculator(Speculator):
    """Drafts a chain by sampling q(next | last) = softmax(table[last]) shaped like p."""

    name: ClassVar[str] = "markov"
    produces_q: ClassVar[bool] = True

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        last = context.tokens[-1]
        drafts, rows = [], []
        for _ in range(budget):
            q = probs_from_logits(self.table[last][None], context.sampling)[0]  # [V]
            last = sample(q, context.generator) if not context.sampling.greedy else int(q.argmax())
            drafts.append(last)
            rows.append(q)
        if not drafts:
            return DraftTree.root_only(context.tokens[-1])
        probs = torch.stack([torch.zeros_like(rows[0]), *rows])
        return DraftTree.chain(context.tokens[-1], drafts, probs)

    def observe(self, feedback: Feedback) -> None:
        pass

    def reset(self) -> None:
        pass


class ScriptedSpeculator(Speculator):
    """Proposes fixed continuations: ``script[len(context)]`` is the chain drafted there."""

    name: ClassVar[str] = "scripted"

    def __init__(self, script: dict[int, list[int]]) -> None:
        self.script = script

    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        drafts = self.script.get(len(context.tokens), [])[:budget]
        return DraftTree.chain(context.tokens[-1], drafts)


def model_fingerprint(loaded: LoadedModel, modules: bool = False) -> str:
    """Digest of a model's weights (also those inside prepacked linears, seen through the
    logits of a fixed input) and config, and with ``modules`` each module's hook counts and
    ``layer_idx``: what a
    speculator sharing the target's modules must leave untouched."""
    h = hashlib.sha256()
    for name, t in sorted(loaded.model.state_dict().items()):
        if t.layout == torch.strided:
            h.update(name.encode())
            h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    with torch.inference_mode():
        logits = loaded.model(torch.arange(1, 40)[None]).logits
    h.update(logits.contiguous().view(torch.uint8).numpy().tobytes())
    h.update(json.dumps(loaded.model.config.to_dict(), sort_keys=True, default=str).encode())
    if modules:
        for name, m in loaded.model.named_modules():
            h.update(f"{name}:{len(m._forward_hooks)}:{len(m._forward_pre_hooks)}".encode())
            h.update(str(getattr(m, "layer_idx", "")).encode())
    return h.hexdigest()
