"""A draft model with *another tokenizer* drafts through text (``draft:model=X`` where X's
vocabulary differs from the target's; :mod:`specdec.speculators.draft_model` switches here).

How a step goes:

1. **The draft follows the committed text.** The committed target tokens are turned into text
   (only the tokens new since the last step are decoded; target tokens whose text is not
   complete yet, a partial UTF-8 character or byte-fallback piece that decodes to U+FFFD, wait
   for the tokens that complete it) and the text into the draft's tokens: the last few draft
   tokens and the new text are re-tokenised with the draft's tokenizer, anchored on the draft
   token before them (when the anchor does not come back unchanged, the whole text is
   re-tokenised once). The draft's KV cache keeps its longest prefix that still agrees with
   those tokens and reads only the rest, so no step re-reads the context.
2. **The draft continues the text in its own tokens**: greedily (argmax), a chain of draft
   tokens, for greedy and sampled requests alike, stopping after a token whose draft
   probability is below ``min_confidence``, at the draft's end-of-sequence or once enough
   target tokens are drafted.
3. **The continuation is carried into the target's tokens through text**: the draft tokens are
   decoded to text, the text of the last few committed target tokens plus the draft's text is
   re-tokenised with the target's tokenizer, and the committed tokens must come back as a
   prefix of that re-tokenisation (aligned at a token boundary; otherwise the step proposes
   nothing). The target tokens beyond them are the proposal, less the last one, which may be
   incomplete: the draft's text may end inside what the target would merge into a longer token
   (``" hel"`` of ``" hello"``), or inside a character. A draft end-of-sequence becomes the
   target's, after the text before it.

The proposal is a chain **without draft probabilities (no q)**, so verification is the engine's
standard rule: greedy match for greedy requests; for sampled ones a deterministic proposal is a
point mass q, and rejection sampling (:class:`specdec.verify.RejectionSamplingRule`: accept x
with probability p(x), else sample from p with x removed and renormalised) leaves exactly the
target's distribution, as it does for prompt lookup. The proposal depends on the committed
tokens and the budget alone (never on timing or the request's RNG), so sampled output stays a
function of the seed.

Chains only (a tree would need a tree over the draft's tokens mapped node by node): ``tree=`` is
refused for a draft with another tokenizer. Its chain is sized by the engine's adaptive budget
in target tokens (``length=budget``; the self-stopping chain reads per-token confidences that
do not map one to one onto target tokens). Cost beyond the draft's forwards: per step, a few
short decode and encode calls (one re-tokenisation per drafted token for the mapping, one for
the draft's view of the new text): about 0.2 ms per drafted token on the tests' tokenizers.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from transformers import PreTrainedTokenizerFast

from specdec.cache import common_prefix_len
from specdec.config import SamplingConfig
from specdec.errors import ConfigError
from specdec.speculators.base import DraftContext, Speculator
from specdec.speculators.draft_vocab import SubsetHead, draft_vocabulary, with_subset_head
from specdec.target import LoadedModel, ModelRunner, TokenRunner
from specdec.target.checkpoints import gguf_tokenizer
from specdec.target.drafts import LlamaCppDraft
from specdec.tree import DraftTree

log = logging.getLogger(__name__)

WINDOW = 4  # committed tokens re-tokenised together with new text, on either side
LOOKBACK = 4  # tokens decoded before a piece so that it reads as it does mid-text
INCOMPLETE = "\ufffd"  # what a partial UTF-8 character or byte-fallback piece decodes to
MAX_HOLD = 8  # target tokens held back at most while their text is incomplete


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """``ids`` as text, special tokens spelt out (a draft reads them as text). A fast
    tokenizer's Rust backend is called directly: the Python wrapper costs ten times more."""
    if isinstance(tokenizer, PreTrainedTokenizerFast):
        text = tokenizer.backend_tokenizer.decode(list(ids), skip_special_tokens=False)
    else:
        text = tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
    assert isinstance(text, str)
    return text


def piece_text(tokenizer: Any, before: Sequence[int], ids: Sequence[int]) -> str | None:
    """The text ``ids`` add after ``before`` (its last few tokens decoded first, so a leading
    space or a multi-byte character reads as mid-text); ``None`` when ``before`` alone does not
    decode to a prefix of ``before + ids`` (they share a character)."""
    ctx = list(before[-LOOKBACK:])
    head = decode(tokenizer, ctx)
    full = decode(tokenizer, ctx + list(ids))
    if not full.startswith(head):
        return None
    return full[len(head) :]


