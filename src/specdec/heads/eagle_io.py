"""EAGLE checkpoint formats: what we write so that vLLM serves our drafters, and what we read.

Written (:func:`save_eagle`): ``config.json`` + ``model.safetensors`` in the ``speculators`` layout
that vLLM loads. Read (:func:`load_eagle`): that layout (ours or anyone's), the EAGLE authors'
EAGLE-1/2 checkpoints and their EAGLE-3 checkpoints.

Format facts, checked against the sources (vllm-project/speculators at v0.7.0,
``src/speculators/config.py``, ``models/eagle3/{config,core}.py``, ``proposals/greedy.py``,
``convert/eagle/eagle3_converter.py``; vllm-project/vllm
``vllm/transformers_utils/config.py``, ``configs/speculators/{base,algos}.py``,
``configs/eagle.py``, ``model_executor/models/llama_eagle3.py``, ``llama_eagle.py``, ``llama.py``;
SafeAILab/EAGLE ``eagle/model/{cnets,cnets1,ea_model,modeling_llama_kv}.py``):

* vLLM treats a directory as a speculators checkpoint when ``config.json`` has a
  ``speculators_config`` and *no top-level* ``model_type``. ``vllm serve DIR`` then serves
  ``speculators_config.verifier.name_or_path`` as the target, with method
  ``speculators_model_type`` and ``num_speculative_tokens`` from
  ``proposal_methods[0].speculative_tokens``; the drafter's Hugging Face config is
  ``transformer_layer_config`` plus ``draft_vocab_size``, ``target_hidden_size``,
  ``norm_before_residual`` (read as **true when absent**, so we always write it) and
  ``eagle_aux_hidden_state_layer_ids``.
* EAGLE-3 weights: ``fc.weight`` (no bias; vLLM's Llama drafter fuses exactly three target
  layers), ``layers.0.{input_layernorm,hidden_norm,self_attn.*,mlp.*,post_attention_layernorm}``,
  ``norm.weight``, ``lm_head.weight`` ``[draft_vocab, H]``, ``d2t`` (int64 ``[draft_vocab]``),
  ``t2d`` (bool ``[V]``). The EAGLE authors name the layer ``midlayer.*``; vLLM renames it.
* Token maps: ``target_id = draft_id + d2t[draft_id]`` (our :class:`EagleHead`); vLLM loads ``d2t``
  as ``draft_id_to_target_id`` and scatters draft logits to ``arange(draft_vocab) + d2t``, and
  skips ``t2d``; the EAGLE authors build ``d2t[i] = used[i] - i`` and ``t2d[j] = j in used``: one
  convention everywhere. Without ``d2t`` vLLM maps draft ids to themselves (full vocabulary).
* Embeddings: vLLM (``llama_eagle3.py``) shares the target's ``embed_tokens`` unless the
  checkpoint has its own, so we write them only when the drafter's width differs from the
  target's (then the target's cannot be used). The LM head of EAGLE-1 is always the target's.
* Auxiliary layers: vLLM collects the residual stream *entering* decoder layer ``i`` (its
  ``llama.py``), the EAGLE authors the hidden state before layer ``i`` for ``i`` in
  ``(2, L // 2, L - 3)`` (``modeling_llama_kv.py``): both are Hugging Face ``hidden_states[i]``,
  our ``aux_layers``. vLLM can collect ``0..L-1`` only.
* EAGLE-1: the ``speculators`` library removed its EAGLE-1 model and vLLM its
  ``speculators_model_type: "eagle"`` reader in 2026; vLLM serves EAGLE-1 with
  ``"method": "eagle"`` from the EAGLE authors' layout: a Llama ``config.json``
  (``architectures: ["LlamaForCausalLM"]``, which vLLM turns into ``EagleLlamaForCausalLM``) and
  ``fc.weight``, ``layers.0.*`` without layer 0's ``input_layernorm``. So an EAGLE-1 export is that
  layout, with the speculators keys alongside (``speculators_model_type: "eagle"``,
  ``layernorms``, ``fusion_bias``) for readers that still know them; the top-level
  ``model_type: "llama"`` keeps vLLM on its Llama path. vLLM's EAGLE-1 ``fc`` has no bias.

Our own fields (the whole :class:`EagleConfig`, including ``variant``, ``aux_layers``, the target
identity and ``fc_bias``) live under the ``"specdec"`` key, which vLLM ignores, so a round trip
is exact.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from specdec.errors import CheckpointError
from specdec.heads.eagle import EagleConfig, EagleHead, default_aux_layers, layer_config_from
from specdec.heads.state_io import load_checked, read_safetensors, read_torch_state
from specdec.target.loading import LoadedModel, identity_mismatch
from specdec.target.numerics import dense_weight

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TORCH_WEIGHTS = "pytorch_model.bin"  # the EAGLE authors' older checkpoints
OURS = "specdec"
SPECULATORS_VERSION = "0.7.0"  # the speculators release whose format this follows
_MODEL_TYPE = {"eagle1": "eagle", "eagle3": "eagle3"}
_EMBED = "embed_tokens.weight"


# -- saving ------------------------------------------------------------------------------------
def save_eagle(
    head: EagleHead,
    out_dir: str | os.PathLike[str],
    *,
    verifier_name_or_path: str,
    verifier_architectures: list[str],
    extra: dict[str, Any] | None = None,
) -> None:
    """Write ``head`` so that vLLM serves it and :func:`load_eagle` restores it exactly.

    ``verifier_name_or_path`` is what vLLM will load as the target when given only this
    directory (a hub id such as ``HuggingFaceTB/SmolLM2-135M-Instruct`` or a path on the serving
    machine), not necessarily where specdec found it. ``extra`` (training statistics, ...) is
    kept under ``config.json["specdec"]["extra"]``, out of vLLM's way.
    """
    cfg = head.config
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    if cfg.variant == "eagle3" and cfg.hidden_size != cfg.target_hidden_size:
        # the target's embeddings are another width: the drafter carries its own
        embed = head.embed_weight
        assert isinstance(embed, torch.Tensor)
        state[_EMBED] = embed.detach().cpu().contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    document = export_config(
        cfg,
        verifier_name_or_path=verifier_name_or_path,
        verifier_architectures=verifier_architectures,
    )
    document[OURS] = {"config": asdict(cfg), "extra": dict(extra or {})}
    # weights first, config last: a directory with a config always has its weights
    tmp = out / (WEIGHTS + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / WEIGHTS)
    tmp = out / (CONFIG + ".tmp")
    tmp.write_text(json.dumps(document, indent=2) + "\n")
    os.replace(tmp, out / CONFIG)


def export_config(
    cfg: EagleConfig, *, verifier_name_or_path: str, verifier_architectures: list[str]
) -> dict[str, Any]:
    """The ``config.json`` vLLM reads, without our ``specdec`` key (see the module docstring
    for where each field comes from)."""
    layer = dict(cfg.layer)
    layer["model_type"] = "llama"
    layer["num_hidden_layers"] = 1
    layer["tie_word_embeddings"] = False  # a drafter's head is never its embedding matrix
    rope = layer.get("rope_parameters")
    if (
        isinstance(rope, dict)
        and rope.get("rope_type", "default") == "default"
        and "rope_theta" in rope
    ):
        layer.setdefault("rope_theta", rope["rope_theta"])  # for transformers 4 readers
    speculators = {
        "algorithm": _MODEL_TYPE[cfg.variant],
        "default_proposal_method": "greedy",
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": cfg.speculative_tokens,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "verifier": {
            "name_or_path": verifier_name_or_path,
            "architectures": list(verifier_architectures),
        },
    }
    common = {
        "speculators_model_type": _MODEL_TYPE[cfg.variant],
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": speculators,
        "transformer_layer_config": layer,
    }
    if cfg.variant == "eagle3":
        return {
            "architectures": ["Eagle3Speculator"],
            **common,
            "draft_vocab_size": cfg.out_size,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),
            "norm_before_residual": False,  # our layer keeps the fused feature un-normed
            "norm_before_fc": False,
            "fc_norm": False,
            "norm_output": False,
        }
    return {
        **layer,  # the EAGLE authors' Llama config, which vLLM's "eagle" method reads
        "architectures": ["LlamaForCausalLM"],
        "bias": cfg.fc_bias,  # the EAGLE authors' loader reads fc's bias from here
        **common,
        "layernorms": False,
        "fusion_bias": cfg.fc_bias,
    }


def vllm_incompatibilities(cfg: EagleConfig) -> list[str]:
    """What stops vLLM from serving a drafter of this shape (empty when it can); our engine
    runs all of them. The CLI prints these when exporting."""
    problems = []
    if cfg.fc_bias:
        problems.append("vLLM's EAGLE drafters have a bias-free fc layer; this one has a bias")
    if cfg.variant == "eagle3":
        if len(cfg.aux_layers) != 3:
            problems.append(
                f"vLLM's EAGLE-3 drafter fuses exactly 3 target layers; this one reads "
                f"{len(cfg.aux_layers)}"
            )
        num_layers = cfg.target.get("num_hidden_layers")
        if isinstance(num_layers, int) and any(i >= num_layers for i in cfg.aux_layers):
            problems.append(
                f"vLLM collects the hidden states entering layers 0..{num_layers - 1}; aux "
                f"layers {list(cfg.aux_layers)} include the final output"
            )
    return problems


# -- loading -----------------------------------------------------------------------------------
def load_eagle(path: str | os.PathLike[str], loaded: LoadedModel) -> EagleHead:
    """Read a drafter for ``loaded`` from our/speculators format, or the EAGLE authors' EAGLE-1/2
    or EAGLE-3 layout, refusing one made for another model with an error that says why."""
    d = Path(path)
    if not d.is_dir():
        raise CheckpointError(
            f"EAGLE checkpoint {str(d)!r} does not exist; train one with `specdec train eagle`"
        )
    raw = _read_config(d)
    where = d / CONFIG
    if OURS in raw:
        config = _config_from_ours(raw[OURS], where)
        state = _read_weights(d)
    elif "speculators_model_type" in raw:
        config, state = _from_speculators(raw, d, loaded, where)
    else:
        config, state = _from_eagle_authors(raw, _read_weights(d), loaded, where)
    check_fits(config, loaded)
    return _build(config, state, loaded, d)


def check_fits(config: EagleConfig, loaded: LoadedModel) -> None:
    """Refuse a drafter whose shapes, feature layers or recorded identity are another model's:
    run anyway, it would draft garbage (or crash deep in a forward pass)."""
    tcfg = loaded.config
    hidden, vocab = int(tcfg.hidden_size), int(tcfg.vocab_size)
    num_layers = int(tcfg.num_hidden_layers)
    hint = "it was made for another model; train one for this target with `specdec train eagle`"
    if config.vocab_size != vocab:
        raise CheckpointError(
            f"the EAGLE drafter's vocabulary has {config.vocab_size} tokens, the target's "
            f"{vocab}: {hint}"
        )
    if config.target_hidden_size != hidden or (
        config.variant == "eagle1" and config.hidden_size != hidden
    ):
        raise CheckpointError(
            f"the EAGLE drafter reads features of hidden size {config.target_hidden_size}, the "
            f"target's hidden size is {hidden}: {hint}"
        )
    if config.variant == "eagle3":
        bad = [i for i in config.aux_layers if not 0 <= i <= num_layers]
        if bad:
            raise CheckpointError(
                f"the EAGLE-3 drafter reads aux layer ids {list(config.aux_layers)}; ids {bad} are "
                f"out of range for the target's {num_layers} layers (valid: 0..{num_layers}): "
                f"{hint}"
            )
    if config.target:
        mismatch = identity_mismatch(config.target, loaded.identity())
        if mismatch is not None:
            raise CheckpointError(f"the EAGLE drafter was trained for another model ({mismatch})")


def _read_config(d: Path) -> dict[str, Any]:
    path = d / CONFIG
    if not path.is_file():
        raise CheckpointError(f"{d} has no {CONFIG}; it is not an EAGLE checkpoint")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return raw


def _read_weights(d: Path) -> dict[str, torch.Tensor]:
    st, pt = d / WEIGHTS, d / TORCH_WEIGHTS
    if st.is_file():
        return read_safetensors(st)
    if pt.is_file():
        return read_torch_state(pt)
    raise CheckpointError(f"{d} has no weights ({WEIGHTS} or {TORCH_WEIGHTS})")


def _make_config(where: Path, **fields: Any) -> EagleConfig:
    try:
        return EagleConfig(**fields)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from e
    except (TypeError, ValueError) as e:  # ConfigError is a ValueError: an unknown variant
        raise CheckpointError(f"{where} is not a valid EAGLE config: {e}") from e


def _config_from_ours(block: Any, where: Path) -> EagleConfig:
    cfg = block.get("config") if isinstance(block, dict) else None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{where}: the specdec entry has no config object")
    fields = {k: cfg[k] for k in EagleConfig.__dataclass_fields__ if k in cfg}
    return _make_config(where, **fields)


def _layer_dict(raw: dict[str, Any], where: Path) -> dict[str, Any]:
    """A Llama layer config (ours, speculators' ``transformer_layer_config`` or the EAGLE
    authors' top level) in the drafter's terms; legacy RoPE keys are normalised by
    ``LlamaConfig``."""
    if raw.get("num_hidden_layers", 1) != 1:
        raise CheckpointError(
            f"{where}: the drafter has {raw['num_hidden_layers']} decoder layers; specdec's "
            "EAGLE drafters have exactly one"
        )
    model_type = raw.get("model_type", "llama")
    if model_type != "llama":
        raise CheckpointError(
            f"{where}: the drafter's decoder layer is model_type {model_type!r}; specdec's "
            "EAGLE layer is Llama-style (model_type 'llama')"
        )
    keep = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "auto_map")}
    try:
        return layer_config_from(LlamaConfig(**keep))
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{where}: cannot read the decoder layer's config: {e}") from e


def _proposal_length(raw: dict[str, Any]) -> int:
    try:
        return int(raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        return 5


def _from_speculators(
    raw: dict[str, Any], d: Path, loaded: LoadedModel, where: Path
) -> tuple[EagleConfig, dict[str, torch.Tensor]]:
    mtype = raw["speculators_model_type"]
    if mtype not in ("eagle3", "eagle"):
        raise CheckpointError(
            f"{where}: speculators_model_type {mtype!r} is not an EAGLE drafter; specdec reads "
            "'eagle3' and 'eagle' (EAGLE-1) speculators"
        )
    tlc = raw.get("transformer_layer_config")
    if not isinstance(tlc, dict):
        raise CheckpointError(f"{where} has no transformer_layer_config object")
    layer = _layer_dict(tlc, where)
    state = _read_weights(d)  # after the config: a wrong type is named before missing files
    if mtype == "eagle":
        if raw.get("layernorms", False):
            raise CheckpointError(
                f"{where}: layernorms=true (the HASS variant's extra norms) is not supported"
            )
        state = _renamed(state, {"fusion_fc.": "fc.", "transformer.": "layers.0."})
        return _eagle1_config(layer, where, "fc.bias" in state, _proposal_length(raw)), state
    # vLLM reads a missing norm_before_residual as true: so must we
    unsupported = {
        "norm_before_residual": raw.get("norm_before_residual", True),
        "norm_before_fc": raw.get("norm_before_fc", False),
        "fc_norm": raw.get("fc_norm", False),
        "norm_output": raw.get("norm_output", False),
    }
    flags = [k for k, v in unsupported.items() if v]
    if flags:
        raise CheckpointError(
            f"{where}: {', '.join(f'{k}=true' for k in flags)} is not supported; specdec's "
            "EAGLE-3 layer normalises the fused feature after taking it as the residual"
        )
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(
        int(loaded.config.num_hidden_layers)
    )
    return _eagle3_config(raw, layer, ids, state, where, _proposal_length(raw)), state


def _from_eagle_authors(
    raw: dict[str, Any], state: dict[str, torch.Tensor], loaded: LoadedModel, where: Path
) -> tuple[EagleConfig, dict[str, torch.Tensor]]:
    state = _renamed(state, {"midlayer.": "layers.0."})  # EAGLE-3's name for its layer
    if "layers.0.hidden_norm.weight" in state or "lm_head.weight" in state:
        layer = _layer_dict(raw, where)
        ids = default_aux_layers(int(loaded.config.num_hidden_layers))
        return _eagle3_config(raw, layer, ids, state, where, 5), state
    if any(k.startswith("layers.0.") for k in state) and "fc.weight" in state:
        # the authors' loader (ea_model.py) takes fc's bias from the config, default true
        fc_bias = bool(raw.get("bias", "fc.bias" in state))
        return _eagle1_config(_layer_dict(raw, where), where, fc_bias, 5), state
    raise CheckpointError(
        f"{where.parent} is neither a speculators checkpoint (speculators_model_type in "
        f"{CONFIG}) nor an EAGLE authors' checkpoint (weights fc.weight with layers.0.* for "
        "EAGLE-1/2, midlayer.* for EAGLE-3)"
    )


def _eagle1_config(
    layer: dict[str, Any], where: Path, fc_bias: bool, speculative_tokens: int
) -> EagleConfig:
    return _make_config(
        where,
        variant="eagle1",
        layer=layer,
        vocab_size=int(layer["vocab_size"]),
        target_hidden_size=int(layer["hidden_size"]),
        speculative_tokens=speculative_tokens,
        fc_bias=fc_bias,
    )


def _eagle3_config(
    raw: dict[str, Any],
    layer: dict[str, Any],
    ids: Any,
    state: dict[str, torch.Tensor],
    where: Path,
    speculative_tokens: int,
) -> EagleConfig:
    vocab = int(layer["vocab_size"])
    draft = raw.get("draft_vocab_size")
    draft = vocab if draft is None else int(draft)
    d2t = state.get("d2t")
    full = draft == vocab and (d2t is None or not bool(d2t.any()))
    if full:
        # an identity map (or none) over the whole vocabulary: no map at all
        state.pop("d2t", None)
        state.pop("t2d", None)
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) for i in ids):
        raise CheckpointError(f"{where}: eagle_aux_hidden_state_layer_ids must be integers")
    return _make_config(
        where,
        variant="eagle3",
        layer=layer,
        vocab_size=vocab,
        target_hidden_size=int(raw.get("target_hidden_size") or layer["hidden_size"]),
        aux_layers=tuple(ids),
        draft_vocab_size=None if full else draft,
        speculative_tokens=speculative_tokens,
    )


def _renamed(state: dict[str, torch.Tensor], prefixes: dict[str, str]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        for old, new in prefixes.items():
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        out[key] = value
    return out


def _build(
    config: EagleConfig, state: dict[str, torch.Tensor], loaded: LoadedModel, d: Path
) -> EagleHead:
    model = loaded.model
    target_hidden = int(model.config.hidden_size)
    embed = model.get_input_embeddings().weight
    assert isinstance(embed, torch.Tensor)
    own = state.pop(_EMBED, None)  # vLLM shares the target's unless the drafter has its own
    if own is not None and tuple(own.shape) != (config.vocab_size, config.hidden_size):
        raise CheckpointError(
            f"{d}: {_EMBED} has shape {tuple(own.shape)}, the config implies "
            f"({config.vocab_size}, {config.hidden_size})"
        )
    if config.hidden_size != target_hidden:
        if own is None:
            raise CheckpointError(
                f"{d}: the drafter is {config.hidden_size} wide, the target {target_hidden}, and "
                f"the checkpoint has no {_EMBED} of its own"
            )
        embed = own
    readout = None
    if config.variant == "eagle1":
        out_embed = model.get_output_embeddings()
        if out_embed is None:
            raise CheckpointError("an EAGLE-1 drafter reads out with the target's LM head")
        readout = dense_weight(out_embed)  # [V, H]; the target's linears may be prepacked
    head = EagleHead(config, embed_tokens=embed.detach().float(), target_lm_head=readout)
    _load_state(head, state, d)
    return head


def _load_state(head: EagleHead, state: dict[str, torch.Tensor], d: Path) -> None:
    load_checked(head, state, d)  # keys and shapes first, so the maps below are well-formed
    if head.d2t is not None:
        _check_token_maps(head.d2t, head.t2d, head.config.vocab_size, d)


def _check_token_maps(d2t: torch.Tensor, t2d: torch.Tensor, vocab: int, d: Path) -> None:
    target_ids = torch.arange(len(d2t)) + d2t  # [V_draft]
    if bool((target_ids < 0).any()) or bool((target_ids >= vocab).any()):
        raise CheckpointError(f"{d}: d2t maps draft ids outside the target's {vocab} tokens")
    if len(torch.unique(target_ids)) != len(target_ids):
        raise CheckpointError(f"{d}: d2t maps two draft ids to the same target token")
    if int(t2d.sum()) != len(d2t) or not bool(t2d[target_ids].all()):
        raise CheckpointError(f"{d}: t2d does not mark exactly the target ids d2t maps to")
