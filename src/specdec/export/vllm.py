"""``specdec export vllm SPEC``: the ``vllm serve`` command (and any checkpoint it needs) that
runs one of our speculators in vLLM, for users who outgrow one machine.

Every key we emit is a field of vLLM's ``SpeculativeConfig`` and every method name a member of
its ``SpeculativeMethod`` literal, as read in vllm-project/vllm ``vllm/config/speculative.py`` at
commit ``002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443`` (``tests/test_export_vllm.py`` holds that
field list and asserts it). The checkpoint layouts were read in the same repository:
``vllm/model_executor/models/medusa.py`` (commit ``09cddad8f0324594022359cd2b07e962a14b895f``),
``vllm/transformers_utils/configs/medusa.py`` (``4bb77b3239adff81001f12cd9c9a39b65800a373``),
``vllm/v1/spec_decode/medusa.py`` and ``suffix_decoding.py`` (the V1 proposers), and
``vllm/transformers_utils/configs/speculators/base.py`` (the speculators-format loader); the
EAGLE layout itself is :mod:`specdec.heads.eagle_io`'s (its docstring cites its sources).

What maps to what, and why:

* ``prompt-lookup`` -> ``method: "ngram"``; ``max_ngram``/``min_ngram`` ->
  ``prompt_lookup_max``/``prompt_lookup_min``; K -> ``num_speculative_tokens``. Both draft
  after the longest matching n-gram, but vLLM (``v1/spec_decode/ngram_proposer.py``, a reverse
  KMP) continues its earliest occurrence, ours its latest.
* ``suffix`` -> ``method: "suffix"`` (vLLM runs Arctic Inference's implementation: the server
  needs ``pip install arctic-inference``). ``max_depth`` -> ``suffix_decoding_max_tree_depth``
  (vLLM's depth bounds match plus draft, ours the match alone), ``alpha`` ->
  ``suffix_decoding_max_spec_factor`` (drafted tokens per matched token in both),
  ``min_token_prob`` -> ``suffix_decoding_min_token_prob``, and ``min(max_spec_tokens, K)`` ->
  ``num_speculative_tokens``, which vLLM treats as the per-step maximum, as ours is. Our cache
  file, ``min_match_length`` and ``max_occurrences`` have no counterpart.
* ``draft`` -> ``method: "draft_model"`` with the draft's directory. ``layers:N`` (our early
  exit through the target's first N layers) is written out as a standalone N-layer model, the
  target's own layers, final norm and LM head: vLLM runs it as a separate model with its own
  weights and KV cache, where ours shares the target's. ``min_confidence`` (early stop) has no
  counterpart: vLLM drafts a fixed ``num_speculative_tokens``.
* ``medusa`` -> ``method: "medusa"`` with a converted checkpoint in vLLM's layout:
  ``config.json`` (``model_type: "medusa"``, ``num_heads``, ``num_hidden_layers``,
  ``truncated_vocab_size``, ``medusa_fc_bias: true`` since our residual blocks have a bias) and
  ``model.safetensors`` with ``blocks.{head}.layers.{layer}.{weight,bias}`` and
  ``lm_heads.{head}.weight`` over the full vocabulary: vLLM's loader refuses a head over fewer
  tokens, so a reduced draft vocabulary is written out in full (:func:`full_vocabulary_rows`),
  which keeps each head's top-1 token. vLLM sets ``num_heads`` to ``num_speculative_tokens``
  (``MedusaConfig.num_lookahead_tokens``), so we write exactly that many heads. It drafts a
  chain, each head's top token: our tree topology has no counterpart.
* ``eagle`` -> ``method: "eagle3"`` (EAGLE-3) or ``"eagle"`` (EAGLE-1), with the drafter
  rewritten by :func:`specdec.heads.eagle_io.save_eagle` so that its recorded verifier is the
  target the command serves. vLLM drafts a chain (this vLLM has no token-tree option): only our
  tree's depth is carried, as ``num_speculative_tokens``.

In every case ``num_speculative_tokens`` never exceeds K (``k``, default the engine's), the
most tokens our speculator drafts per step. Speculators without a counterpart (lookahead, self,
osd, auto, none, ...) raise :class:`NoVllmCounterpartError` naming why.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specdec.errors import CheckpointError, ConfigError, ModelNotFoundError, UnsupportedModelError
from specdec.speculators.spec import SpeculatorOptions, parse_spec, speculator_name
from specdec.target.base import backend_for
from specdec.target.checkpoints import resolve_gguf
from specdec.target.loading import (
    DEFAULT_GGUF_NAME,
    DEFAULT_MODEL_HUB_ID,
    LoadedModel,
    convert_gguf,
    load_model,
)
from specdec.target.numerics import NUMERICS
from specdec.target.packs import PACKS, is_pack

VLLM_SOURCE = (
    "vllm-project/vllm vllm/config/speculative.py @ 002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443"
)
MEDUSA_WEIGHTS = "model.safetensors"
CONFIG = "config.json"
EXPORT_MARK = "vllm"  # config.json["specdec"]["export"] of a directory this module wrote


_GENERIC = "no vLLM counterpart"


class NoVllmCounterpartError(ConfigError):
    """The speculator (or this form of it) has no counterpart among vLLM's methods."""


