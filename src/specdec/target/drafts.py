"""Which backend a draft model runs on, and loading it there: the policy behind
``draft:MODEL[,dtype=...]`` (:mod:`specdec.speculators.draft_model` keeps the speculator).

A draft's numerics cannot change the output (the target verifies every drafted token), only
how often it is accepted and what it costs, so the draft runs in whatever is fastest: llama.cpp
from its GGUF file requantized to Q4_0 where it can (a chain drafted from a GGUF file or pack
for a CPU target, llama-cpp-python installed), else in torch: a GGUF file's own blocks through
specdec's kernel (``kquant``) where it covers the file, else ``int4``; a float64 target is an
exactness reference and keeps its numerics for its draft, and off the CPU the draft runs in the
target's numerics.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.errors import ConfigError, ModelNotFoundError, VocabularyMismatchError
from specdec.target import llamacpp
from specdec.target.backends import KQUANT, backend_for
from specdec.target.backends.llamacpp import DEFAULT_DRAFT_DTYPE, parse_draft_dtype
from specdec.target.backends.lowbit import ANY_SHAPE, INT4
from specdec.target.base import LoadedModel, ModelSource
from specdec.target.checkpoints import gguf_tokenizer
from specdec.target.llamacpp import LlamaCppRunner, LlamaModel
from specdec.target.loading import load_named
from specdec.target.packs import is_pack, pack_gguf

log = logging.getLogger(__name__)


def check_draft_dtype(dtype: str | None, *, chain: bool, vocab: int | None) -> None:
    """Refuse, before anything loads, a draft ``dtype`` that is unknown or that its other
    options rule out (llama.cpp drafts chains with the GGUF's own head)."""
    in_llamacpp, requant = parse_draft_dtype(dtype)
    if in_llamacpp:
        if requant is not None and requant not in llamacpp.REQUANT_TYPES:
            raise ConfigError(
                f"draft: dtype={dtype} is not a llama.cpp draft numerics; use gguf (the "
                "file as it is) or "
                + ", ".join(f"gguf-{kind}" for kind in sorted(llamacpp.REQUANT_TYPES))
            )
        if not chain:
            raise ConfigError(
                f"draft: dtype={dtype} (llama.cpp) drafts chains only; use tree=chain, "
                "or drop dtype= to draft trees in torch"
            )
        if vocab:
            raise ConfigError(
                "draft: vocab= reduces a torch draft's LM head; llama.cpp scores the GGUF's "
                "own head: drop vocab= with dtype=gguf"
            )
    elif dtype is not None:
        backend_for(dtype)  # an unknown name fails here, before anything loads


def vocabulary_mismatch(
    target: LoadedModel, tokenizer: object, d_size: int, source: str
) -> str | None:
    """How a draft's vocabulary differs from the target's (``None``: it does not), for a note
    or an error: a draft whose token ids mean other strings cannot draft ids directly."""
    t_vocab, d_vocab = target.tokenizer.get_vocab(), tokenizer.get_vocab()  # type: ignore[attr-defined]
    if t_vocab != d_vocab:
        diff = len(set(t_vocab.items()) ^ set(d_vocab.items()))
        return (
            f"the draft's tokenizer ({source}, {len(d_vocab)} tokens) differs from the "
            f"target's ({target.source}, {len(t_vocab)} tokens) in {diff} entries"
        )
    t_size = target.config.vocab_size
    if t_size != d_size:
        return f"the draft's output layer has {d_size} logits, the target's {t_size}"
    return None


def check_vocabulary(target: LoadedModel, tokenizer: object, d_size: int, source: str) -> None:
    """A draft whose token ids mean other strings would be verified against the wrong text."""
    mismatch = vocabulary_mismatch(target, tokenizer, d_size, source)
    if mismatch is not None:
        raise VocabularyMismatchError(f"{mismatch}; a draft must use the target's vocabulary")


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """:func:`check_vocabulary` for a draft loaded in torch."""
    check_vocabulary(target, draft.tokenizer, int(draft.config.vocab_size), draft.source)


def draft_vocabulary_mismatch(
    target: LoadedModel, draft: LoadedModel | LlamaCppDraft
) -> str | None:
    """:func:`vocabulary_mismatch` for a loaded draft (torch or llama.cpp)."""
    if isinstance(draft, LlamaCppDraft):
        tokenizer = gguf_tokenizer(draft.source)
        return vocabulary_mismatch(target, tokenizer, draft.runner.vocab_size, str(draft.source))
    return vocabulary_mismatch(target, draft.tokenizer, int(draft.config.vocab_size), draft.source)


def default_draft_dtype(target: LoadedModel) -> str:
    """The draft's numerics in torch when none is asked for: the fastest measured, since the
    draft's rounding cannot reach the output (every drafted token is verified by the target).

    On a CPU that is ``int4`` (weight-only, group 32), on both kinds of CPU measured (AVX-512
    with VNNI/AMX, and AVX2 only): a drafted token of the Qwen2.5-Coder 0.5B costs a fraction
    of its fp32 cost, and less than in weight-only ``int8``, whose faster single projection on
    AVX2 (a weight hot in cache) does not survive a whole forward (docs/methods.md, the draft
    model; docs/lowbit.md; experiments/draft-model/2026-12-03-draft-vocab.md).
    ``int8-dynamic`` takes any shape, so it is the fallback for a draft whose linears int4
    cannot pack. A ``float64`` target is an exactness reference, so its draft stays float64;
    off the CPU there are no low-bit kernels and the draft runs in the target's numerics.
    """
    if target.device.type != "cpu" or target.backend.is_reference(target.dtype_name):
        return target.dtype_name
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):  # an older torch build
        return target.dtype_name
    return INT4


