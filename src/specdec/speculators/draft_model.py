"""A smaller causal LM drafts K tokens autoregressively over its own KV cache.

Greedy requests draft the draft model's argmax (deterministic, q = one-hot); sampled requests
sample each draft token from q (shaped by the request's temperature/top-k/top-p like p) and carry
q to the rejection-sampling rule. With ``min_confidence`` > 0 the chain stops early, after the
first token whose draft probability is below it (greedy: the top of softmax(logits); sampled: q
of the sampled token) -- Draft & Verify's dynamic draft length. The choice depends on the draft
alone, so verification stays lossless. The draft cache is synchronised with the committed tokens by
longest common prefix, so rejected drafts are rolled back without any bookkeeping in the engine.
A draft whose tokenizer differs from the target's drafts chains through text instead
(:mod:`specdec.speculators.cross_vocab`; the builder below switches to it).

With ``tree=`` other than ``chain`` the draft model drafts a token *tree* (SpecInfer / Sequoia
style): depth by depth, one draft forward over the frontier (a tree mask over the draft's own
cache), several children where the draft is unsure, as deep as it pays. Its size is priced like
the Medusa and EAGLE trees, from ``context.costs`` (the target's T(n)) and the draft's own cost
per forward, with acceptance estimated from the draft's confidence and calibrated online on what
verification accepts. Greedy children are the draft's top tokens (q one-hot); sampled children of
one node are drawn from q *without replacement*, each child's q row being the renormalised
distribution it was drawn from, which the multi-draft rejection-sampling rule needs to stay
lossless (see :mod:`specdec.verify.rules`). For sampled requests nothing about a drafted node's
own token decides whether it is in the tree (only whether it gets children), and the sizing never
depends on timing.
"""

from __future__ import annotations

import copy
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from specdec.cache import common_prefix_len
from specdec.config import SamplingConfig
from specdec.control.budget import CostModel
from specdec.errors import ConfigError
from specdec.speculators.base import DraftContext, Feedback, Speculator
from specdec.speculators.cross_vocab import CrossVocabSpeculator, build_cross_vocab
from specdec.speculators.draft_vocab import SubsetHead
from specdec.speculators.spec import SpeculatorOptions, option, register
from specdec.target import LoadedModel, ModelRunner, TokenRunner, early_exit_model
from specdec.target.drafts import (  # noqa: F401 - names this module has always offered
    LlamaCppDraft,
    check_draft_dtype,
    check_same_vocabulary,
    default_draft_dtype,
    draft_gguf_path,
    draft_vocabulary_mismatch,
    load_draft,
)
from specdec.target.masks import attention_masks
from specdec.tree import DraftTree
from specdec.verify import probs_from_logits, sample

log = logging.getLogger(__name__)

MAX_TREE_NODES = 32  # drafted nodes of one tree, at most
_PRIOR = CostModel.prior()
DEFAULT_TREE_DEPTH = 8  # deepest tree drafted when k= is not given
DEFAULT_CHAIN_DEPTH = 16  # longest self-sized chain (length=auto) when k= is not given
CHAIN_LENGTHS = ("auto", "budget")


@dataclass(frozen=True)
class TreeShape:
    """How a draft-model tree branches: ``width`` children at a node of depth < ``depths``
    (the root is depth 0) whose draft top probability is below ``below`` (1.0: always), one
    child elsewhere; a draft forward expands at most ``frontier`` nodes of a depth.

    >>> TreeShape.parse("2x3")
    TreeShape(width=2, depths=3, below=1.0, frontier=4)
    >>> TreeShape.parse("3x2@0.7").below, TreeShape.parse("chain")
    (0.7, None)
    """

    width: int
    depths: int
    below: float = 1.0
    frontier: int = 4

    @classmethod
    def parse(cls, spec: str | None) -> TreeShape | None:
        """``chain`` (``None``: the adaptive chain), ``auto``, ``WxD`` or ``WxD@C``."""
        if spec is None or spec == "chain":
            return None
        if spec == "auto":
            return AUTO_TREE
        m = re.fullmatch(r"(\d+)x(\d+)(?:@([0-9.]+))?", spec)
        if not m:
            raise ConfigError(
                f"draft: tree={spec!r}: expected chain, auto, WxD or WxD@C (e.g. 2x2, 2x3@0.8)"
            )
        width, depths = int(m.group(1)), int(m.group(2))
        below = float(m.group(3)) if m.group(3) else 1.0
        if not (1 <= width <= 8 and 0 <= depths <= 16 and 0.0 < below <= 1.0):
            raise ConfigError(
                f"draft: tree={spec!r}: width must be 1..8, depths 0..16, C in (0, 1]"
            )
        return cls(width, depths, below, max(4, width))


