"""Distilled draft models (DistillSpec): the trainer, its output directory, resume, and errors —
on tiny random-weight models and self-distilled data made in the test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import corpus_lines
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from specdec import SpeculativeEngine
from specdec.cli.main import app
from specdec.errors import CheckpointError, ConfigError, DataError
from specdec.speculators import options_for
from specdec.target import early_exit_model, load_model
from specdec.testing import model_fingerprint
from specdec.training.data import Record, generate_data, load_data
from specdec.training.distill import (
    TRAINING_FILE,
    build_student,
    collate,
    distill_loss,
    response_logits,
    topk_distill_loss,
    train_draft,
)

SHORT_PROMPTS = [
    "ROMEO: But soft, what light through yonder window breaks?",
    "JULIET: O Romeo, Romeo! wherefore art thou Romeo?",
    "Tell me about the king and the queen.",
    "What news from the court today?",
]
# a small, fast run that measurably lowers the held-out KL of a 1-layer student
QUICK = dict(layers=1, max_steps=60, lr=3e-3, batch_tokens=256, held_out=0.2, eval_every=30)


def _prompts(n: int) -> list[str]:
    lines = [ln for ln in corpus_lines() if len(ln) > 20]
    return lines[::97][:n]


def _write_prompts(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def data_dir(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("distill_data")
    prompts = _write_prompts(root / "prompts.jsonl", _prompts(80))
    out = root / "sd"
    generate_data(tiny, prompts, out, max_new_tokens=24, batch_size=16, shard_size=32)
    return out


@pytest.fixture(scope="module")
def trained(tiny, data_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("distilled") / "draft"
    before = model_fingerprint(tiny)
    result = train_draft(tiny, data_dir, out, **QUICK)
    return result, out, before


# -- training ----------------------------------------------------------------------------------
def test_training_lowers_the_held_out_kl(trained):
    result, _, _ = trained
    assert result.steps == result.total_steps == 60
    assert [h.step for h in result.history] == [0, 30, 60]
    assert result.final.positions > 100
    assert result.final.kl < 0.95 * result.initial.kl, result.history
    assert "first 1 of 4 layers" in result.init


def test_the_targets_weights_and_config_are_unchanged(tiny, trained):
    _, _, before = trained
    assert model_fingerprint(tiny) == before


def test_initial_student_is_the_early_exit_draft(tiny):
    student, note = build_student(tiny, 2, None, seed=0)
    assert "initialised from the target" in note
    reference = early_exit_model(tiny.model, 2)
    ids = torch.arange(3, 30)[None]
    with torch.inference_mode():
        torch.testing.assert_close(student(ids).logits, reference(ids).logits, atol=1e-4, rtol=0)
    # copies, not shared tensors: training the student cannot move the target
    target_emb = tiny.model.get_input_embeddings().weight
    assert student.get_input_embeddings().weight.data_ptr() != target_emb.data_ptr()


def test_logits_only_at_response_positions_match_the_full_forward(tiny):
    batch = collate([Record(tuple(range(5, 25)), 7, 0), Record(tuple(range(30, 42)), 4, 1)], 0)
    with torch.inference_mode():
        full = tiny.model(batch.input_ids, attention_mask=batch.attention_mask).logits  # [B, T, V]
        part = response_logits(tiny.model, batch)  # [P, V]
    assert part.shape[0] == (20 - 7) + (12 - 4) == int(batch.loss_mask.sum())
    torch.testing.assert_close(part, full[batch.loss_mask], atol=1e-5, rtol=0)


def test_loss_is_kl_and_mixes_in_cross_entropy():
    t = torch.tensor([[1.0, 0.0, -1.0], [0.5, 0.5, 3.0]])
    s = torch.tensor([[0.0, 0.0, 0.0], [1.0, -1.0, 0.0]])
    p, log_q = t.softmax(-1), s.log_softmax(-1)
    kl = float((p * (p.log() - log_q)).sum(-1).mean())
    ce = float(-log_q[[0, 1], [0, 2]].mean())
    parts = distill_loss(s, t, torch.tensor([0, 2]), ce_weight=0.25)
    assert parts.kl == pytest.approx(kl, rel=1e-5)
    assert parts.ce == pytest.approx(ce, rel=1e-5)
    assert float(parts.loss) == pytest.approx(0.75 * kl + 0.25 * ce, rel=1e-5)


def test_topk_loss_is_the_kl_of_the_coarsened_distributions():
    torch.manual_seed(0)
    t, s = torch.randn(6, 50) * 3, torch.randn(6, 50)
    nxt = torch.zeros(6, dtype=torch.long)
    full = distill_loss(s, t, nxt)
    logp = t.log_softmax(-1)
    everything = logp.topk(50, dim=-1)
    exact = topk_distill_loss(s, everything.indices, everything.values, nxt)
    assert exact.kl == pytest.approx(full.kl, rel=1e-5)
    top = logp.topk(5, dim=-1)
    approx = topk_distill_loss(s, top.indices, top.values, nxt)
    assert 0 < approx.kl <= full.kl  # a coarsening never raises the KL


def test_cached_topk_teacher_also_lowers_the_held_out_kl(tiny, data_dir: Path, tmp_path: Path):
    result = train_draft(tiny, data_dir, tmp_path / "topk", teacher_topk=16, **QUICK)
    assert result.final.kl < 0.95 * result.initial.kl, result.history
    record = json.loads((tmp_path / "topk" / TRAINING_FILE).read_text())
    assert 0 < record["teacher_topk_mass"] <= 1


# -- the output directory ----------------------------------------------------------------------
def test_output_is_a_hugging_face_model_directory(tiny, trained):
    result, out, _ = trained
    for name in ("config.json", "model.safetensors", "generation_config.json", TRAINING_FILE):
        assert (out / name).is_file(), name
    draft = load_model(out)
    assert draft.model.config.num_hidden_layers == 1
    assert draft.tokenizer.get_vocab() == tiny.tokenizer.get_vocab()
    record = json.loads((out / TRAINING_FILE).read_text())
    assert record["target"] == tiny.identity()
    assert record["steps"] == 60 and record["finished"] is True
    assert Path(record["data_manifest"]).name == "manifest.json"
    assert record["held_out_agreement"] == pytest.approx(result.final.agreement)
    assert record["wall_seconds"] > 0
    # initialised from the target: its vocabulary matrices are kept, the layers trained
    student = record["student"]
    assert 0 < student["trainable_parameters"] < student["parameters"]
    torch.testing.assert_close(
        draft.model.get_input_embeddings().weight, tiny.model.get_input_embeddings().weight
    )


def test_hf_assisted_generation_loads_the_draft(tiny_model_dir: Path, trained):
    _, out, _ = trained
    target = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    assistant = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    ids = torch.tensor([[5, 17, 42, 9, 11]])
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                  eos_token_id=None, pad_token_id=0)  # fmt: skip
    with torch.inference_mode():
        plain = target.generate(ids, **kwargs)
        assisted = target.generate(ids, assistant_model=assistant, **kwargs)
    assert assisted.tolist() == plain.tolist()


def test_draft_method_with_the_trained_draft_is_lossless(tiny_model_dir: Path, trained):
    _, out, _ = trained
    # float64, as in the equivalence tests: no argmax near-tie can flip between pass shapes
    engine = SpeculativeEngine.from_pretrained(
        tiny_model_dir, speculator=options_for("draft", model=str(out)), num_draft_tokens=4,
        adaptive=False, dtype="float64",
    )  # fmt: skip
    accepted = 0
    for prompt in ("ROMEO: But soft, what light", "the king and the queen", "Speak of love"):
        plain = engine.generate(prompt, max_new_tokens=30, ignore_eos=True, speculate=False)
        spec = engine.generate(prompt, max_new_tokens=30, ignore_eos=True)
        assert spec.token_ids == plain.token_ids, prompt
        accepted += spec.stats.accepted_tokens
    assert accepted > 0


# -- resume ------------------------------------------------------------------------------------
class _Interrupt(Exception):
    pass


def _bar_failing_at(step: int):
    class Bar:
        def __init__(self, *args, **kwargs):
            self.n = kwargs.get("initial", 0)

        def update(self, n: int = 1) -> None:
            self.n += n
            if self.n == step:
                raise _Interrupt

        def set_postfix(self, *args, **kwargs) -> None: ...

        def write(self, *args, **kwargs) -> None: ...

        def close(self) -> None: ...

    return Bar


def test_an_interrupted_run_resumes_to_the_same_weights(tiny, data_dir: Path, tmp_path: Path):
    settings = dict(layers=1, max_steps=4, lr=3e-3, batch_tokens=256, eval_every=2,
                    checkpoint_every=2)  # fmt: skip
    straight = train_draft(tiny, data_dir, tmp_path / "a", **settings)
    with pytest.raises(_Interrupt):
        train_draft(tiny, data_dir, tmp_path / "b", progress=_bar_failing_at(3), **settings)
    assert json.loads((tmp_path / "b" / TRAINING_FILE).read_text())["steps"] == 2
    with pytest.raises(CheckpointError, match="--resume"):
        train_draft(tiny, data_dir, tmp_path / "b", **settings)
    resumed = train_draft(tiny, data_dir, tmp_path / "b", resume=True, **settings)
    assert resumed.resumed_from == 2 and resumed.steps == 4
    a = load_file(tmp_path / "a" / "model.safetensors")
    b = load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert resumed.final.kl == pytest.approx(straight.final.kl)


def test_resume_needs_a_checkpoint_and_the_same_settings(tiny, data_dir: Path, tmp_path: Path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        train_draft(tiny, data_dir, tmp_path / "x", layers=1, max_steps=1, resume=True)
    train_draft(tiny, data_dir, tmp_path / "y", layers=1, max_steps=1, batch_tokens=256)
    with pytest.raises(CheckpointError, match="lr="):
        train_draft(tiny, data_dir, tmp_path / "y", layers=1, max_steps=2, batch_tokens=256,
                    lr=1e-2, resume=True)  # fmt: skip


def test_another_hidden_size_starts_from_random_weights(tiny, data_dir: Path, tmp_path: Path):
    result = train_draft(tiny, data_dir, tmp_path / "narrow", layers=1, hidden=32, max_steps=2,
                         batch_tokens=256)  # fmt: skip
    assert "random" in result.init and "frozen" not in result.init
    draft = load_model(tmp_path / "narrow")
    assert draft.model.config.hidden_size == 32
    assert draft.model.config.vocab_size == tiny.model.config.vocab_size


# -- bad input ---------------------------------------------------------------------------------
def test_data_from_another_target_is_refused(tiny, tiny_draft_dir: Path, tmp_path: Path):
    other = load_model(tiny_draft_dir)
    prompts = _write_prompts(tmp_path / "p.jsonl", SHORT_PROMPTS)
    generate_data(other, prompts, tmp_path / "other", max_new_tokens=4)
    with pytest.raises(DataError, match="another target"):
        train_draft(tiny, tmp_path / "other", tmp_path / "out", layers=1)
    with pytest.raises(DataError, match="another target"):  # also when passed loaded
        train_draft(tiny, load_data(tmp_path / "other"), tmp_path / "out", layers=1)
    assert not (tmp_path / "out").exists()


def test_empty_or_missing_data_is_refused(tiny, tmp_path: Path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="data generate"):
        train_draft(tiny, tmp_path / "empty", tmp_path / "out", layers=1)
    with pytest.raises(DataError, match="does not exist"):
        train_draft(tiny, tmp_path / "missing", tmp_path / "out", layers=1)


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(layers=0), "--layers must be >= 1"),
        (dict(layers=4), "--layers must be between 1 and 3"),
        (dict(layers=1, hidden=30), "not divisible by the target's 4 attention heads"),
        (dict(layers=1, hidden=36), "even"),
        (dict(layers=1, lr=0.0), "lr"),
        (dict(layers=1, ce_weight=2.0), "ce_weight"),
    ],
)
def test_bad_settings_are_config_errors(tiny, data_dir: Path, tmp_path: Path, kwargs, words):
    with pytest.raises(ConfigError, match=words):
        train_draft(tiny, data_dir, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


# -- the command line --------------------------------------------------------------------------
def test_cli_trains_a_draft(tiny_model_dir: Path, data_dir: Path, tmp_path: Path):
    out = tmp_path / "cli-draft"
    args = ["train", "draft", "--model", str(tiny_model_dir), "--data", str(data_dir),
            "--out", str(out), "--layers", "1", "--max-steps", "2",
            "--batch-tokens", "256"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "draft saved" in result.output
    assert (out / "model.safetensors").is_file()


def test_cli_trains_a_draft_on_several_data_directories(tiny, data_dir, tmp_path: Path):
    """``--data`` repeats, as for eagle and medusa; one directory twice is refused."""
    more = tmp_path / "more"
    generate_data(tiny, data_dir.parent / "prompts.jsonl", more, max_new_tokens=8, batch_size=16)
    base = ["train", "draft", "--model", str(tiny.source), "--out", str(tmp_path / "o"),
            "--layers", "1", "--max-steps", "2", "--batch-tokens", "256"]  # fmt: skip
    result = CliRunner().invoke(app, [*base, "--data", str(data_dir), "--data", str(more)])
    assert result.exit_code == 0, result.output
    assert "draft saved" in result.output
    twice = CliRunner().invoke(app, [*base, "--data", f"{data_dir},{data_dir}"])
    assert twice.exit_code == 2 and "given twice" in twice.output, twice.output


@pytest.mark.parametrize(
    "extra,words",
    [
        (["--layers", "9"], "--layers must be between"),
        (["--layers", "1", "--hidden", "30"], "divisible"),
        (["--layers", "1", "--resume"], "no checkpoint"),
        (["--layers", "1", "--categories", "chat"], "unknown category chat; this data has"),
    ],
)
def test_cli_errors_are_one_line(tiny_model_dir, data_dir, tmp_path, extra, words):
    args = ["train", "draft", "--model", str(tiny_model_dir), "--data", str(data_dir),
            "--out", str(tmp_path / "o"), *extra]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and words in result.output
    assert "Traceback" not in result.output


def test_cli_refuses_an_empty_data_directory(tiny_model_dir: Path, tmp_path: Path):
    (tmp_path / "d").mkdir()
    args = ["train", "draft", "--model", str(tiny_model_dir), "--data", str(tmp_path / "d"),
            "--out", str(tmp_path / "o")]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "data generate" in result.output