def encode(tokenizer: Any, text: str) -> tuple[list[int], list[int] | None]:
    """``text``'s tokens (no special tokens added) and each token's end in ``text`` (``None``
    when the tokenizer gives no offsets: not a fast tokenizer)."""
    if isinstance(tokenizer, PreTrainedTokenizerFast):
        enc = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
        return list(enc.ids), [int(end) for _, end in enc.offsets]
    return list(tokenizer.encode(text, add_special_tokens=False)), None


def encode_after(
    tokenizer: Any, text: str, anchor: Sequence[int]
) -> tuple[list[int], list[int] | None, int] | None:
    """Tokens of ``text`` after ``anchor``, when re-tokenising ``text`` gives ``anchor`` back as
    its first tokens (a token boundary that the text after it does not move); with their ends in
    ``text`` and the offset those ends count from. A tokenizer that marks a word's leading space
    itself (SentencePiece's dummy prefix) would read a leading space twice, so a text starting
    with one is tried without it too. ``None``: the anchor does not come back.

    For a byte-level BPE whose vocabulary has ``" the"``:
    ``encode_after(tok, " the cat", [id(" the")])`` gives the tokens of ``" cat"``;
    ``encode_after(tok, " th" + "e cat", [id(" th")])`` gives ``None`` (``" th"`` and ``"e"``
    merge into ``" the"``)."""
    n = len(anchor)
    variants = [0, 1] if text.startswith(" ") else [0]
    for skip in variants:
        ids, ends = encode(tokenizer, text[skip:])
        if ids[:n] == list(anchor):
            return ids[n:], None if ends is None else ends[n:], skip
    return None


@dataclass
class _Mirror:
    """One request's committed text, in both vocabularies: the target tokens turned into text so
    far (``t_ids``, each one's end in ``text`` or -1 where unknown), and the draft's tokens of the
    same text (``d_ids``, ends likewise)."""

    t_ids: list[int] = field(default_factory=list)
    t_ends: list[int] = field(default_factory=list)
    text: str = ""
    d_ids: list[int] = field(default_factory=list)
    d_ends: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Mapped:
    """A draft continuation in the target's tokens: ``tokens`` to propose, and ``tail`` the
    committed target tokens they were aligned on."""

    tokens: list[int]
    tail: int