# why each of ours that vLLM lacks has none, in the words the error uses
_NO_COUNTERPART = {
    "none": "it is plain decoding: run `vllm serve TARGET` without --speculative-config",
    "lookahead": "vLLM has no Jacobi / lookahead decoding (n-grams from parallel guesses); "
    "prompt-lookup exports as vLLM's ngram method",
    "self": "vLLM has no layer-skipping self-speculation over the target's own weights; "
    "draft:model=layers:N exports an early-exit draft as a separate draft model",
    "osd": "vLLM's drafters do not keep learning from the requests they serve; export the "
    "heads' starting checkpoint with medusa:DIR",
    "auto": "vLLM runs one speculative method per server, chosen at start; export one arm",
}


@dataclass(frozen=True)
class VllmExport:
    """What ``specdec export vllm`` says: the target vLLM serves, the ``--speculative-config``
    object, the files it wrote, and what of our options did not carry over (and why)."""

    target: str
    speculative_config: dict[str, Any]
    written: tuple[Path, ...] = ()
    not_carried: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    # vLLM's own flags for the target: the --dtype matching the numerics specdec verified with
    serve_args: tuple[str, ...] = ()

    @property
    def command(self) -> str:
        """The shell command, quoted so it pastes as it is."""
        config = json.dumps(self.speculative_config)
        words = ["vllm", "serve", self.target, *self.serve_args, "--speculative-config", config]
        return shlex.join(words)

    def as_dict(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "target": self.target,
            "serve_args": list(self.serve_args),
            "speculative_config": self.speculative_config,
            "written": [str(p) for p in self.written],
            "not_carried": list(self.not_carried),
            "notes": list(self.notes),
        }


@dataclass
class LocalTarget:
    """The target as specdec has it here (``--model`` / ``--gguf``), loaded only by the exports
    that check a checkpoint against it or write one from it."""

    model: Path | None = None
    gguf: Path | None = None
    dtype: str = "float32"
    loader: Callable[[], LoadedModel] | None = None  # the CLI's, which announces a conversion
    _loaded: LoadedModel | None = field(default=None, init=False, repr=False)

    def load(self) -> LoadedModel:
        if self._loaded is None:
            if self.loader is not None:
                self._loaded = self.loader()
            else:
                self._loaded = load_model(self.model, gguf=self.gguf, dtype=self.dtype)
        return self._loaded

    def hf_dir(self) -> Path:
        """A Hugging Face directory of the target: the model directory itself, or for a GGUF
        file, a model pack or the bundled model the directory specdec converts it into."""
        gguf, model = resolve_gguf(self.model, self.gguf)
        return convert_gguf(gguf) if gguf is not None else Path(model or "")