AUTO_TREE = TreeShape(width=2, depths=2, below=0.8, frontier=4)


@dataclass(frozen=True, kw_only=True)
class DraftOptions(SpeculatorOptions):
    primary = "model"
    model: str = option(
        help="draft model directory, GGUF file or pack (another tokenizer drafts chains "
        "through text), or layers:N (the target's first N layers)"
    )
    min_confidence: float = option(
        0.0, help="stop a draft after a token whose draft probability is below this"
    )
    dtype: str | None = option(
        None,
        help="the draft's own numerics (float32, bfloat16, int8-dynamic, int4, ..., gguf: the "
        "GGUF file's own quantised weights run by llama.cpp, or gguf-q4_0: the file "
        "requantized once to Q4_0 by llama.cpp; llama.cpp drafts chains only); it cannot "
        "change the output, which the target verifies. Default on a CPU: gguf-q4_0 for a "
        "chain drafted from a GGUF file or model pack where llama-cpp-python is installed (the "
        "fastest draft measured), else kquant for a GGUF file or pack the kernel covers (its "
        "own blocks), else int4 (int8-dynamic where int4 cannot pack a layer); "
        "the target's numerics elsewhere and for a float64 target",
    )
    vocab: int | None = option(
        None,
        help="score only the N most frequent tokens in the draft's LM head (0: all); a token "
        "outside them is never drafted, which costs acceptance, never correctness. Default: "
        "32768 where the vocabulary is over twice that and a token ranking exists for the "
        "tokenizer (shipped for Qwen2.5; `specdec calibrate vocab`), else all",
    )
    length: str = option(
        "auto",
        help="how a greedy chain's length is chosen: auto (token by token: one more token while "
        "its chance of acceptance, from the draft's calibrated confidence, is worth its drafting "
        "and verification cost at the request's measured rate; up to k, default 16) or budget "
        "(the engine's adaptive budget picks a length before drafting, from acceptance by "
        "position). Sampled requests always use budget (their drafts must not depend on timing)",
    )
    tree: str = option(
        "chain",
        help="chain (one draft per depth, its length chosen by the adaptive budget), auto "
        "(branch 2-wide at the first 2 depths where the draft is unsure), WxD (W children at "
        "each node of the first D depths) or WxD@C (only where the draft's top probability "
        "is below C); trees are sized per step from the measured costs, k= caps their depth",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        TreeShape.parse(self.tree)  # a bad tree fails here, before anything loads
        if not 0.0 <= self.min_confidence < 1.0:
            raise ConfigError(f"draft: min_confidence must be in [0, 1), got {self.min_confidence}")
        if self.length not in CHAIN_LENGTHS:
            raise ConfigError(
                f"draft: length={self.length!r}: expected one of {', '.join(CHAIN_LENGTHS)}"
            )
        if self.model.startswith("layers:") and not self.model[7:].isdigit():
            raise ConfigError(f"draft: model={self.model!r}: expected layers:N with N an integer")
        if self.model.startswith("layers:") and self.dtype is not None:
            raise ConfigError(
                "draft: a layers:N draft shares the target's weights, so it runs in the "
                "target's numerics; drop dtype= or use a separate draft model"
            )
        if self.vocab is not None and self.vocab < 0:
            raise ConfigError(
                f"draft: vocab must be >= 0 (0: the full vocabulary), got {self.vocab}"
            )
        if self.model.startswith("layers:") and self.vocab:
            raise ConfigError(
                "draft: vocab= needs a separate draft model (a layers:N draft shares the "
                "target's LM head); drop vocab="
            )
        check_draft_dtype(self.dtype, chain=TreeShape.parse(self.tree) is None, vocab=self.vocab)


class _Calibration:
    """P(a drafted node is accepted | its parent was), by the draft's probability of the node's
    token, in ten bins: starts at the probability itself (a draft agreeing with its target is
    about as often right as it is confident) and follows what verification accepts. Learnt
    across requests; greedy and sampled acceptance are kept apart (they differ)."""

    BINS = 10
    PRIOR_WEIGHT = 4.0
    DECAY = 0.998

    def __init__(self) -> None:
        centre = [(i + 0.5) / self.BINS for i in range(self.BINS)]
        self.hits = [c * self.PRIOR_WEIGHT for c in centre]
        self.seen = [self.PRIOR_WEIGHT] * self.BINS

    def _bin(self, conf: float) -> int:
        return min(self.BINS - 1, max(0, int(conf * self.BINS)))

    def estimate(self, conf: float) -> float:
        b = self._bin(conf)
        return min(0.999, max(0.001, self.hits[b] / self.seen[b]))

    def update(self, conf: float, hit: bool) -> None:
        b = self._bin(conf)
        self.hits[b] = self.DECAY * self.hits[b] + (1.0 if hit else 0.0)
        self.seen[b] = self.DECAY * self.seen[b] + 1.0


@dataclass
class _Chain:
    """The last self-sized chain, until verification says how much of it was accepted."""

    tree: DraftTree
    confs: list[float]  # the draft's probability of each drafted token
    cost: float  # the step's price in target steps: verification plus draft forwards


@dataclass
class _Drafted:
    """The last tree drafted into the draft's cache, until verification says what to keep."""

    tree: DraftTree
    start: int  # cache length before the tree's nodes (the committed prefix, root included)
    slots: dict[int, int]  # node index -> cache slot, for the nodes fed to the draft
    confs: list[float]  # per node: the draft's probability of its token (root: 1)
    greedy: bool


class DraftModelSpeculator(Speculator):
    name: ClassVar[str] = "draft"
    produces_q: ClassVar[bool] = True
    drafts_by_model: ClassVar[bool] = True
    # set by the spec builder: the shared draft weights, kept alive while a speculator drafts
    loaded_draft: LoadedModel | LlamaCppDraft | None = None

    def __init__(
        self,
        runner: TokenRunner,
        description: str = "draft model",
        min_confidence: float = 0.0,
        *,
        tree: TreeShape | None = None,
        max_depth: int | None = None,
        cost_prior: float = 0.35,
        length: str = "auto",
    ) -> None:
        """``tree``: draft token trees of this shape (``None``: chains); ``max_depth`` caps a
        tree's depth or a self-sized chain's length; ``cost_prior`` is a draft forward's cost in
        target steps when none is measured (sampled requests always use it); ``length``: how a
        greedy chain is sized, ``auto`` (here, token by token) or ``budget`` (the engine's
        adaptive budget, before drafting)."""
        if length not in CHAIN_LENGTHS:
            raise ConfigError(f"length must be one of {', '.join(CHAIN_LENGTHS)}, got {length!r}")
        if not 0.0 <= min_confidence < 1.0:
            raise ConfigError(f"min_confidence must be in [0, 1), got {min_confidence}")
        self.runner = runner
        self.description = description
        self.min_confidence = min_confidence
        self.tree = tree
        if tree is not None:
            if not isinstance(runner, ModelRunner):
                raise ConfigError(
                    "draft: tree= needs a draft in torch (a llama.cpp draft drafts chains only); "
                    "use tree=chain"
                )
            if runner.cache.layout.window is not None:
                raise ConfigError(
                    "draft: tree= needs a draft model with full attention only (this one has "
                    "sliding-window layers); use tree=chain"
                )
            self.drafts_trees = True  # type: ignore[misc]  # the engine then sizes nothing
        self.max_depth = max_depth or DEFAULT_TREE_DEPTH
        self.chain_depth = max_depth or DEFAULT_CHAIN_DEPTH
        self.length = length
        self.cost_prior = cost_prior
        self._forward_seconds = 0.0  # running average of one tree-drafting forward
        self._calibration = {True: _Calibration(), False: _Calibration()}  # by greedy
        self._reset_request()

    def _reset_request(self) -> None:
        self._catch_up = 0.0
        self._drafted: _Drafted | None = None
        self._chain: _Chain | None = None
        self._alpha = 0.7  # this request's acceptance of a top draft, a moving average
        self._skipped = 0  # steps since the last tree (or self-sized chain)
        self._rate = 1.0  # committed tokens per target step over this request's drafted steps

    def reset(self) -> None:
        self.runner.reset()
        self._reset_request()

    def fork(self) -> DraftModelSpeculator:
        """Another instance for one more concurrent request: its own runner and KV cache over
        the same model weights (nothing is copied), fresh per-request state; what is learnt
        across requests (timings, the acceptance calibration) stays shared."""
        clone = copy.copy(self)
        clone.runner = self.runner.sibling()
        clone._reset_request()
        return clone

    def chain_cap(self, sampling: SamplingConfig) -> int | None:
        if self.tree is None and self.length == "auto" and sampling.greedy:
            return self.chain_depth
        return None

    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        room = self.runner.context_length - len(context.tokens) - 1
        if room < 1:  # past the draft's context (a llama.cpp draft holds 16,384): no draft
            return DraftTree.root_only(context.tokens[-1])
        budget = min(budget, room)
        if self.tree is not None:
            return self._propose_tree(context, budget)
        if not context.fixed_length and self.chain_cap(context.sampling) is not None:
            return self._propose_sized_chain(context, budget)
        tokens = context.tokens
        if budget < 1:
            return DraftTree.root_only(tokens[-1])
        logits = self._catch_up_forward(tokens)[-1]  # [V]
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

    def _propose_sized_chain(self, context: DraftContext, budget: int) -> DraftTree:
        """A greedy chain that stops itself (``length=auto``).

        After each drafted token the chain's value (the chance that every token so far is
        accepted: calibrated confidences multiplied) times the request's acceptance of a next
        token is what one more token is expected to add; it costs one draft forward plus the
        verification pass's growth by one node. Drafting goes on while that marginal yield per
        target step beats the request's own rate (committed tokens per target step over its
        drafted steps), the stopping rule that maximises a renewal process's long-run rate. A
        length chosen before drafting (the adaptive budget) cannot see that this step's draft is
        sure of six tokens or unsure of the first. Replayed on recorded answers of the
        Qwen2.5-Coder pair and then measured, it beat the adaptive budget
        (experiments/draft-policy/2026-12-04-chain-stop.md, ``chain_policy.py`` there). The
        choice reads only the draft and the costs, never the target's output, so verification
        stays lossless."""
        tokens = context.tokens
        root = tokens[-1]
        if budget < 1:
            return DraftTree.root_only(root)
        c_fwd = self._forward_cost(context)
        ratio = (context.costs or _PRIOR).ratio
        if self._skip(ratio(2) + c_fwd):
            return DraftTree.root_only(root)
        logits = self._catch_up_forward(tokens)[-1]  # [V]
        calibration = self._calibration[True]
        drafts: list[int] = []
        confs: list[float] = []
        value = 1.0
        for n in range(1, budget + 1):
            top, token = torch.softmax(logits.float(), -1).max(-1)
            conf = float(top)
            drafts.append(int(token))
            confs.append(conf)
            value *= calibration.estimate(conf)
            if n == budget or conf < self.min_confidence:
                break
            step = c_fwd + ratio(n + 2) - ratio(n + 1)  # a flat curve and a free draft: ~0
            marginal = value * self._alpha / max(step, 1e-6)
            if marginal <= self._rate:
                break
            t1 = time.perf_counter()
            logits = self.runner.forward([drafts[-1]])[-1]
            self._time_forward(time.perf_counter() - t1)
        tree = DraftTree.chain(root, drafts)
        self._chain = _Chain(tree, confs, ratio(len(drafts) + 1) + c_fwd * len(drafts))
        return tree

    def _skip(self, one_token_cost: float) -> bool:
        """Whether this step drafts nothing: a one-token draft (priced ``one_token_cost`` target
        steps, verification and forward) does not pay at this request's acceptance; a probe
        every 8 steps lets a low estimate recover."""
        if (1.0 + self._alpha) / one_token_cost <= 1.0 and self._skipped < 8:
            self._skipped += 1
            return True
        self._skipped = 0
        return False

    def pending_catch_up(self, context: DraftContext) -> int:
        """The tokens :meth:`_catch_up_forward` would read in its catch-up pass."""
        tokens = context.tokens
        keep = min(common_prefix_len(self.runner.cache.tokens, tokens), len(tokens) - 1)
        return len(tokens) - keep - 1 if len(tokens) - keep > 2 else 0

    def _catch_up_forward(self, tokens: list[int]) -> torch.Tensor:
        """The draft's logits after the committed ``tokens`` (``[1, V]``): its cache keeps the
        common prefix, and at least the last committed token is fed. A longer gap (a prompt,
        steps without drafting) is fed as one pass for all but the last token, which then goes
        alone: that pass is the catch-up, and the last token times a draft forward. Without the
        split a draft whose prior cost said "too dear" was never timed after a skip (every
        probe fed a gap), so it never learnt it was cheap and stopped drafting for good."""
        self._include_context(tokens)
        cache = self.runner.cache
        keep = min(common_prefix_len(cache.tokens, tokens), len(tokens) - 1)
        cache.rollback(keep)
        catch_up = 0.0
        if len(tokens) - keep > 2:
            t0 = time.perf_counter()
            self.runner.forward(tokens[keep:-1], logits_to_keep=1)
            catch_up = time.perf_counter() - t0
            keep = len(tokens) - 1
        t0 = time.perf_counter()
        logits = self.runner.forward(tokens[keep:], logits_to_keep=1)[-1:]  # [1, V]
        seconds = time.perf_counter() - t0
        self._catch_up = catch_up
        self._time_forward(seconds)
        return logits

    def _include_context(self, tokens: list[int]) -> None:
        """A reduced-vocabulary head (``vocab=``) also scores the request's own tokens."""
        if not isinstance(self.runner, ModelRunner):
            return
        head = self.runner.model.get_output_embeddings()
        if isinstance(head, SubsetHead):
            head.include(tokens)  # a set difference over the context: cheap (docs/methods.md)

    # -- trees ---------------------------------------------------------------------------------
    def _forward_cost(self, context: DraftContext) -> float:
        """One draft forward in target steps T(1): measured for greedy requests, the prior for
        sampled ones (their drafts must not depend on timing)."""
        costs = context.costs
        if (
            context.sampling.greedy
            and costs is not None
            and costs.unit
            and self._forward_seconds > 0.0
        ):
            return self._forward_seconds / costs.unit
        return self.cost_prior

    def _settle(self) -> None:
        """Drop a tree verification never reported on (no :meth:`observe`) from the cache."""
        if self._drafted is not None:
            self.runner.cache.rollback(self._drafted.start)
            self._drafted = None

    def _propose_tree(self, context: DraftContext, budget: int) -> DraftTree:
        shape = self.tree
        assert shape is not None
        tokens = context.tokens
        root = tokens[-1]
        self._settle()
        max_nodes = min(budget, MAX_TREE_NODES)
        if max_nodes < 1:
            return DraftTree.root_only(root)
        greedy = context.sampling.greedy
        c_fwd = self._forward_cost(context)
        ratio = (context.costs or _PRIOR).ratio

        def verify(n: int, chain: bool) -> float:  # T(n)/T(1), root included
            return ratio(n, tree=not chain)  # a chain verifies on the causal fast path

        if self._skip(verify(2, True) + c_fwd):
            return DraftTree.root_only(root)
        logits = self._catch_up_forward(tokens)  # [1, V]
        cache = self.runner.cache
        start = len(cache)  # == len(tokens): the root is the last committed slot
        calibration = self._calibration[greedy]
        toks, parents, depths = [root], [-1], [0]
        values, confs = [1.0], [1.0]
        rows: list[torch.Tensor | None] = [None]
        slots: dict[int, int] = {0: start - 1}
        frontier = [0]  # nodes whose children the draft has scored, in `logits` row order
        forwards = 1
        chain = True  # no node has two children (yet)
        for depth in range(1, self.max_depth + 1):
            new: list[int] = []
            for row, f in enumerate(frontier):
                room = max_nodes - (len(toks) - 1)
                if room <= 0:
                    break
                sampling = _SOFTMAX if greedy else context.sampling
                q = probs_from_logits(logits[row : row + 1], sampling)[0]  # [V]
                top = float(q.max())
                width = shape.width if depth - 1 < shape.depths and top < shape.below else 1
                width = min(width, room)
                children = self._children(q, width, greedy, context)
                chain = chain and len(children) == 1 and len(frontier) == 1
                for token, conf, q_row in children:
                    toks.append(token)
                    parents.append(f)
                    depths.append(depth)
                    confs.append(conf)
                    values.append(values[f] * calibration.estimate(conf))
                    rows.append(q_row)
                    new.append(len(toks) - 1)
            if not new or depth == self.max_depth or len(toks) - 1 >= max_nodes:
                break
            # One more forward pays when the children it adds raise expected tokens per step.
            expand = sorted(new, key=lambda i: -values[i])[: shape.frontier]
            gain = sum(values[1:])
            now = (1.0 + gain) / (verify(len(toks), chain) + c_fwd * forwards)
            extra = sum(values[i] for i in expand) * self._alpha
            size = len(toks) + len(expand)
            nxt = (1.0 + gain + extra) / (verify(size, chain) + c_fwd * (forwards + 1))
            if nxt <= now:
                break
            expand.sort()
            t1 = time.perf_counter()
            logits = self._forward_nodes(expand, toks, parents, depths, slots, start)
            self._time_forward(time.perf_counter() - t1)
            forwards += 1
            frontier = expand
        keep_nodes = list(range(len(toks)))
        if greedy:  # the output cannot depend on the drafts: keep the prefix that pays best
            keep_nodes = _best_prefix(values, lambda n: verify(n, chain) + c_fwd * forwards)
        tree, index = _subtree(keep_nodes, toks, parents, rows, greedy)
        self._drafted = _Drafted(
            tree,
            start,
            {index[i]: s for i, s in slots.items() if i in index},
            [confs[i] for i in keep_nodes],
            greedy,
        )
        return tree

    def _children(
        self, q: torch.Tensor, width: int, greedy: bool, context: DraftContext
    ) -> list[tuple[int, float, torch.Tensor | None]]:
        """``width`` children from the draft distribution q [V]: its top tokens (greedy), or
        draws without replacement, each with the renormalised q it was drawn from."""
        if greedy:
            top = torch.topk(q, width)
            ids, confs = top.indices.tolist(), top.values.tolist()
            return [(int(t), float(c), None) for t, c in zip(ids, confs, strict=True)]
        out: list[tuple[int, float, torch.Tensor | None]] = []
        row = q
        for _ in range(width):
            token = sample(row, context.generator)
            out.append((token, float(q[token]), row))
            rest = row.clone()
            rest[token] = 0.0
            total = float(rest.sum())
            if total <= 0.0:
                break
            row = rest / total
        return out

    def _forward_nodes(
        self,
        nodes: list[int],
        toks: list[int],
        parents: list[int],
        depths: list[int],
        slots: dict[int, int],
        start: int,
    ) -> torch.Tensor:
        """Feed ``nodes`` to the draft in one pass: each sees the committed prefix and its own
        ancestors among the tree nodes already cached, none of its siblings.  # [T, V]"""
        runner = self._tree_runner()
        cache = runner.cache
        length = len(cache)
        device = runner.device
        positions = torch.tensor([start - 1 + depths[i] for i in nodes], device=device)
        n = len(nodes)
        masks = attention_masks(
            cache.layout, length, positions, torch.eye(n, dtype=torch.bool, device=device)
        )
        assert masks is not None
        seen = torch.zeros(n, length - start, dtype=torch.bool)  # [T, tree slots cached]
        for r, i in enumerate(nodes):
            a = parents[i]
            while a > 0:
                seen[r, slots[a] - start] = True
                a = parents[a]
        seen = seen.to(device)
        for m in masks.values() if isinstance(masks, dict) else (masks,):
            m[0, 0, :, start:length] = seen
        ids = torch.tensor([[toks[i] for i in nodes]], dtype=torch.long, device=device)
        with torch.inference_mode():
            out = runner.model(
                input_ids=ids,
                position_ids=positions[None],
                attention_mask=masks,
                use_cache=True,
                **{runner.cache_keyword: cache.hf},
            )
        cache.appended([toks[i] for i in nodes])
        for r, i in enumerate(nodes):
            slots[i] = length + r
        return out.logits[0]

    def _tree_runner(self) -> ModelRunner:
        """The torch runner trees are drafted with (``__init__`` refuses trees on any other)."""
        runner = self.runner
        assert isinstance(runner, ModelRunner)
        return runner

    def _time_forward(self, seconds: float) -> None:
        old = self._forward_seconds
        self._forward_seconds = seconds if old == 0.0 else 0.8 * old + 0.2 * seconds

    def observe(self, feedback: Feedback) -> None:
        chain, self._chain = self._chain, None
        if chain is not None and feedback.tree is chain.tree:
            accepted = feedback.acceptance.num_accepted
            calibration = self._calibration[True]
            for i, conf in enumerate(chain.confs[: accepted + 1]):  # the tokens verification tested
                hit = i < accepted
                calibration.update(conf, hit)
                if i == 0:
                    self._alpha = 0.8 * self._alpha + 0.2 * (1.0 if hit else 0.0)
            self._rate = 0.9 * self._rate + 0.1 * (accepted + 1) / chain.cost
        drafted, self._drafted = self._drafted, None
        if drafted is None:
            return
        cache = self._tree_runner().cache
        tree, path = feedback.tree, feedback.acceptance.path
        if tree is not drafted.tree:  # not the tree drafted last: keep nothing of it
            cache.rollback(drafted.start)
            return
        on_path = set(path)
        calibration = self._calibration[drafted.greedy]
        for i in range(1, len(tree)):
            if tree.parents[i] in on_path:  # verification tested this node
                hit = i in on_path
                calibration.update(drafted.confs[i], hit)
                if i == tree.children[tree.parents[i]][0]:  # the first child: the top draft
                    self._alpha = 0.8 * self._alpha + 0.2 * (1.0 if hit else 0.0)
        # keep the accepted nodes the draft has cached (a prefix of the path), drop the rest
        kept = []
        for i in path[1:]:
            if i not in drafted.slots:
                break
            kept.append(drafted.slots[i] - drafted.start)
        cache.commit(drafted.start, kept)

    def catch_up_seconds(self) -> float:
        return self._catch_up

    def _confident(self, logits: torch.Tensor) -> bool:  # logits [V]
        if self.min_confidence <= 0.0:
            return True
        return float(torch.softmax(logits.float(), -1).max()) >= self.min_confidence


_SOFTMAX = SamplingConfig(temperature=1.0)  # a greedy draft's confidence: plain softmax


def _best_prefix(values: list[float], cost: Callable[[int], float]) -> list[int]:
    """The root and the ``n`` most likely nodes (an ancestor-closed set: a child's value is
    below its parent's) maximising expected tokens ``1 + sum(values)`` per ``cost(n + 1)``.

    >>> _best_prefix([1.0, 0.9, 0.1, 0.8], lambda n: 1.0 + 0.2 * (n - 1))
    [0, 1, 3]
    """
    order = sorted(range(1, len(values)), key=lambda i: (-values[i], i))
    best_n, best_rate, gain = 0, 0.0, 0.0
    for n, i in enumerate(order, start=1):
        gain += values[i]
        rate = (1.0 + gain) / cost(n + 1)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return sorted([0, *order[:best_n]])


def _subtree(
    keep: list[int],
    toks: list[int],
    parents: list[int],
    rows: list[torch.Tensor | None],
    greedy: bool,
) -> tuple[DraftTree, dict[int, int]]:
    """The DraftTree of the nodes ``keep`` (ascending, ancestor-closed) and old -> new index."""
    index = {old: new for new, old in enumerate(keep)}
    draft_probs = None
    if not greedy:
        template = next(r for r in rows if r is not None)
        draft_probs = torch.stack(
            [torch.zeros_like(template) if (row := rows[i]) is None else row for i in keep]
        )  # [N, V]
    tree = DraftTree(
        tokens=tuple(toks[i] for i in keep),
        parents=tuple(-1 if i == 0 else index[parents[i]] for i in keep),
        draft_probs=draft_probs,
    )
    return tree, index


DEFAULT_DRAFT_VOCAB = 32_768


def default_draft_vocab(draft: LoadedModel) -> int:
    """``vocab=`` when none is asked for: 32768 for a vocabulary over twice that whose tokenizer
    has a ranking, else 0 (the full head). On the Qwen2.5-Coder pair (151,936 tokens) it made a
    drafted token cheaper at the same τ and the chain faster on most prompts (docs/methods.md,
    the draft model; experiments/draft-model/2026-12-03-draft-vocab.md). A small vocabulary's
    head is a small share of the draft, so the trade stops paying there."""
    from specdec.speculators.draft_vocab import load_ranking

    size = int(draft.model.config.vocab_size)
    if size <= 2 * DEFAULT_DRAFT_VOCAB or load_ranking(draft.tokenizer) is None:
        return 0
    return DEFAULT_DRAFT_VOCAB


@register("draft", DraftOptions)
def _build(
    target: LoadedModel, options: DraftOptions
) -> DraftModelSpeculator | CrossVocabSpeculator:
    """a smaller model drafts a chain or tree over its own KV cache (another tokenizer: chains)

    A draft whose tokenizer differs from the target's drafts chains through text
    (:mod:`specdec.speculators.cross_vocab`)."""
    spec = options.model
    shape = TreeShape.parse(options.tree)
    target_params = target.parameter_count()
    if spec.startswith("layers:"):
        n = int(spec.split(":", 1)[1])
        model = early_exit_model(target.model, n)
        layers = int(getattr(target.model.config, "num_hidden_layers", n) or n)
        return DraftModelSpeculator(
            ModelRunner(model),
            f"first {n} layers of the target",
            options.min_confidence,
            tree=shape,
            max_depth=options.k,
            cost_prior=min(1.0, n / layers),
            length=options.length,
        )
    draft = load_draft(
        spec, options.dtype, target, chain=shape is None, vocab=options.vocab, any_vocabulary=True
    )
    if (note := draft_vocabulary_mismatch(target, draft)) is not None:  # drafts through text
        vocab = options.vocab
        if vocab is None:
            vocab = 0 if isinstance(draft, LlamaCppDraft) else default_draft_vocab(draft)
        return build_cross_vocab(
            target,
            draft,
            note=note,
            min_confidence=options.min_confidence,
            vocab=vocab,
            tree=shape is not None,
        )
    if isinstance(draft, LlamaCppDraft):
        speculator = DraftModelSpeculator(
            draft.runner,
            draft.description,
            options.min_confidence,
            max_depth=options.k,
            cost_prior=draft.cost_prior(target),
            length=options.length,
        )
        speculator.loaded_draft = draft  # keeps the weights alive
        return speculator
    model = draft.model
    vocab_size = int(draft.model.config.vocab_size)
    vocab = options.vocab if options.vocab is not None else default_draft_vocab(draft)
    if vocab and vocab < vocab_size:
        from specdec.speculators.draft_vocab import draft_vocabulary, with_subset_head

        keep = {*draft.tokenizer.all_special_ids, *draft.eos_token_ids, *target.eos_token_ids}
        ids = draft_vocabulary(draft.tokenizer, vocab, vocab_size, keep)
        model = with_subset_head(draft.model, ids, draft.dtype_name)
    runner = ModelRunner(model)
    draft_params = draft.parameter_count()
    speculator = DraftModelSpeculator(
        runner,
        f"draft model {draft.source}",
        options.min_confidence,
        tree=shape,
        max_depth=options.k,
        # a forward's cost in target steps, before one is timed: memory-bound decoding reads
        # every weight once, so the parameter ratio (0.32 for Qwen2.5-Coder 0.5B/1.5B)
        cost_prior=min(1.0, draft_params / max(1, target_params)),
        length=options.length,
    )
    speculator.loaded_draft = draft  # keeps the shared weights alive (_LOADED)
    return speculator