class CrossVocabSpeculator(Speculator):
    """A draft model with another tokenizer drafts chains through text (see the module doc);
    verification is the engine's standard rule for drafts without q."""

    name: ClassVar[str] = "draft"
    produces_q: ClassVar[bool] = False
    drafts_by_model: ClassVar[bool] = True
    loaded_draft: object = None  # set by the builder: the draft's weights, kept alive

    def __init__(
        self,
        runner: TokenRunner,
        draft_tokenizer: Any,
        target_tokenizer: Any,
        description: str = "draft model (another tokenizer)",
        min_confidence: float = 0.0,
        *,
        target_eos: int | None = None,
        draft_eos: Sequence[int] = (),
    ) -> None:
        if not 0.0 <= min_confidence < 1.0:
            raise ConfigError(f"min_confidence must be in [0, 1), got {min_confidence}")
        self.runner = runner
        self.draft_tokenizer = draft_tokenizer
        self.target_tokenizer = target_tokenizer
        self.description = description
        self.min_confidence = min_confidence
        eos = draft_tokenizer.eos_token_id
        self.draft_eos = frozenset([*draft_eos, *([] if eos is None else [eos])])
        self.draft_specials = frozenset(draft_tokenizer.all_special_ids)
        self.target_eos = target_tokenizer.eos_token_id if target_eos is None else target_eos
        self.target_specials = frozenset(target_tokenizer.all_special_ids)
        self.mapped_steps = 0  # steps whose draft came back as target tokens
        self.unaligned_steps = 0  # steps whose committed tail did not come back
        self._reset_request()

    def _reset_request(self) -> None:
        self._mirror = _Mirror()
        self._catch_up = 0.0

    def reset(self) -> None:
        self.runner.reset()
        self._reset_request()

    def fork(self) -> CrossVocabSpeculator:
        """Its own runner and KV cache over the same weights, fresh per-request state."""
        clone = copy.copy(self)
        clone.runner = self.runner.sibling()
        clone._reset_request()
        return clone

    def chain_cap(self, sampling: SamplingConfig) -> int | None:
        return None  # the engine's adaptive budget sizes the chain, in target tokens

    # -- the committed text in the draft's tokens ----------------------------------------------
    def sync(self, tokens: Sequence[int]) -> bool:
        """Bring the mirror up to the committed target ``tokens``; whether all of their text is
        complete (else the last few wait, and nothing is drafted this step)."""
        m = self._mirror
        if common_prefix_len(m.t_ids, tokens) < len(m.t_ids):  # another request's tokens
            self._mirror = m = _Mirror()
        new = list(tokens[len(m.t_ids) :])
        if not new:
            return True
        take, delta = len(new), piece_text(self.target_tokenizer, m.t_ids, new)
        # hold back the target tokens of an unfinished character (at most MAX_HOLD of them)
        while take > 0 and (delta is None or delta.endswith(INCOMPLETE)):
            if len(new) - take >= MAX_HOLD:
                break
            take -= 1
            delta = piece_text(self.target_tokenizer, m.t_ids, new[:take])
        if delta is None or (take < len(new) and delta.endswith(INCOMPLETE)):
            delta = piece_text(self.target_tokenizer, m.t_ids, new)
            if delta is None:  # the tokens share a character with the text before them
                delta = decode(self.target_tokenizer, new)
            take = len(new)
        if take == 0:
            return False
        base = len(m.text)
        ends = [-1] * take
        for i in range(max(0, take - WINDOW - 1), take):  # only the last few ends are needed
            piece = piece_text(self.target_tokenizer, m.t_ids, new[: i + 1])
            if piece is not None and not piece.endswith(INCOMPLETE) and delta.startswith(piece):
                ends[i] = base + len(piece)
        ends[-1] = base + len(delta)
        m.t_ids.extend(new[:take])
        m.t_ends.extend(ends)
        m.text += delta
        self._extend_draft(base)
        return take == len(new)

    def _extend_draft(self, changed: int) -> None:
        """Re-tokenise the draft's last few tokens and the text from ``changed`` on."""
        m = self._mirror
        tok = self.draft_tokenizer
        n = len(m.d_ids)
        # the anchor: a draft token ending at a known boundary, WINDOW tokens before the end
        a = n - WINDOW - 1
        while a >= 0 and not (0 <= m.d_ends[a] <= changed and (a == 0 or m.d_ends[a - 1] >= 0)):
            a -= 1
        if a >= 0:
            start = m.d_ends[a - 1] if a > 0 else 0
            got = encode_after(tok, m.text[start:], m.d_ids[a : a + 1])
            if got is not None:
                ids, ends, skip = got
                m.d_ids[a + 1 :] = ids
                m.d_ends[a + 1 :] = (
                    [-1] * len(ids) if ends is None else [start + skip + e for e in ends]
                )
                return
        ids, ends = encode(tok, m.text)
        m.d_ids = ids
        m.d_ends = [-1] * len(ids) if ends is None else ends

    # -- drafting ------------------------------------------------------------------------------
    def pending_catch_up(self, context: DraftContext) -> int:
        """Roughly the draft tokens the next draft reads first: the target tokens not yet
        turned into text, and what the draft's cache lacks of the committed text."""
        m = self._mirror
        behind = len(m.d_ids) - common_prefix_len(self.runner.cache.tokens, m.d_ids)
        gap = behind + len(context.tokens) - len(m.t_ids)
        return gap - 1 if gap > 2 else 0

    def catch_up_seconds(self) -> float:
        return self._catch_up

    def _read_context(self) -> torch.Tensor:
        """The draft's logits after the committed text's draft tokens (``[V]``): its cache keeps
        the longest agreeing prefix and reads the rest (all but the last as one catch-up pass)."""
        ids = self._mirror.d_ids
        if isinstance(self.runner, ModelRunner):
            head = self.runner.model.get_output_embeddings()
            if isinstance(head, SubsetHead):
                head.include(ids)
        cache = self.runner.cache
        keep = min(common_prefix_len(cache.tokens, ids), len(ids) - 1)
        cache.rollback(keep)
        self._catch_up = 0.0
        if len(ids) - keep > 2:
            t0 = time.perf_counter()
            self.runner.forward(ids[keep:-1], logits_to_keep=1)
            self._catch_up = time.perf_counter() - t0
            keep = len(ids) - 1
        return self.runner.forward(ids[keep:], logits_to_keep=1)[-1]

    def map_draft(self, drafted: Sequence[int], ended: bool) -> Mapped | None:
        """The draft tokens ``drafted`` (after the committed text) as target tokens: their text
        after the committed tail, re-tokenised with the target's tokenizer and aligned on the
        committed target tokens, less a last token that may be incomplete (kept when ``ended``:
        the draft ended its text there). ``None``: the committed tail did not come back."""
        m = self._mirror
        text = piece_text(self.draft_tokenizer, m.d_ids, drafted)
        if text is None:
            text = decode(self.draft_tokenizer, drafted)
        complete = text.rstrip(INCOMPLETE)
        ended = ended and complete == text
        n = len(m.t_ids)
        for tail in range(min(WINDOW, n), 0, -1):
            if tail < n and m.t_ends[n - tail - 1] < 0:
                continue  # no known boundary there
            start = m.t_ends[n - tail - 1] if tail < n else 0
            got = encode_after(self.target_tokenizer, m.text[start:] + complete, m.t_ids[-tail:])
            if got is None:
                continue
            ids = got[0]
            if ids and not ended and ids[-1] not in self.target_specials:
                ids = ids[:-1]
            return Mapped(ids, tail)
        return None

    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        tokens = context.tokens
        root = DraftTree.root_only(tokens[-1])
        complete = self.sync(tokens)
        m = self._mirror
        room = self.runner.context_length - len(m.d_ids) - 1
        if budget < 1 or not complete or not m.d_ids or room < 1:
            return root
        logits = self._read_context()  # [V]
        drafted: list[int] = []
        proposal: list[int] = []
        limit = min(room, 4 * budget + 4)  # draft tokens per step, at most
        ended = False
        while len(drafted) < limit:
            token = int(logits.argmax())
            if token in self.draft_eos or token in self.draft_specials:
                ended = token in self.draft_eos
                break
            drafted.append(token)
            mapped = self.map_draft(drafted, ended=False)
            if mapped is None:
                self.unaligned_steps += 1
                break
            proposal = mapped.tokens
            if len(proposal) >= budget or not self._confident(logits):
                break
            if len(drafted) < limit:
                logits = self.runner.forward([token], logits_to_keep=1)[-1]
        if ended:
            mapped = self.map_draft(drafted, ended=True) if drafted else Mapped([], 0)
            if mapped is not None:
                proposal = (
                    [*mapped.tokens, self.target_eos]
                    if self.target_eos is not None
                    else mapped.tokens
                )
        proposal = proposal[:budget]
        if proposal:
            self.mapped_steps += 1
        return DraftTree.chain(tokens[-1], proposal)

    def _confident(self, logits: torch.Tensor) -> bool:  # logits [V]
        if self.min_confidence <= 0.0:
            return True
        return float(torch.softmax(logits.float(), -1).max()) >= self.min_confidence


