"""EAGLE checkpoint formats: the speculators layout vLLM serves, the EAGLE authors' EAGLE-1/2 and
EAGLE-3 layouts, exact round trips, and every bad input — on tiny random Llama targets.

The expected field and key lists are written out here, from the sources they were read in
(see the docstring of ``specdec.heads.eagle_io``): a change to what we write must change them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.errors import CheckpointError
from specdec.heads.eagle import EagleConfig, EagleHead, layer_config_from
from specdec.heads.eagle_io import (
    check_fits,
    export_config,
    load_eagle,
    save_eagle,
    vllm_incompatibilities,
)
from specdec.target import load_model
from specdec.target.loading import LoadedModel
from specdec.target.numerics import dense_weight

HIDDEN, LAYERS, VOCAB, DRAFT_VOCAB = 32, 8, 96, 40
VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"

# vllm-project/speculators src/speculators/models/eagle3/config.py (Eagle3SpeculatorConfig),
# src/speculators/config.py (SpeculatorModelConfig); vllm-project/vllm
# vllm/transformers_utils/configs/speculators/{base,algos}.py (what vLLM reads)
EAGLE3_FIELDS = {
    "architectures",
    "speculators_model_type",
    "speculators_version",
    "speculators_config",
    "transformer_layer_config",
    "draft_vocab_size",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
}
# speculators src/speculators/config.py (SpeculatorsConfig, VerifierConfig) and
# src/speculators/proposals/greedy.py (GreedyTokenProposalConfig)
SPECULATORS_CONFIG_FIELDS = {"algorithm", "default_proposal_method", "proposal_methods", "verifier"}
GREEDY_FIELDS = {"proposal_type", "speculative_tokens", "verifier_accept_k", "accept_tolerance"}
# the decoder layer: vllm/model_executor/models/llama_eagle3.py (LlamaDecoderLayer, layer 0 reads
# 2H), SafeAILab/EAGLE eagle/model/cnets.py (LlamaDecoderLayeremb) for EAGLE-3;
# SafeAILab/EAGLE eagle/model/cnets1.py (layer 0 has no input_layernorm, fc over [emb; h]) and
# vllm/model_executor/models/llama_eagle.py (the same layer, input_layernorm removed) for EAGLE-1
LAYER_KEYS = {
    f"layers.0.{name}.weight"
    for name in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "post_attention_layernorm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
}
EAGLE3_LAYER_KEYS = LAYER_KEYS | {"layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight"}
EAGLE1_KEYS = LAYER_KEYS | {"fc.weight"}


def make_target(
    *, hidden: int = HIDDEN, layers: int = LAYERS, vocab: int = VOCAB, seed: int = 0
) -> LoadedModel:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    model = LlamaForCausalLM(cfg).eval()
    return LoadedModel(
        model=model,
        tokenizer=None,  # type: ignore[arg-type]  # the formats never tokenise
        source="tiny",
        numerics="float32",
        dtype_name="float32",
    )


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return make_target()


def make_head(
    target: LoadedModel,
    variant: str,
    *,
    draft_vocab: int | None = None,
    aux: tuple[int, ...] | None = None,
    fc_bias: bool = False,
    seed: int = 1,
) -> EagleHead:
    mcfg = target.model.config
    n = int(mcfg.num_hidden_layers)
    config = EagleConfig(
        variant=variant,
        layer=layer_config_from(mcfg),
        vocab_size=int(mcfg.vocab_size),
        target_hidden_size=int(mcfg.hidden_size),
        aux_layers=aux or ((2, n // 2, n - 3) if variant == "eagle3" else (-1,)),
        draft_vocab_size=draft_vocab,
        target=target.identity(),
        speculative_tokens=4,
        fc_bias=fc_bias,
    )
    head = EagleHead(
        config,
        embed_tokens=target.model.get_input_embeddings().weight,
        target_lm_head=dense_weight(target.model.get_output_embeddings()),
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():  # norms too: a round trip must carry every tensor
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    if draft_vocab is not None:
        head.set_vocabulary(torch.randperm(config.vocab_size, generator=gen)[:draft_vocab])
    return head


def outputs(head: EagleHead) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Next states, draft-vocabulary logits and target ids of the top draft, on fixed inputs."""
    gen = torch.Generator().manual_seed(7)
    cfg = head.config
    width = len(cfg.aux_layers) * cfg.target_hidden_size if head.eagle3 else cfg.hidden_size
    with torch.no_grad():
        state = head.fuse(torch.randn(1, 6, width, generator=gen))  # [1, T, H]
        tokens = torch.randint(0, cfg.vocab_size, (1, 6), generator=gen)
        nxt, _ = head(state, tokens, torch.arange(6)[None])
        logits = head.logits(nxt)  # [1, T, V_draft]
    return nxt, logits, head.to_target_ids(logits.argmax(-1))