def default_target_name(
    model: Path | str | None, gguf: Path | None, hf_dir: Path | None = None
) -> tuple[str, str]:
    """The name vLLM loads the target by, with a note on what it is.

    A model directory is passed as it is. A GGUF file, a model pack or the bundled model is
    passed as the safetensors directory specdec converts it into (``hf_dir``, converted here
    when not given): every tensor under its own name, ``architectures``, the tokenizer and its
    chat template, so vLLM serves the very weights specdec's ``float32`` target verifies with.
    vLLM does not run the GGUF's own quantised blocks on a CPU; the Hub model a file was made
    from is named as the alternative, with its other weights."""
    if model is not None and not is_pack(model):
        path = str(Path(model).resolve())
        return path, (
            f"target {path} is a path on this machine; on a server elsewhere pass --target with "
            "its Hub id or its path there"
        )
    local = LocalTarget(Path(model) if model is not None else None, gguf)
    directory = hf_dir if hf_dir is not None else local.hf_dir()
    if model is not None:
        made_from: str | None = PACKS[str(model)].hub_id
        what = f"model pack {model}"
    else:
        bundled = gguf is None or gguf.name == DEFAULT_GGUF_NAME
        made_from = DEFAULT_MODEL_HUB_ID if bundled else None
        what = "the bundled GGUF" if gguf is None else f"GGUF file {gguf}"
    note = (
        f"target {directory} is {what} dequantised by specdec (every tensor, architectures, "
        "tokenizer, chat template): the weights specdec verifies in float32, at a path on this "
        "machine (copy it to a server elsewhere)"
    )
    if made_from is not None:
        note += (
            f"; --target {made_from} serves the Hub model the file was made from instead, "
            "whose unquantised weights give other outputs"
        )
    return str(directory), note


def vllm_dtype(dtype: str) -> tuple[str, str | None]:
    """The ``--dtype`` vLLM serves the target in for a target specdec verifies in ``dtype``,
    with a note where vLLM cannot compute the same numbers. Without the flag vLLM serves
    bfloat16, whose greedy output is no longer the float32 model's."""
    backend_for(dtype)  # an unknown dtype fails here, naming the choices
    numerics = NUMERICS.get(dtype)
    if numerics is not None and numerics.reference:
        return "float32", (
            f"vLLM has no {dtype}: it serves float32, the nearest; greedy outputs can differ "
            "where the two round a near-tie differently"
        )
    if numerics is not None and numerics.storage_dtype == torch.bfloat16:
        return "bfloat16", None
    if numerics is not None and numerics.exact:
        return "float32", None
    return "float32", (
        f"specdec verifies --dtype {dtype} with weights vLLM's CPU build does not run; vLLM "
        "serves the dequantised weights in float32, whose greedy output is specdec's "
        "--dtype float32 output, not this one's"
    )


def engine_default_k() -> int:
    """The engine's K, which ``k=None`` stands for (the decoder's own default, so it cannot
    drift)."""
    from specdec.decode.step import DEFAULT_NUM_DRAFT_TOKENS

    return DEFAULT_NUM_DRAFT_TOKENS


def export_vllm(
    spec: str | SpeculatorOptions,
    *,
    target: str,
    local: LocalTarget | None = None,
    out: Path | None = None,
) -> VllmExport:
    """The vLLM counterpart of ``spec`` serving ``target``, writing a checkpoint under ``out``
    where vLLM needs one (default: next to the source checkpoint, ``NAME-vllm``)."""
    options = parse_spec(spec)
    name = speculator_name(options)
    exporter = _EXPORTERS.get(name)
    if exporter is None:
        reason = _NO_COUNTERPART.get(name, "none of vLLM's speculative methods does what it does")
        raise NoVllmCounterpartError(
            f"speculator {name!r} has no vLLM counterpart: {reason}. Exportable: "
            f"{', '.join(sorted(_EXPORTERS))}"
        )
    local = local or LocalTarget()
    result = exporter(options, target, local, out)
    notes = list(result.notes)
    if out is not None and not result.written:
        notes.append(f"--out {out} is unused: vLLM's {result.method} method needs no checkpoint")
    mapped = _MAPPED[name]
    not_carried = [
        f"{f.name}={getattr(options, f.name)!r}: {result.reasons.get(f.name, _GENERIC)}"
        for f in dataclasses.fields(options)
        if f.name not in mapped or f.name in result.reasons
    ]
    dtype, dtype_note = vllm_dtype(local.dtype)
    if dtype_note is not None:
        notes.append(dtype_note)
    return VllmExport(
        target=target,
        speculative_config=result.config,
        written=tuple(result.written),
        not_carried=tuple(not_carried),
        notes=tuple(notes),
        serve_args=("--dtype", dtype),
    )