def build_cross_vocab(
    target: LoadedModel,
    draft: LoadedModel | LlamaCppDraft,
    *,
    note: str,
    min_confidence: float = 0.0,
    vocab: int = 0,
    tree: bool = False,
) -> CrossVocabSpeculator:
    """The speculator for a ``draft`` whose vocabulary differs from the target's (``note``
    says how): chains through text. ``vocab``: score only the draft tokenizer's N most frequent
    tokens (0: all); ``tree``: a tree was asked for, which this mode cannot draft."""
    if tree:
        raise ConfigError(
            f"draft: {note}, so it drafts through text, and such a draft drafts chains only; "
            "use tree=chain"
        )
    # a note the user sees once (as the missing chat template's): the mode is legitimate, but
    # its acceptance is what the two models agree on in text
    log.warning("%s: the draft runs through text (cross-vocabulary drafting, chains)", note)
    if isinstance(draft, LlamaCppDraft):
        speculator = CrossVocabSpeculator(
            draft.runner,
            gguf_tokenizer(draft.source),
            target.tokenizer,
            f"{draft.description}, another tokenizer",
            min_confidence,
        )
        speculator.loaded_draft = draft
        return speculator
    model = draft.model
    size = int(model.config.vocab_size)
    if vocab and vocab < size:
        keep = {*draft.tokenizer.all_special_ids, *draft.eos_token_ids}
        ids = draft_vocabulary(draft.tokenizer, vocab, size, keep)
        model = with_subset_head(draft.model, ids, draft.dtype_name)
    speculator = CrossVocabSpeculator(
        ModelRunner(model),
        draft.tokenizer,
        target.tokenizer,
        f"draft model {draft.source} (another tokenizer)",
        min_confidence,
        draft_eos=sorted(draft.eos_token_ids),
    )
    speculator.loaded_draft = draft
    return speculator