def assert_same_outputs(a: EagleHead, b: EagleHead) -> None:
    for x, y in zip(outputs(a), outputs(b), strict=True):
        assert torch.equal(x, y)


def saved(head: EagleHead, out: Path) -> Path:
    save_eagle(
        head, out, verifier_name_or_path=VERIFIER, verifier_architectures=["LlamaForCausalLM"]
    )
    return out


def rounded_to_half(head: EagleHead) -> EagleHead:
    """The head as a float16 checkpoint stores it (the EAGLE authors publish float16)."""
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.half().float())
    return head


# -- what we write -----------------------------------------------------------------------------
def test_eagle3_export_has_the_speculators_fields_keys_shapes_and_dtypes(target, tmp_path):
    head = make_head(target, "eagle3", draft_vocab=DRAFT_VOCAB)
    cfg = json.loads((saved(head, tmp_path / "e3") / "config.json").read_text())
    assert set(cfg) == EAGLE3_FIELDS | {"specdec"}
    assert "model_type" not in cfg  # vLLM takes a top-level model_type over speculators_config
    assert cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["speculators_model_type"] == "eagle3"
    assert isinstance(cfg["speculators_version"], str)
    spec = cfg["speculators_config"]
    assert set(spec) == SPECULATORS_CONFIG_FIELDS
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    (proposal,) = spec["proposal_methods"]
    assert set(proposal) == GREEDY_FIELDS
    assert proposal["proposal_type"] == "greedy" and proposal["speculative_tokens"] == 4
    assert spec["verifier"] == {"name_or_path": VERIFIER, "architectures": ["LlamaForCausalLM"]}
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["target_hidden_size"] == HIDDEN
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # (2, L // 2, L - 3), L = 8
    # vLLM reads a missing norm_before_residual as true, which is not our layer
    assert cfg["norm_before_residual"] is False
    assert not (cfg["norm_before_fc"] or cfg["fc_norm"] or cfg["norm_output"])
    tlc = cfg["transformer_layer_config"]
    assert tlc["model_type"] == "llama" and tlc["num_hidden_layers"] == 1
    assert tlc["vocab_size"] == VOCAB  # the target's: vLLM scatters draft logits into it
    assert tlc["tie_word_embeddings"] is False and tlc["rope_theta"] == 10000.0
    layer = LlamaConfig(**{k: v for k, v in tlc.items() if k != "model_type"})
    assert (layer.hidden_size, layer.num_attention_heads, layer.num_key_value_heads) == (32, 4, 2)
    assert layer.head_dim == 8 and layer.intermediate_size == 64

    h, q, kv = HIDDEN, 4 * 8, 2 * 8
    shapes = {
        "fc.weight": (h, 3 * h),
        "layers.0.input_layernorm.weight": (h,),
        "layers.0.hidden_norm.weight": (h,),
        "layers.0.self_attn.q_proj.weight": (q, 2 * h),  # [norm(emb); norm(g)]
        "layers.0.self_attn.k_proj.weight": (kv, 2 * h),
        "layers.0.self_attn.v_proj.weight": (kv, 2 * h),
        "layers.0.self_attn.o_proj.weight": (h, q),
        "layers.0.post_attention_layernorm.weight": (h,),
        "layers.0.mlp.gate_proj.weight": (2 * h, h),
        "layers.0.mlp.up_proj.weight": (2 * h, h),
        "layers.0.mlp.down_proj.weight": (h, 2 * h),
        "norm.weight": (h,),
        "lm_head.weight": (DRAFT_VOCAB, h),
        "d2t": (DRAFT_VOCAB,),
        "t2d": (VOCAB,),
    }
    assert set(shapes) == EAGLE3_LAYER_KEYS | {"fc.weight", "norm.weight", "lm_head.weight"} | {
        "d2t",
        "t2d",
    }
    with safe_open(str(tmp_path / "e3" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(shapes)  # no embed_tokens: vLLM shares the target's
        for key, shape in shapes.items():
            t = f.get_tensor(key)
            assert tuple(t.shape) == shape, key
            want = {"d2t": torch.int64, "t2d": torch.bool}.get(key, torch.float32)
            assert t.dtype == want, key


def test_token_maps_follow_vllms_reading(target, tmp_path):
    """vLLM (llama_eagle3.py) scatters draft logit i to target id i + d2t[i] and ignores t2d; the
    EAGLE authors (traineagle3/cnets.py) set t2d[j] = j is in the draft vocabulary."""
    head = make_head(target, "eagle3", draft_vocab=DRAFT_VOCAB)
    state = load_file(str(saved(head, tmp_path / "maps") / "model.safetensors"))
    vllm_target_ids = torch.arange(DRAFT_VOCAB) + state["d2t"]
    assert torch.equal(vllm_target_ids, head.draft_token_ids())
    assert torch.equal(state["t2d"].nonzero().flatten(), vllm_target_ids.sort().values)


def test_eagle1_export_is_the_layout_vllms_eagle_method_reads(target, tmp_path):
    head = make_head(target, "eagle1")
    cfg = json.loads((saved(head, tmp_path / "e1") / "config.json").read_text())
    # the EAGLE authors' Llama config at the top level (vLLM turns LlamaForCausalLM into
    # EagleLlamaForCausalLM), speculators' EAGLE-1 keys alongside
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (1, HIDDEN, VOCAB)
    assert cfg["bias"] is False and cfg["fusion_bias"] is False and cfg["layernorms"] is False
    assert cfg["speculators_model_type"] == "eagle"
    assert cfg["speculators_config"]["algorithm"] == "eagle"
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    with safe_open(str(tmp_path / "e1" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == EAGLE1_KEYS  # no LM head, no embeddings: both the target's
        assert tuple(f.get_tensor("fc.weight").shape) == (HIDDEN, 2 * HIDDEN)


def test_vllm_incompatibilities_are_named(target):
    assert vllm_incompatibilities(make_head(target, "eagle3").config) == []
    assert vllm_incompatibilities(make_head(target, "eagle1").config) == []
    two = make_head(target, "eagle3", aux=(2, 4)).config
    assert any("exactly 3" in p for p in vllm_incompatibilities(two))
    last = make_head(target, "eagle3", aux=(2, 4, 8)).config
    assert any("final output" in p for p in vllm_incompatibilities(last))
    biased = make_head(target, "eagle1", fc_bias=True).config
    assert any("bias" in p for p in vllm_incompatibilities(biased))
    exported = export_config(two, verifier_name_or_path=VERIFIER, verifier_architectures=[])
    assert exported["eagle_aux_hidden_state_layer_ids"] == [2, 4]


# -- round trips -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("variant", "draft_vocab", "fc_bias"),
    [("eagle3", DRAFT_VOCAB, False), ("eagle3", None, False), ("eagle1", None, True)],
)
def test_save_load_round_trip_gives_identical_outputs(
    target, tmp_path, variant, draft_vocab, fc_bias
):
    head = make_head(target, variant, draft_vocab=draft_vocab, fc_bias=fc_bias)
    save_eagle(
        head,
        tmp_path / "rt",
        verifier_name_or_path=VERIFIER,
        verifier_architectures=["LlamaForCausalLM"],
        extra={"held_out_tau": 2.5},
    )
    back = load_eagle(tmp_path / "rt", target)
    assert back.config == head.config
    assert_same_outputs(head, back)
    cfg = json.loads((tmp_path / "rt" / "config.json").read_text())
    assert cfg["specdec"]["extra"] == {"held_out_tau": 2.5}
    if draft_vocab is not None:
        assert back.d2t is not None and back.d2t.dtype == torch.int64
        assert back.t2d.dtype == torch.bool


def test_round_trip_on_a_loaded_target_with_prepacked_linears(tiny_model_dir, tmp_path):
    """The real loading path swaps the target's linears for prepacked modules; the EAGLE-1
    readout must still be the target's own LM head."""
    tiny = load_model(tiny_model_dir)
    head = make_head(tiny, "eagle1")
    back = load_eagle(saved(head, tmp_path / "real"), tiny)
    assert_same_outputs(head, back)
    assert torch.allclose(back.readout, dense_weight(tiny.model.get_output_embeddings()))


def test_a_narrower_eagle3_drafter_carries_its_own_embeddings(target, tmp_path):
    """The target's embeddings are another width, so the export must include the drafter's own
    (vLLM's llama_eagle3.py loads embed_tokens when the checkpoint has them)."""
    mcfg = target.model.config
    layer = {**layer_config_from(mcfg), "hidden_size": 16, "intermediate_size": 32, "head_dim": 4}
    config = EagleConfig(
        variant="eagle3",
        layer=layer,
        vocab_size=VOCAB,
        target_hidden_size=HIDDEN,
        aux_layers=(2, 4, 5),
        target=target.identity(),
    )
    head = EagleHead(config, embed_tokens=torch.randn(VOCAB, 16))
    d = saved(head, tmp_path / "narrow")
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        assert tuple(f.get_tensor("embed_tokens.weight").shape) == (VOCAB, 16)
    assert json.loads((d / "config.json").read_text())["target_hidden_size"] == HIDDEN
    assert_same_outputs(head, load_eagle(d, target))
    edit_weights(d, lambda s: s.pop("embed_tokens.weight"))
    with pytest.raises(CheckpointError, match="no embed_tokens.weight of its own"):
        load_eagle(d, target)


def test_a_speculators_checkpoint_from_elsewhere_loads(target, tmp_path):
    """Without our specdec key everything comes from the speculators fields."""
    head = make_head(target, "eagle3", draft_vocab=DRAFT_VOCAB)
    d = saved(head, tmp_path / "foreign")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["specdec"]
    (d / "config.json").write_text(json.dumps(cfg))
    back = load_eagle(d, target)
    assert back.config.aux_layers == head.config.aux_layers
    assert back.config.speculative_tokens == 4 and back.config.target == {}
    assert_same_outputs(head, back)


def test_speculators_eagle1_names_load(target, tmp_path):
    """speculators' former EAGLE-1 model named the fusion layer fusion_fc and the decoder layer
    transformer (speculators convert/eagle/eagle_converter.py, removed in 2026)."""
    head = make_head(target, "eagle1")
    d = saved(head, tmp_path / "old")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["specdec"]
    (d / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(d / "model.safetensors"))
    renamed = {
        k.replace("fc.", "fusion_fc.", 1)
        if k.startswith("fc.")
        else k.replace("layers.0.", "transformer.", 1): v
        for k, v in state.items()
    }
    save_file(renamed, str(d / "model.safetensors"))
    assert_same_outputs(head, load_eagle(d, target))


# -- the EAGLE authors' layouts ----------------------------------------------------------------
def authors_llama_config(target: LoadedModel, **extra: object) -> dict:
    """A config.json as SafeAILab/EAGLE publishes it: the target's Llama config with one layer
    (eagle/train/*_config.json, eagle/traineagle3/config.json)."""
    cfg = target.model.config.to_dict()
    cfg.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"], torch_dtype="float16")
    cfg.update(extra)
    return cfg


def test_eagle_authors_eagle1_checkpoint_loads(target, tmp_path):
    """EAGLE-1/2 (eagle/model/cnets1.py, ea_model.py): pytorch_model.bin in float16 with fc.weight,
    fc.bias (config "bias", default true), layers.0.* and the target's embed_tokens.weight."""
    head = rounded_to_half(make_head(target, "eagle1", fc_bias=True))
    d = tmp_path / "eagle1-authors"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(authors_llama_config(target, bias=True)))
    state = {k: v.half() for k, v in head.state_dict().items()}
    state["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().half()
    assert set(state) == EAGLE1_KEYS | {"fc.bias", "embed_tokens.weight"}
    torch.save(state, d / "pytorch_model.bin")
    back = load_eagle(d, target)
    assert back.config.variant == "eagle1" and back.config.fc_bias
    assert_same_outputs(head, back)


def test_eagle_authors_eagle3_checkpoint_loads(target, tmp_path):
    """EAGLE-3 (eagle/model/cnets.py): midlayer.*, fc (no bias), norm, lm_head over the draft
    vocabulary, d2t, t2d; config with draft_vocab_size; features from layers (2, L//2, L-3)."""
    head = rounded_to_half(make_head(target, "eagle3", draft_vocab=DRAFT_VOCAB))
    d = tmp_path / "eagle3-authors"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(authors_llama_config(target, draft_vocab_size=DRAFT_VOCAB))
    )
    state = {
        k.replace("layers.0.", "midlayer.", 1): v if k in ("d2t", "t2d") else v.bfloat16()
        for k, v in head.state_dict().items()
    }
    assert {k for k in state if k.startswith("midlayer.")} == {
        k.replace("layers.0.", "midlayer.") for k in EAGLE3_LAYER_KEYS
    }
    save_file(state, str(d / "model.safetensors"))
    back = load_eagle(d, target)
    assert back.config.aux_layers == (2, 4, 5) and back.config.draft_vocab_size == DRAFT_VOCAB
    with torch.no_grad():  # bfloat16 rounding of the reference, then the outputs match exactly
        for p in head.parameters():
            p.copy_(p.bfloat16().float())
    assert_same_outputs(head, back)


# -- bad input ---------------------------------------------------------------------------------
def edit_config(d: Path, change) -> None:
    cfg = json.loads((d / "config.json").read_text())
    change(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def edit_weights(d: Path, change) -> None:
    state = load_file(str(d / "model.safetensors"))
    change(state)
    save_file(state, str(d / "model.safetensors"))


@pytest.fixture(scope="module")
def good(target, tmp_path_factory) -> Path:
    return saved(
        make_head(target, "eagle3", draft_vocab=DRAFT_VOCAB), tmp_path_factory.mktemp("good")
    )


def copy_of(good: Path, tmp_path: Path) -> Path:
    d = tmp_path / "copy"
    d.mkdir()
    for f in good.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    return d


def test_missing_and_corrupt_files(target, good, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_eagle(tmp_path / "none", target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_eagle(tmp_path / "empty", target)
    d = copy_of(good, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="has no weights"):
        load_eagle(d, target)
    (d / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:200])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_eagle(d, target)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_eagle(d, target)


def test_truncated_pytorch_bin(target, tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(authors_llama_config(target)))
    torch.save(make_head(target, "eagle1").state_dict(), d / "pytorch_model.bin")
    (d / "pytorch_model.bin").write_bytes((d / "pytorch_model.bin").read_bytes()[:300])
    with pytest.raises(CheckpointError, match="pytorch_model.bin .truncated or corrupt"):
        load_eagle(d, target)


def test_missing_unexpected_and_misshapen_weights(target, good, tmp_path):
    d = copy_of(good, tmp_path)
    edit_weights(d, lambda s: s.pop("layers.0.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing \['layers.0.mlp.up_proj.weight'\]"):
        load_eagle(d, target)
    (d / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    edit_weights(d, lambda s: s.update({"extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected \['extra.weight'\]"):
        load_eagle(d, target)
    (d / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    edit_weights(d, lambda s: s.update({"norm.weight": torch.zeros(HIDDEN + 1)}))
    with pytest.raises(CheckpointError, match=r"norm.weight has shape \(33,\)"):
        load_eagle(d, target)
    (d / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    edit_weights(d, lambda s: s.update({"d2t": s["d2t"] + VOCAB}))
    with pytest.raises(CheckpointError, match="d2t maps draft ids outside"):
        load_eagle(d, target)


def test_a_drafter_for_another_target_is_refused(good):
    with pytest.raises(CheckpointError, match="hidden size 32, the target's hidden size is 48"):
        load_eagle(good, make_target(hidden=48))
    with pytest.raises(CheckpointError, match="vocabulary has 96 tokens, the target's 80"):
        load_eagle(good, make_target(vocab=80))
    with pytest.raises(CheckpointError, match=r"ids \[5\] are out of range .* 4 layers"):
        load_eagle(good, make_target(layers=4))
    with pytest.raises(CheckpointError, match="trained for another model .*embedding_sha256"):
        load_eagle(good, make_target(seed=5))


def test_check_fits_on_a_hand_built_config(target):
    cfg = make_head(target, "eagle3").config
    check_fits(cfg, target)
    bad = EagleConfig(**{**cfg.__dict__, "aux_layers": (-1, 2, 3)})
    with pytest.raises(CheckpointError, match=r"ids \[-1\] are out of range"):
        check_fits(bad, target)


def test_unknown_variant_model_type_and_unsupported_variants(target, good, tmp_path):
    d = copy_of(good, tmp_path)
    edit_config(d, lambda c: c["specdec"]["config"].update(variant="eagle9"))
    with pytest.raises(CheckpointError, match="unknown EAGLE variant 'eagle9'"):
        load_eagle(d, target)
    (d / "config.json").write_text((good / "config.json").read_text())
    edit_config(d, lambda c: c.pop("specdec"))
    foreign = (d / "config.json").read_text()
    edit_config(d, lambda c: c.update(speculators_model_type="dflash"))
    with pytest.raises(CheckpointError, match="'dflash' is not an EAGLE drafter"):
        load_eagle(d, target)
    (d / "config.json").write_text(foreign)
    edit_config(d, lambda c: c.pop("norm_before_residual"))  # vLLM reads it as true
    with pytest.raises(CheckpointError, match="norm_before_residual=true is not supported"):
        load_eagle(d, target)
    (d / "config.json").write_text(foreign)
    edit_config(d, lambda c: c["transformer_layer_config"].update(num_hidden_layers=2))
    with pytest.raises(CheckpointError, match="2 decoder layers.*exactly one"):
        load_eagle(d, target)
    (d / "config.json").write_text(foreign)
    edit_config(d, lambda c: c["transformer_layer_config"].update(model_type="qwen3"))
    with pytest.raises(CheckpointError, match="model_type 'qwen3'"):
        load_eagle(d, target)
    (d / "config.json").write_text(json.dumps({"hidden_size": HIDDEN}))
    save_file({"proj.weight": torch.zeros(2, 2)}, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="neither a speculators checkpoint"):
        load_eagle(d, target)