@dataclass
class _Result:
    config: dict[str, Any]
    written: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # options that are mapped only in part, or not at all, with why (adds to the generic list)
    reasons: dict[str, str] = field(default_factory=dict)

    @property
    def method(self) -> str:
        return str(self.config["method"])


Exporter = Callable[[Any, str, LocalTarget, "Path | None"], _Result]


def _k(options: SpeculatorOptions) -> int:
    return options.k if options.k is not None else engine_default_k()


# -- model-free methods ------------------------------------------------------------------------
def _prompt_lookup(options: Any, target: str, local: LocalTarget, out: Path | None) -> _Result:
    config = {
        "method": "ngram",
        "num_speculative_tokens": _k(options),
        "prompt_lookup_max": options.max_ngram,
        "prompt_lookup_min": options.min_ngram,
    }
    note = (
        "vLLM drafts what followed the earliest occurrence of the longest match, specdec what "
        "followed the latest"
    )
    return _Result(config, notes=[note])


_SUFFIX_REASONS = {
    "cache": "vLLM's global suffix cache lives in the server's memory (bounded in requests by "
    "suffix_decoding_max_cached_requests) and cannot load our cache file",
    "min_match_length": "vLLM (Arctic Inference) has no minimum match length",
    "max_occurrences": "Arctic Inference counts every occurrence; no sampling cap",
}


def _suffix(options: Any, target: str, local: LocalTarget, out: Path | None) -> _Result:
    config = {
        "method": "suffix",
        "num_speculative_tokens": min(options.max_spec_tokens, _k(options)),
        "suffix_decoding_max_tree_depth": options.max_depth,
        "suffix_decoding_max_spec_factor": float(options.alpha),
        "suffix_decoding_min_token_prob": float(options.min_token_prob),
    }
    notes = [
        "vLLM's suffix method runs Arctic Inference: install the version vLLM asks for on the "
        "server (`pip install arctic-inference==0.1.1`); it ships as source only, and on vLLM's "
        "CPU build it must be built against the installed torch (docs/vllm.md gives the steps)",
        "suffix_decoding_max_tree_depth bounds match plus draft length in vLLM, the matched "
        "context alone in specdec",
    ]
    return _Result(config, notes=notes, reasons=dict(_SUFFIX_REASONS))