# Draft models already loaded, by (spec, dtype, device), for as long as a speculator holds one:
# a benchmark's chain, tree and auto arm (or a server's methods) share one copy of the weights,
# each with its own runner and KV cache (what fork() does too). The weights are never written.
_LOADED: weakref.WeakValueDictionary[tuple[str, str, str], LoadedModel] = (
    weakref.WeakValueDictionary()
)


def _load_shared(spec: str, dtype: str, device: torch.device) -> LoadedModel:
    key = (spec, dtype, str(device))
    loaded = _LOADED.get(key)
    if loaded is None:
        loaded = load_named(spec, dtype=dtype, device=device)
        _LOADED[key] = loaded
    return loaded


def load_torch_draft(
    spec: str, dtype: str | None, target: LoadedModel, *, any_vocabulary: bool = False
) -> LoadedModel:
    """The draft model ``spec`` in torch, in ``dtype`` or by default :func:`default_draft_dtype`
    (``int8-dynamic`` where int4 cannot pack a layer), on the target's device, its vocabulary
    checked against the target's (unless ``any_vocabulary``: a draft through text); shared with
    other speculators holding the same draft."""
    if dtype is not None:
        draft = _load_shared(spec, dtype, target.device)
    else:
        dtype = default_draft_dtype(target)
        if dtype == INT4 and _runs_own_blocks(spec):
            dtype = KQUANT.name
        try:
            draft = _load_shared(spec, dtype, target.device)
        except ConfigError as error:
            if dtype != INT4 or "cannot quantise" not in str(error):
                raise
            # a linear int4 cannot pack (its shape): int8-dynamic takes any shape
            draft = _load_shared(spec, ANY_SHAPE, target.device)
    if not any_vocabulary:
        check_same_vocabulary(target, draft)
    return draft


def _names_gguf(spec: str) -> bool:
    """Whether a draft spec names a GGUF file (a ``.gguf`` path or a pack alias that is not a
    local directory)."""
    return (is_pack(spec) and not Path(spec).exists()) or spec.lower().endswith(".gguf")


def _runs_own_blocks(spec: str) -> bool:
    """Whether a draft ``spec`` is a GGUF file or pack whose own blocks specdec's kernel runs on
    this CPU (``kquant``): then a torch draft (a tree, ``vocab=``) runs them rather than
    rounding them again to ``int4``; a drafted token of the Qwen2.5-Coder 0.5B costs less there
    at one row and at four (experiments/draft-model/2026-12-07-kquant-draft.md)."""
    from specdec.target.loading import choose_dtype

    if not _names_gguf(spec):
        return False
    is_file = spec.lower().endswith(".gguf")
    source = ModelSource(gguf=spec) if is_file else ModelSource(model=spec)
    try:
        return choose_dtype(source)[0] == KQUANT.name
    except (ConfigError, ModelNotFoundError):
        return False  # the loader names what is wrong with the file


def draft_gguf_path(spec: str) -> Path:
    """The GGUF file behind a draft spec: a pack alias (assembled on first use) or a ``.gguf``
    path; a model directory has none (its weights are safetensors)."""
    if is_pack(spec) and not Path(spec).exists():
        return pack_gguf(spec)
    path = Path(spec)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"draft GGUF file {spec!r} does not exist")
        return path
    raise ConfigError(
        f"draft: dtype=gguf runs the draft's GGUF file in llama.cpp, and {spec!r} is not a GGUF "
        "file or a model pack alias (e.g. qwen2.5-coder-0.5b); drop dtype=gguf for a model "
        "directory"
    )


