"""``specdec export vllm SPEC``: the command's keys and method names are vLLM's, the checkpoints
it writes are the layouts vLLM loads (Medusa's computed the way vLLM computes it), and what has
no counterpart is refused in one line. Runs the real CLI on tiny random-weight models.

vLLM cannot be installed here, so its names are written out below, as read in its source.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from specdec.cli.main import app
from specdec.heads.eagle_io import load_eagle, save_eagle
from specdec.heads.medusa import MedusaConfig, MedusaHeads
from specdec.speculators.spec import parse_spec
from specdec.target import load_model
from specdec.target.early_exit import early_exit_model
from specdec.target.loading import DEFAULT_MODEL_HUB_ID, LoadedModel
from tests.test_eagle_format import make_head

# Every field of class SpeculativeConfig in vllm-project/vllm vllm/config/speculative.py at
# commit 002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443 (read with the read_file tool, in source order).
VLLM_SOURCE = (
    "vllm-project/vllm vllm/config/speculative.py @ 002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443"
)
VLLM_SPECULATIVE_CONFIG_FIELDS = frozenset(
    {
        "enforce_eager",
        "num_speculative_tokens",
        "model",
        "method",
        "draft_tensor_parallel_size",
        "tensor_parallel_size",
        "quantization",
        "moe_backend",
        "attention_backend",
        "kv_cache_dtype",
        "max_model_len",
        "revision",
        "code_revision",
        "index_share_for_mtp_iteration",
        "disable_padded_drafter_batch",
        "disable_eagle_block_drop",
        "use_local_argmax_reduction",
        "use_heterogeneous_vocab",
        "prompt_lookup_max",
        "prompt_lookup_min",
        "parallel_drafting",
        "target_model_config",
        "target_parallel_config",
        "num_speculative_tokens_per_batch_size",
        "draft_model_config",
        "draft_parallel_config",
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
        "draft_load_config",
        "rejection_sample_method",
        "synthetic_acceptance_rates",
        "synthetic_acceptance_length",
        "enable_adaptive_verification",
        "draft_sample_method",
        "dspark_draft_topk",
    }
)
# "required configuration params passed from engine" / "params generated in the post-init stage"
VLLM_INTERNAL_FIELDS = frozenset(
    {"target_model_config", "target_parallel_config", "draft_model_config", "draft_parallel_config"}
)
# SpeculativeMethod = Literal["ngram", "medusa", "mlp_speculator", "draft_model", "suffix",
# "custom_class", EagleModelTypes, NgramGPUTypes, DSparkModelTypes], same file and commit
VLLM_MTP_MODEL_TYPES = frozenset(
    {
        "deepseek_mtp",
        "dots3_note_mtp",
        "mimo_mtp",
        "mimo_v2_mtp",
        "glm4_moe_mtp",
        "glm4_moe_lite_mtp",
        "glm_ocr_mtp",
        "ernie_mtp",
        "nemotron_h_mtp",
        "exaone_moe_mtp",
        "exaone4_5_mtp",
        "qwen3_next_mtp",
        "qwen4_exp_mtp",
        "qwen3_5_mtp",
        "longcat_flash_mtp",
        "bailing_hybrid_v3_mtp",
        "minimax_m3_mtp",
        "bailing_hybrid_mtp",
        "mtp",
        "kimi_k3_mtp",
        "pangu_ultra_moe_mtp",
        "step3p5_mtp",
        "hy_v3_mtp",
        "hy_v4_mtp",
        "gemma4_mtp",
        "inkling_mtp",
        "glm5_next_mtp",
    }
)
VLLM_METHODS = frozenset(
    {"ngram", "medusa", "mlp_speculator", "draft_model", "suffix", "custom_class"}
    | {"eagle", "eagle3", "extract_hidden_states", "dflash"}  # EagleModelTypes
    | VLLM_MTP_MODEL_TYPES
    | {"ngram_gpu", "dspark"}
)
# vllm/transformers_utils/configs/medusa.py (MedusaConfig) and
# vllm/model_executor/models/medusa.py (Medusa: medusa_fc_bias, original_lm_head, blocks.*,
# lm_heads.*, token_map)
VLLM_MEDUSA_CONFIG_KEYS = {
    "architectures",
    "model_type",
    "hidden_size",
    "vocab_size",
    "num_heads",
    "num_hidden_layers",
    "truncated_vocab_size",
    "medusa_fc_bias",
    "original_lm_head",
}

HUB_NAME = "org/tiny-target"


def export(*args: str) -> dict:
    """Run ``specdec export vllm ARGS --json`` and check what every export must satisfy."""
    result = CliRunner().invoke(app, ["export", "vllm", *args, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    cfg = doc["speculative_config"]
    assert set(cfg) <= VLLM_SPECULATIVE_CONFIG_FIELDS - VLLM_INTERNAL_FIELDS, set(cfg)
    assert cfg["method"] in VLLM_METHODS
    assert isinstance(cfg["num_speculative_tokens"], int) and cfg["num_speculative_tokens"] > 0
    words = shlex.split(doc["command"])
    assert words[:3] == ["vllm", "serve", doc["target"]], doc["command"]
    # the dtype specdec verifies in: vLLM's default (bfloat16) would change greedy outputs
    assert words[3:-2] == doc["serve_args"] and doc["serve_args"][0] == "--dtype"
    assert doc["serve_args"][1] in ("float32", "bfloat16")
    assert words[-2] == "--speculative-config" and json.loads(words[-1]) == cfg
    return doc


def refused(*args: str) -> str:
    """The one stderr line of an export that must fail with exit code 2 and no traceback."""
    result = CliRunner().invoke(app, ["export", "vllm", *args])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> LoadedModel:
    return load_model(tiny_model_dir)


def test_the_module_cites_the_source_these_names_were_read_in():
    import specdec.export.vllm as module

    assert module.VLLM_SOURCE == VLLM_SOURCE
    assert VLLM_SOURCE.rsplit(" ", 1)[1] in (module.__doc__ or "")


# -- the names -----------------------------------------------------------------------------------
def test_prompt_lookup_is_vllms_ngram(tiny_model_dir):
    doc = export("prompt-lookup:max_ngram=4,min_ngram=1,k=7", "--model", str(tiny_model_dir))
    assert doc["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": 7,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    assert doc["target"] == str(tiny_model_dir.resolve())
    assert doc["written"] == [] and doc["not_carried"] == []


@pytest.mark.slow
def test_k_defaults_to_the_engines_and_the_bundled_target_is_its_converted_copy(smol_dir):
    """Neither --model nor --gguf: the bundled model, served from the directory specdec
    converts its GGUF into (the weights it verifies), with the Hub original named as the
    alternative."""
    doc = export("prompt-lookup")
    assert Path(doc["target"]).resolve() == smol_dir.resolve()
    assert any("bundled GGUF" in n and DEFAULT_MODEL_HUB_ID in n for n in doc["notes"])
    assert doc["serve_args"] == ["--dtype", "float32"]
    assert doc["speculative_config"]["num_speculative_tokens"] == 5
    assert doc["speculative_config"]["prompt_lookup_max"] == 3
    assert doc["speculative_config"]["prompt_lookup_min"] == 2
    assert export("prompt-lookup", "--target", HUB_NAME)["target"] == HUB_NAME


def test_a_missing_gguf_is_named(tmp_path):
    line = refused("prompt-lookup", "--gguf", str(tmp_path / "other.gguf"))
    assert "other.gguf" in line and "does not exist" in line


@pytest.mark.parametrize(
    ("dtype", "served", "note"),
    [
        ("float32", "float32", None),
        ("float32-stock", "float32", None),
        ("bfloat16", "bfloat16", None),
        ("float64", "float32", "vLLM has no float64"),
        ("int8", "float32", "dequantised weights in float32"),
    ],
)
def test_the_command_serves_the_dtype_specdec_verifies_in(tiny_model_dir, dtype, served, note):
    doc = export("prompt-lookup", "--model", str(tiny_model_dir), "--dtype", dtype)
    assert doc["serve_args"] == ["--dtype", served]
    said = [n for n in doc["notes"] if "vLLM has no" in n or "dequantised weights" in n]
    if note is None:
        assert said == []
    else:
        assert len(said) == 1 and note in said[0]


def test_suffix_maps_its_knobs_and_names_the_rest(tiny_model_dir):
    spec = "suffix:max_depth=20,alpha=2,min_token_prob=0.2,max_spec_tokens=8,k=6"
    doc = export(spec, "--model", str(tiny_model_dir))
    assert doc["speculative_config"] == {
        "method": "suffix",
        "num_speculative_tokens": 6,  # min(max_spec_tokens, k)
        "suffix_decoding_max_tree_depth": 20,
        "suffix_decoding_max_spec_factor": 2.0,
        "suffix_decoding_min_token_prob": 0.2,
    }
    dropped = {line.split("=", 1)[0] for line in doc["not_carried"]}
    assert dropped == {"cache", "min_match_length", "max_occurrences"}
    assert any("arctic-inference" in n for n in doc["notes"])
    cfg = export("suffix", "--model", str(tiny_model_dir))["speculative_config"]
    assert cfg["num_speculative_tokens"] == 5  # max_spec_tokens 32 capped by the engine's K


@pytest.mark.parametrize(
    "spec, words",
    [
        ("lookahead", "lookahead"),
        ("self", "self-speculation"),
        ("none", "without --speculative-config"),
        ("auto:arms=prompt-lookup+suffix", "one speculative method"),
        ("osd:heads=somewhere", "keep learning"),
    ],
)
def test_speculators_without_a_counterpart_are_refused_in_one_line(tiny_model_dir, spec, words):
    parse_spec(spec)  # a valid spec of ours: refused for vLLM's sake, not for its syntax
    line = refused(spec, "--model", str(tiny_model_dir))
    assert "has no vLLM counterpart" in line and words in line
    assert "Exportable: draft, eagle, medusa, prompt-lookup, suffix" in line


@pytest.mark.slow(threads=1)
def test_a_refusal_in_a_real_process_has_no_traceback(tiny_model_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "specdec.cli.main", "export", "vllm", "lookahead"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "no vLLM counterpart" in proc.stderr
    assert proc.stdout == ""


# -- draft models --------------------------------------------------------------------------------
def test_a_draft_directory_is_vllms_draft_model(tiny_model_dir, tiny_draft_dir, tmp_path):
    doc = export(
        f"draft:model={tiny_draft_dir},min_confidence=0.3,k=3", "--model", str(tiny_model_dir)
    )
    assert doc["speculative_config"] == {
        "method": "draft_model",
        "model": str(tiny_draft_dir.resolve()),
        "num_speculative_tokens": 3,
    }
    not_carried = [line.split("=", 1)[0] for line in doc["not_carried"]]
    assert not_carried == ["min_confidence", "dtype", "vocab", "length", "tree"]
    assert "not a Hugging Face model directory" in refused(
        f"draft:model={tmp_path / 'missing'}", "--model", str(tiny_model_dir)
    )


def test_a_draft_with_another_tokenizer_is_vllms_heterogeneous_vocabulary_draft(
    tiny_model_dir, other_vocab_model_dir
):
    doc = export(f"draft:model={other_vocab_model_dir}", "--model", str(tiny_model_dir))
    cfg = doc["speculative_config"]
    assert cfg["method"] == "draft_model" and cfg["use_heterogeneous_vocab"] is True
    assert any("heterogeneous-vocabulary" in n for n in doc["notes"])
    same = export("draft:model=" + str(tiny_model_dir), "--model", str(tiny_model_dir))
    assert "use_heterogeneous_vocab" not in same["speculative_config"]


def test_an_early_exit_draft_is_written_as_a_standalone_model(tiny_model_dir, loaded, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "exit2"
    doc = export("draft:model=layers:2", "--model", str(tiny_model_dir), "--out", str(out))
    assert doc["speculative_config"]["model"] == str(out.resolve())
    assert doc["written"] == [str(out)]
    draft = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert draft.config.num_hidden_layers == 2
    ours = early_exit_model(loaded.model, 2)
    ids = torch.tensor([[5, 17, 42, 9, 100, 3]])
    with torch.no_grad():
        expected = ours(ids).logits
        got = draft(ids).logits
    assert torch.allclose(got, expected, atol=1e-4)
    # an export may be redone over itself, but never into a directory of someone else's
    export("draft:model=layers:2", "--model", str(tiny_model_dir), "--out", str(out))
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    assert "not an earlier" in refused(
        "draft:model=layers:2", "--model", str(tiny_model_dir), "--out", str(stray)
    )


# -- Medusa --------------------------------------------------------------------------------------
def make_medusa(loaded: LoadedModel, out: Path, *, draft_vocab: int | None, heads: int = 3) -> Path:
    cfg = loaded.model.config
    config = MedusaConfig(
        hidden_size=int(cfg.hidden_size),
        vocab_size=int(cfg.vocab_size),
        num_heads=heads,
        num_layers=2,
        draft_vocab_size=draft_vocab,
        target=loaded.identity(),
    )
    gen = torch.Generator().manual_seed(3)
    token_map = None
    if draft_vocab is not None:
        token_map = torch.randperm(config.vocab_size, generator=gen)[:draft_vocab]
    medusa = MedusaHeads(config, token_map)
    with torch.no_grad():
        for p in medusa.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    medusa.save(out)
    return out


def vllm_medusa_tokens(d: Path, hidden: torch.Tensor) -> torch.Tensor:
    """vLLM's Medusa on ``hidden`` [B, H] from the files alone, as its code computes it:
    ``ResidualBlock`` (x + SiLU(layer(x)) per layer), ``lm_heads``, the ``token_map`` scatter
    into -inf logits over the full vocabulary, then the V1 proposer's per-head argmax.
    Returns [B, num_heads] target token ids."""
    cfg = json.loads((d / "config.json").read_text())
    state = load_file(str(d / "model.safetensors"))
    tokens = []
    for i in range(cfg["num_heads"]):
        x = hidden
        for j in range(cfg["num_hidden_layers"]):
            w, b = state[f"blocks.{i}.layers.{j}.weight"], state[f"blocks.{i}.layers.{j}.bias"]
            x = x + torch.nn.functional.silu(x @ w.T + b)
        logits = x @ state[f"lm_heads.{i}.weight"].T  # [B, truncated_vocab_size]
        if cfg["truncated_vocab_size"] < cfg["vocab_size"]:
            full = torch.full((len(hidden), cfg["vocab_size"]), -torch.inf)
            full[:, state["token_map"]] = logits
            logits = full
        tokens.append(logits.argmax(-1))
    return torch.stack(tokens, dim=1)


@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_medusa_is_converted_to_the_layout_vllm_loads(
    tiny_model_dir, loaded, tmp_path, draft_vocab
):
    src = make_medusa(loaded, tmp_path / "medusa", draft_vocab=draft_vocab)
    doc = export(f"medusa:{src}", "--model", str(tiny_model_dir))
    out = tmp_path / "medusa-vllm"  # the default: next to the source
    cfg = doc["speculative_config"]
    assert cfg == {"method": "medusa", "model": str(out), "num_speculative_tokens": 3}
    assert [line.split("=", 1)[0] for line in doc["not_carried"]] == ["tree"]
    assert any("full" in n and "vocabulary" in n for n in doc["notes"]) == (draft_vocab is not None)
    config = json.loads((out / "config.json").read_text())
    assert set(config) - {"specdec"} == VLLM_MEDUSA_CONFIG_KEYS
    # MedusaConfig.from_pretrained renames every key holding "num" and "heads" / "layers"
    renamed = {k for k in config if "num" in k and ("heads" in k or "layers" in k)}
    assert renamed == {"num_heads", "num_hidden_layers"}
    hidden, vocab = int(loaded.model.config.hidden_size), int(loaded.model.config.vocab_size)
    rows = vocab  # vLLM's Medusa loads heads over the full vocabulary only
    assert config["truncated_vocab_size"] == rows and config["vocab_size"] == vocab
    state = load_file(str(out / "model.safetensors"))
    expected = {f"lm_heads.{i}.weight": (rows, hidden) for i in range(3)}
    for i in range(3):
        for j in range(2):
            expected[f"blocks.{i}.layers.{j}.weight"] = (hidden, hidden)
            expected[f"blocks.{i}.layers.{j}.bias"] = (hidden,)
    assert {k: tuple(v.shape) for k, v in state.items()} == expected

    from specdec.heads.medusa import load_medusa

    heads = load_medusa(src)
    h = torch.randn(8, hidden, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = heads.to_target_ids(heads(h).argmax(-1))  # [B, K]
    assert torch.equal(vllm_medusa_tokens(out, h), ours)


def test_medusa_writes_one_head_per_draft_token(tiny_model_dir, loaded, tmp_path):
    src = make_medusa(loaded, tmp_path / "medusa", draft_vocab=None, heads=4)
    out = tmp_path / "two"
    doc = export(f"medusa:dir={src},k=2", "--model", str(tiny_model_dir), "--out", str(out))
    assert doc["speculative_config"]["num_speculative_tokens"] == 2
    assert json.loads((out / "config.json").read_text())["num_heads"] == 2
    assert not any(k.startswith("lm_heads.2") for k in load_file(str(out / "model.safetensors")))
    doc = export(f"medusa:dir={src},k=9", "--model", str(tiny_model_dir), "--out", str(out))
    assert doc["speculative_config"]["num_speculative_tokens"] == 4
    assert "--out" in refused(f"medusa:{src}", "--model", str(tiny_model_dir), "--out", str(src))


# -- EAGLE ---------------------------------------------------------------------------------------
def test_eagle3_is_rewritten_for_the_target_it_is_served_with(tiny_model_dir, loaded, tmp_path):
    head = make_head(loaded, "eagle3", draft_vocab=40, aux=(1, 2, 3))  # speculative_tokens=4
    src = tmp_path / "eagle"
    save_eagle(head, src, verifier_name_or_path="someone/else", verifier_architectures=["X"])
    out = tmp_path / "served"
    doc = export(
        f"eagle:{src}", "--model", str(tiny_model_dir), "--target", HUB_NAME, "--out", str(out)
    )
    assert doc["speculative_config"] == {
        "method": "eagle3",
        "model": str(out.resolve()),
        "num_speculative_tokens": 4,  # the checkpoint's default depth, within K = 5
    }
    config = json.loads((out / "config.json").read_text())
    verifier = config["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": HUB_NAME, "architectures": ["LlamaForCausalLM"]}
    assert "model_type" not in config  # what makes vLLM read it as a speculators checkpoint
    assert [line.split("=", 1)[0] for line in doc["not_carried"]] == ["tree"]
    load_eagle(out, loaded)  # still ours to read, and still fits this target
    cfg = export(f"eagle:dir={src},tree=3x2x8", "--model", str(tiny_model_dir), "--out", str(out))
    assert cfg["speculative_config"]["num_speculative_tokens"] == 3  # the tree's depth
    assert cfg["target"] == str(tiny_model_dir.resolve())
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == cfg["target"]
    cfg = export(f"eagle:dir={src},k=2", "--model", str(tiny_model_dir), "--out", str(out))
    assert cfg["speculative_config"]["num_speculative_tokens"] == 2  # never more than k


def test_eagle1_is_vllms_eagle_method_and_a_biased_fc_is_refused(tiny_model_dir, loaded, tmp_path):
    save_eagle(make_head(loaded, "eagle1"), tmp_path / "e1", verifier_name_or_path="x",
               verifier_architectures=["LlamaForCausalLM"])  # fmt: skip
    doc = export(f"eagle:{tmp_path / 'e1'}", "--model", str(tiny_model_dir))
    assert doc["speculative_config"]["method"] == "eagle"
    save_eagle(make_head(loaded, "eagle1", fc_bias=True), tmp_path / "b", verifier_name_or_path="x",
               verifier_architectures=["LlamaForCausalLM"])  # fmt: skip
    line = refused(f"eagle:{tmp_path / 'b'}", "--model", str(tiny_model_dir))
    assert "vLLM cannot serve" in line and "bias" in line


def test_human_output_is_the_command_then_notes(tiny_model_dir):
    result = CliRunner().invoke(
        app, ["export", "vllm", "suffix:min_match_length=3", "--model", str(tiny_model_dir)]
    )
    assert result.exit_code == 0, result.output
    (command,) = result.stdout.splitlines()
    assert command.startswith("vllm serve ") and '"method": "suffix"' in command
    assert "not carried over: min_match_length=3" in result.stderr


@pytest.mark.slow(threads=1)
def test_the_shipped_eagle_head_exports_without_a_path(tiny_model_dir, smol_dir, tmp_path):
    """`specdec export vllm eagle`: the head shipped for the bundled model, written where --out
    says (never beside the installed package); another target is told to train its own."""
    assert "--out" in refused("eagle")
    out = tmp_path / "served"
    doc = export("eagle", "--out", str(out))
    assert doc["speculative_config"]["method"] == "eagle3"
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == doc["target"]
    line = refused("eagle", "--model", str(tiny_model_dir), "--out", str(tmp_path / "other"))
    assert "shipped EAGLE-3 head is for the bundled" in line and "train" in line