# -- draft model -------------------------------------------------------------------------------
def _draft(options: Any, target: str, local: LocalTarget, out: Path | None) -> _Result:
    spec = str(options.model)
    reasons = {
        "min_confidence": "vLLM's draft model always drafts num_speculative_tokens tokens; it "
        "has no early stop on draft confidence",
        "length": "vLLM's draft model drafts num_speculative_tokens every step; our chain that "
        "stops itself token by token (length=auto) and the adaptive budget have no counterpart",
        "dtype": "vLLM runs the draft in the serving dtype (its --dtype), not one of its own",
        "tree": "vLLM's draft model drafts a chain of num_speculative_tokens, no token trees",
        "vocab": "vLLM's draft model scores its whole vocabulary (no reduced draft head)",
    }
    config: dict[str, Any] = {"method": "draft_model", "num_speculative_tokens": _k(options)}
    if spec.startswith("layers:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise ConfigError(f"bad draft {spec!r}: expected layers:N with N an integer") from None
        dest = out if out is not None else Path.cwd() / f"draft-layers{n}-vllm"
        _write_early_exit(local.hf_dir(), n, dest)
        config["model"] = str(dest.resolve())
        note = (
            f"the draft is the target's first {n} layers, final norm and LM head, written as a "
            "standalone model: vLLM runs it with its own weights and KV cache"
        )
        return _Result(config, written=[dest], notes=[note], reasons=reasons)
    gguf = Path(spec) if spec.lower().endswith(".gguf") else None
    if is_pack(spec) and not Path(spec).exists() or gguf is not None:
        # vLLM loads a draft from a directory: the GGUF's dequantised copy, as for the target
        path = LocalTarget(None if gguf else Path(spec), gguf).hf_dir()
        note = (
            f"draft {spec} is passed as the directory specdec dequantised it into, "
            f"{path.resolve()}, a path on this machine"
        )
    else:
        path = Path(spec)
        if not (path / CONFIG).is_file():
            raise ModelNotFoundError(
                f"draft {spec!r} is not a Hugging Face model directory (no {CONFIG}), a GGUF "
                "file or a model pack; vLLM loads a draft model from a directory or a Hub id"
            )
        note = f"draft {path.resolve()} is a path on this machine; vLLM must find it at that path"
    config["model"] = str(path.resolve())
    notes = [note]
    if _other_vocabulary(local.hf_dir(), path):
        config["use_heterogeneous_vocab"] = True
        notes.append(
            "the draft's tokenizer differs from the target's: vLLM's heterogeneous-vocabulary "
            "draft (use_heterogeneous_vocab, greedy drafts) proposes only tokens both "
            "vocabularies spell the same, where specdec carries the draft's text into the "
            "target's tokens: both are lossless, their acceptance differs"
        )
    return _Result(config, notes=notes, reasons=reasons)


def _other_vocabulary(target_dir: Path, draft_dir: Path) -> bool:
    """Whether the draft's tokenizer maps other strings to ids than the target's."""
    from transformers import AutoTokenizer

    target = AutoTokenizer.from_pretrained(str(target_dir))
    draft = AutoTokenizer.from_pretrained(str(draft_dir))
    return bool(target.get_vocab() != draft.get_vocab())


def _write_early_exit(hf_dir: Path, n: int, dest: Path) -> None:
    """The target's first ``n`` decoder layers with its final norm and LM head, as a Hugging
    Face model directory with the target's tokenizer: what our ``layers:N`` draft computes."""
    from torch import nn
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_destination(dest, hf_dir)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UnsupportedModelError(
            f"{type(model).__name__} keeps no decoder.layers list; cannot cut it to {n} layers"
        )
    if not 1 <= n < len(layers):
        raise ConfigError(f"layers:N needs 1 <= N < {len(layers)} (the target's layer count)")
    decoder.layers = nn.ModuleList(list(layers)[:n])
    model.config.num_hidden_layers = n
    if isinstance(getattr(model.config, "layer_types", None), list):
        model.config.layer_types = model.config.layer_types[:n]
    model.config.specdec = {"export": EXPORT_MARK, "source": str(hf_dir), "layers": n}
    model.save_pretrained(str(dest))
    AutoTokenizer.from_pretrained(str(hf_dir)).save_pretrained(str(dest))


# -- Medusa ------------------------------------------------------------------------------------
def _medusa(options: Any, target: str, local: LocalTarget, out: Path | None) -> _Result:
    from specdec.heads.medusa import load_medusa
    from specdec.speculators.medusa import check_heads_fit

    dest = out if out is not None else _sibling(Path(options.dir))
    _check_destination(dest, Path(options.dir))
    heads = load_medusa(options.dir)
    check_heads_fit(heads, local.load())
    have = heads.config.num_heads
    n = min(have, _k(options))
    write_vllm_medusa(heads, dest, num_heads=n, source=str(options.dir))
    reasons = {
        "tree": "vLLM's Medusa drafts a chain, the top token of each head; no tree topology",
    }
    notes = []
    if n < have:
        k = f"k={options.k}" if options.k is not None else f"the engine's default K={n}"
        notes.append(
            f"{n} of the {have} heads are written: vLLM runs one head per draft token "
            f"and {k} caps them"
        )
    elif options.k is not None and options.k > have:
        notes.append(f"k={options.k} is capped at the {have} heads: vLLM drafts one per head")
    if heads.config.draft_vocab_size is not None:
        notes.append(
            f"the heads' {heads.config.draft_vocab_size}-token draft vocabulary is written out "
            f"over the full {heads.config.vocab_size} tokens, the only form vLLM's Medusa loads: "
            "each other token scores the mean of the drafted tokens' logits, never the top one, "
            "so the drafts are the same"
        )
    config = {"method": "medusa", "model": str(dest.resolve()), "num_speculative_tokens": n}
    return _Result(config, written=[dest], notes=notes, reasons=reasons)


def full_vocabulary_rows(proj: torch.Tensor, token_map: torch.Tensor, vocab: int) -> torch.Tensor:
    """A reduced vocabulary's projection ``proj`` [N, H] (row i scores target token
    ``token_map[i]``) as one over all ``vocab`` tokens, which vLLM's Medusa loader requires.
    Every other token's row is the mean of the N rows, so its logit is the mean of theirs:
    below the best drafted token's whenever they are not all equal, so the top-1 draft, which is
    what vLLM's Medusa proposes, does not change.

    >>> p = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    >>> full_vocabulary_rows(p, torch.tensor([2, 0]), 4)
    tensor([[0.0000, 1.0000],
            [0.5000, 0.5000],
            [1.0000, 0.0000],
            [0.5000, 0.5000]])
    """
    rows = proj.mean(0, keepdim=True).expand(vocab, -1).clone()
    rows[token_map.long()] = proj
    return rows


def vllm_medusa_state(heads: Any, num_heads: int) -> dict[str, torch.Tensor]:
    """Our heads' first ``num_heads`` heads under vLLM's ``Medusa`` parameter names, each
    projecting onto the full vocabulary (:func:`full_vocabulary_rows` for reduced heads)."""
    state = {}
    for i, head in enumerate(list(heads.heads)[:num_heads]):
        for j, block in enumerate(head.blocks):
            state[f"blocks.{i}.layers.{j}.weight"] = block.linear.weight
            state[f"blocks.{i}.layers.{j}.bias"] = block.linear.bias
        proj = head.proj.weight.detach()
        if heads.token_map is not None:
            proj = full_vocabulary_rows(proj, heads.token_map, heads.config.vocab_size)
        state[f"lm_heads.{i}.weight"] = proj
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


def vllm_medusa_config(heads: Any, num_heads: int, source: str = "") -> dict[str, Any]:
    """vLLM's ``MedusaConfig`` fields (no other top-level key may contain both "num" and
    "heads" or "layers": ``MedusaConfig.from_pretrained`` renames those), ours under
    ``specdec``."""
    cfg = heads.config
    return {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_heads": num_heads,
        "num_hidden_layers": cfg.num_layers,
        "truncated_vocab_size": cfg.vocab_size,  # reduced heads are written out in full
        "medusa_fc_bias": True,  # our residual blocks' linears carry a bias
        "original_lm_head": False,  # every head has its own projection
        "specdec": {"export": EXPORT_MARK, "source": source, "medusa": asdict(cfg)},
    }


def write_vllm_medusa(heads: Any, dest: Path, *, num_heads: int, source: str = "") -> None:
    """Write ``heads`` as a checkpoint vLLM's ``method: "medusa"`` loads (weights first, the
    config last, so a directory with a config always has its weights)."""
    dest.mkdir(parents=True, exist_ok=True)
    save_file(vllm_medusa_state(heads, num_heads), str(dest / MEDUSA_WEIGHTS), {"format": "pt"})
    document = vllm_medusa_config(heads, num_heads, source)
    (dest / CONFIG).write_text(json.dumps(document, indent=2) + "\n")


# -- EAGLE -------------------------------------------------------------------------------------
def _eagle(options: Any, target: str, local: LocalTarget, out: Path | None) -> _Result:
    from specdec.heads.bundled import EAGLE3_SMOLLM2, eagle_head
    from specdec.heads.eagle_io import save_eagle, vllm_incompatibilities
    from specdec.speculators.eagle import EagleTree

    if options.dir is None and out is None:  # never write beside the installed package
        raise ConfigError("exporting the shipped EAGLE-3 head needs --out DIR (where to write)")
    source = Path(options.dir) if options.dir else EAGLE3_SMOLLM2
    dest = out if out is not None else _sibling(source)
    _check_destination(dest, source)
    loaded = local.load()
    head = eagle_head(options.dir, loaded)  # checks it fits this target
    problems = vllm_incompatibilities(head.config)
    if problems:
        raise CheckpointError(f"vLLM cannot serve the EAGLE drafter {source}: {problems[0]}")
    tree = EagleTree.parse(options.tree, head.config.speculative_tokens)
    n = min(tree.depth, _k(options))
    architectures = list(getattr(loaded.config, "architectures", None) or [])
    save_eagle(
        head,
        dest,
        verifier_name_or_path=target,
        verifier_architectures=architectures or [type(loaded.model).__name__],
        extra={"export": EXPORT_MARK, "source": str(options.dir or "shipped:" + source.name)},
    )
    method = "eagle3" if head.config.variant == "eagle3" else "eagle"
    reasons = {
        "tree": f"only its depth ({tree.depth}) is carried: vLLM's EAGLE drafts a chain, the "
        f"top token per step; top-k {tree.top_k} and total {tree.total_tokens} have no "
        "counterpart",
    }
    notes = [f"the drafter's recorded verifier is {target}, the target this command serves"]
    config = {"method": method, "model": str(dest.resolve()), "num_speculative_tokens": n}
    return _Result(config, written=[dest], notes=notes, reasons=reasons)


# -- shared ------------------------------------------------------------------------------------
def _sibling(source: Path) -> Path:
    resolved = source.resolve()
    return resolved.with_name(resolved.name + "-vllm")


def _check_destination(dest: Path, source: Path | None = None) -> None:
    """Write only into a new or empty directory, or over an earlier export of ours: a typo'd
    --out must not overwrite a user's checkpoint (least of all the one being exported)."""
    if source is not None and dest.resolve() == source.resolve():
        raise ConfigError(f"--out {dest} is the checkpoint being exported; choose a new directory")
    if dest.exists() and not dest.is_dir():
        raise ConfigError(f"--out {dest} exists and is not a directory")
    if dest.is_dir() and any(dest.iterdir()) and not _is_our_export(dest):
        raise ConfigError(
            f"--out {dest} is a non-empty directory that is not an earlier `specdec export "
            "vllm`; choose a new directory"
        )


def _is_our_export(d: Path) -> bool:
    try:
        ours = json.loads((d / CONFIG).read_text()).get("specdec", {})
    except (OSError, ValueError, AttributeError):
        return False
    if not isinstance(ours, dict):
        return False
    extra = ours.get("extra")
    return EXPORT_MARK in (
        ours.get("export"),
        extra.get("export") if isinstance(extra, dict) else None,
    )


_EXPORTERS: dict[str, Exporter] = {
    "prompt-lookup": _prompt_lookup,
    "suffix": _suffix,
    "draft": _draft,
    "medusa": _medusa,
    "eagle": _eagle,
}
# our options each exporter carries over in full (the rest are listed as not carried)
_MAPPED: dict[str, frozenset[str]] = {
    "prompt-lookup": frozenset({"k", "max_ngram", "min_ngram"}),
    "suffix": frozenset({"k", "max_spec_tokens", "max_depth", "alpha", "min_token_prob"}),
    "draft": frozenset({"k", "model"}),
    "medusa": frozenset({"k", "dir"}),
    "eagle": frozenset({"k", "dir"}),
}