def llamacpp_by_default(spec: str, target: LoadedModel, *, chain: bool, vocab: int | None) -> bool:
    """Whether a draft with no ``dtype=`` runs in llama.cpp (requantized to Q4_0): a chain
    drafted from a GGUF file (or a pack) for a CPU target, where llama-cpp-python is installed.
    On the Qwen2.5-Coder pair a drafted token cost far less there than in torch's int4 kernels,
    and the pair ran faster on every prompt measured
    (experiments/draft-model/2026-12-04-llamacpp-draft.md); requantized to Q4_0 the draft
    decodes faster again with the same acceptance
    (experiments/draft-model/2026-12-05-draft-requant.md). Trees need 4D masks and stay in
    torch; a float64 target is an exactness reference and keeps a float64 draft."""
    return (
        _names_gguf(spec)
        and chain
        and not vocab
        and target.device.type == "cpu"
        and not target.backend.is_reference(target.dtype_name)
        and llamacpp.available()
    )


# llama.cpp draft models by GGUF path: a benchmark's or server's draft arms share one copy of
# the weights, each request its own context (KV cache).
_LLAMA_MODELS: weakref.WeakValueDictionary[str, LlamaModel] = weakref.WeakValueDictionary()


@dataclass
class LlamaCppDraft:
    """A draft run by llama.cpp: its runner (one request's context), the file it was loaded
    from and what it runs (the requantized copy, or the file itself)."""

    runner: LlamaCppRunner
    source: Path  # the draft's own GGUF file
    gguf: Path  # what llama.cpp runs: ``source`` or its requantized copy
    requant: str | None  # the requantization, or None: the file as it is

    @property
    def description(self) -> str:
        how = "" if self.requant is None else f", requantized to {self.requant.upper()}"
        return f"draft model {self.source.name} (llama.cpp{how})"

    def cost_prior(self, target: LoadedModel) -> float:
        """A forward's cost in target steps before one is timed: memory-bound decoding reads
        every weight once, so the file's bytes against the target's."""
        return min(1.0, self.gguf.stat().st_size / max(1, target.weight_bytes()))


def load_llamacpp_draft(
    spec: str,
    target: LoadedModel,
    requant: str | None = None,
    fall_back: bool = False,
    *,
    any_vocabulary: bool = False,
) -> LlamaCppDraft:
    """A chain drafter run by llama.cpp from the draft's GGUF file, requantized to ``requant``
    when given; with ``fall_back`` (the default numerics, which the user did not ask for) a
    requantization that fails (a full disk, an unwritable cache) runs the file as it is."""
    if not llamacpp.available():  # checked first: a model loaded earlier would hide it
        raise ConfigError(llamacpp.INSTALL_HINT)
    if target.device.type != "cpu":
        raise ConfigError(
            "draft: dtype=gguf runs the draft on the CPU with llama.cpp; with a target on "
            f"{target.device} drop dtype=gguf (the draft then runs beside it)"
        )
    source = draft_gguf_path(spec)
    gguf = source
    if requant is not None:
        try:
            gguf = llamacpp.requantized(source, requant)
        except (OSError, ConfigError) as e:
            if not fall_back:
                raise
            log.warning("drafting from %s as it is: requantizing it failed (%s)", source.name, e)
            requant = None
    model = _LLAMA_MODELS.get(str(gguf))
    if model is None:
        model = LlamaModel(gguf)
        _LLAMA_MODELS[str(gguf)] = model
    if not any_vocabulary:
        check_vocabulary(target, gguf_tokenizer(source), model.vocab_size, str(source))
    return LlamaCppDraft(LlamaCppRunner(model), source, gguf, requant)


def load_draft(
    spec: str,
    dtype: str | None,
    target: LoadedModel,
    *,
    chain: bool,
    vocab: int | None,
    any_vocabulary: bool = False,
) -> LoadedModel | LlamaCppDraft:
    """The draft ``spec`` loaded on the backend its ``dtype`` names, or by default the fastest
    (see the module's docstring): a torch model (the speculator may still reduce its LM head,
    ``vocab=``), or a llama.cpp runner. ``any_vocabulary``: a draft with another tokenizer is
    loaded too (the caller drafts through text), not refused."""
    in_llamacpp, requant = parse_draft_dtype(dtype)
    by_default = dtype is None and llamacpp_by_default(spec, target, chain=chain, vocab=vocab)
    if by_default:
        in_llamacpp, requant = parse_draft_dtype(DEFAULT_DRAFT_DTYPE)
    if in_llamacpp:
        return load_llamacpp_draft(
            spec, target, requant, fall_back=by_default, any_vocabulary=any_vocabulary
        )
    return load_torch_draft(spec, dtype, target, any_vocabulary=any_vocabulary)
