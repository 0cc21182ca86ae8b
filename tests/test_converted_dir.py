"""A GGUF converted by specdec is a model directory that any reader loads from its files alone.

vLLM (and other engines) read a safetensors file's tensors by name and ignore the aliases that
safetensors' ``save_model`` records for shared tensors: served from a directory written that
way, the bundled model had no embeddings and emitted token 0 forever. So these tests read the
files with ``safetensors.torch.load_file`` (no alias resolution) into a model built from
``config.json`` alone, and compare its logits with specdec's own target on the same directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file, save_model
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from specdec.target import load_model
from specdec.target.checkpoints import every_tensor

IDS = torch.tensor([[1, 5, 9, 14, 3, 7, 2, 11]])


def from_files_alone(directory: Path) -> PreTrainedModel:
    """The model as a strict reader builds it: class from ``architectures``, weights by name."""
    config = AutoConfig.from_pretrained(str(directory))
    assert config.architectures, "config.json names no architecture (vLLM picks its class by it)"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert type(model).__name__ == config.architectures[0]
    state = load_file(str(directory / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert set(missing) <= tied, f"tensors only an alias would give: {sorted(missing)}"
    assert not unexpected, unexpected
    model.tie_weights()
    return model.eval()


def logits(model: PreTrainedModel) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS[:, : min(IDS.shape[1], 8)] % model.config.vocab_size).logits


def test_every_tensor_names_each_weight_once_and_leaves_the_tied_head_to_the_config(
    tiny_model_dir, tmp_path
):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    assert model.config.tie_word_embeddings
    tensors = every_tensor(model)
    assert set(tensors) == set(model.state_dict()) - {"lm_head.weight"}
    out = tmp_path / "written"
    out.mkdir()
    model.config.save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), {"format": "pt"})
    assert torch.equal(logits(from_files_alone(out)), logits(model))


def test_safetensors_save_model_is_the_defect_this_guards_against(tiny_model_dir, tmp_path):
    """The old converter's writer: the tied embeddings survive only as an alias, which a
    reader of the file's names (as vLLM is) does not find."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    save_model(model, str(tmp_path / "model.safetensors"))
    assert "model.embed_tokens.weight" not in load_file(str(tmp_path / "model.safetensors"))
    model.config.save_pretrained(tmp_path)
    with pytest.raises(AssertionError, match="only an alias would give"):
        from_files_alone(tmp_path)


@pytest.mark.slow
def test_the_converted_bundled_model_loads_from_its_files_alone(smol_dir):
    """The bundled GGUF as converted: architectures, every tensor by name, no alias metadata,
    tokenizer and chat template, and logits equal to specdec's target on the directory."""
    config = json.loads((smol_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    with safe_open(str(smol_dir / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}  # no aliases
        assert "model.embed_tokens.weight" in f.keys()
    assert (smol_dir / "tokenizer.json").is_file()
    assert (smol_dir / "chat_template.jinja").is_file()
    ours = load_model(smol_dir, dtype="float32-stock")  # stock linears: the same kernels
    assert torch.equal(logits(from_files_alone(smol_dir)), logits(ours.model))
