"""Self-speculation (``--method self``): drafts made of the target's own layers, on tiny models.

Greedy equivalence with plain decoding, statistical losslessness of sampling (the joint of the
first two tokens against the exact target distribution), shared modules without mutation, the
layer-subset draft against a manual forward, spec parsing, and the trained exit end to end.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from typer.testing import CliRunner

from specdec import GenerationConfig, SamplingConfig, SpeculativeEngine
from specdec.cli.main import app
from specdec.errors import CheckpointError, ConfigError
from specdec.heads.self_exit import load_self_exit
from specdec.speculators import build_speculator, options_for
from specdec.speculators.self_spec import (
    calibration_path,
    default_spec,
    parse_self_draft,
    save_calibration,
)
from specdec.target import HFTarget, ModelRunner, load_model
from specdec.target.early_exit import layer_subset_model
from specdec.testing import model_fingerprint
from specdec.training.data import generate_data
from specdec.training.self_exit import SelfExitTrainConfig, train_self_exit
from specdec.verify import probs_from_logits

PROMPTS = ["ROMEO: But soft, what light", "To be, or not to be", "KING: My lords,"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path):
    return load_model(tiny_model_dir)


def engine_for(loaded, self_draft: str, k: int = 3, adaptive: bool = False) -> SpeculativeEngine:
    spec = options_for("self", layers=self_draft)
    return SpeculativeEngine(
        HFTarget(loaded),
        loaded.tokenizer,
        build_speculator(loaded, spec),
        num_draft_tokens=k,
        loaded=loaded,
        adaptive=adaptive,
    )


def fingerprint(loaded) -> str:
    return model_fingerprint(loaded, modules=True)


# -- specs -------------------------------------------------------------------------------------
def test_specs_parse():
    assert parse_self_draft("exit:3", 30).layers == (0, 1, 2)
    skip = parse_self_draft("skip:10-25", 30)
    assert skip.layers == (*range(10), 26, 27, 28, 29)
    assert parse_self_draft("keep:0-9,26-29", 30).layers == skip.layers
    assert parse_self_draft("skip:3,5-6@0.4", 8).min_confidence == 0.4
    assert parse_self_draft("skip:3,5-6@0.4", 8).layers == (0, 1, 2, 4, 7)
    a = parse_self_draft("adapter:/x/y@0.3", 30)
    assert (a.adapter, a.min_confidence) == ("/x/y", 0.3)
    assert parse_self_draft(default_spec(30), 30).kind == "exit"


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("layers:3", "expected exit:N"),
        ("exit", "expected exit:N"),
        ("exit:0", "1 <= N < 4"),
        ("exit:4", "1 <= N < 4"),
        ("exit:x", "integer"),
        ("skip:0", "layer 0 must be kept"),
        ("keep:1-3", "layer 0 must be kept"),
        ("skip:2-9", "0 <= A <= B < 4"),
        ("skip:3-1", "0 <= A <= B"),
        ("skip:a-b", "not a layer number"),
        ("keep:0-3", "keeps every layer"),
        ("exit:2@1.5", "[0, 1)"),
        ("exit:2@high", "not a number"),
    ],
)
def test_bad_specs_are_config_errors(tiny, spec, needle):
    with pytest.raises(ConfigError, match=__import__("re").escape(needle)):
        build_speculator(tiny, options_for("self", layers=spec))


def test_missing_adapter_is_a_clear_error(tiny, tmp_path):
    with pytest.raises(CheckpointError, match="specdec train self"):
        build_speculator(tiny, options_for("self", layers=f"adapter:{tmp_path}"))


# -- the draft model ---------------------------------------------------------------------------
def test_skip_set_logits_equal_a_manual_forward(tiny):
    """The draft's logits (through our runner and its cache, token by token) equal the kept
    layers applied by hand, with a fresh cache of our own."""
    from transformers import DynamicCache

    model = tiny.model
    keep = [0, 2, 3]
    runner = ModelRunner(layer_subset_model(model, keep))
    ids = tiny.tokenizer("To be, or not to be, that is")["input_ids"]
    got = torch.cat([runner.forward(ids[:5]), runner.forward(ids[5:])])  # [T, V]
    with torch.inference_mode():
        x = model.model.embed_tokens(torch.tensor([ids]))  # [1, T, H]
        pos = torch.arange(len(ids))[None]
        rope = model.model.rotary_emb(x, pos)
        mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
        cache = DynamicCache(config=model.config)
        for i in keep:
            x = model.model.layers[i](
                x, attention_mask=mask, position_ids=pos, cache=cache,
                position_embeddings=rope,
            )  # fmt: skip
            x = x[0] if isinstance(x, tuple) else x
        want = model.lm_head(model.model.norm(x))[0]  # [T, V]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # skipped layers hold no cache entries
    slots = runner.cache.hf.layers
    assert slots[1].get_seq_length() == 0 and slots[3].get_seq_length() == len(ids)


def test_targets_weights_config_and_hooks_are_unchanged(tiny):
    before = fingerprint(tiny)
    for spec in ("exit:2", "skip:1-2", "keep:0,3@0.5"):
        engine = engine_for(tiny, spec)
        engine.generate(PROMPTS[0], max_new_tokens=12, chat=False)
        engine.generate(PROMPTS[1], max_new_tokens=12, chat=False, temperature=0.9, seed=1)
    assert fingerprint(tiny) == before


# -- losslessness ------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["exit:2", "skip:1-2", "keep:0,2@0.3"])
def test_greedy_equivalence(tiny, spec):
    engine = engine_for(tiny, spec, k=4)
    accepted = 0
    for prompt in PROMPTS:
        plain = engine.generate(prompt, max_new_tokens=32, chat=False, speculate=False)
        spec_out = engine.generate(prompt, max_new_tokens=32, chat=False)
        assert spec_out.token_ids == plain.token_ids, (spec, prompt)
        accepted += spec_out.stats.accepted_tokens
    assert accepted > 0 or spec == "exit:2"


def test_confidence_stop_shortens_chains(tiny):
    long = engine_for(tiny, "skip:1-2", k=6).generate(PROMPTS[0], max_new_tokens=30, chat=False)
    short = engine_for(tiny, "skip:1-2@0.99", k=6).generate(
        PROMPTS[0], max_new_tokens=30, chat=False
    )
    assert short.token_ids == long.token_ids
    assert short.stats.drafted_tokens < long.stats.drafted_tokens


SAMPLES, ALPHA = 1000, 1e-3
SAMPLING = dict(temperature=1.0, top_k=4)


@pytest.mark.slow(threads=1)
def test_sampling_is_lossless(tiny):
    """The joint of the first two sampled tokens matches the exact target joint (chi-square,
    cells with expected count < 5 pooled). The draft (layers 0, 1 and 3 of 4) differs from p."""
    prompt = tiny.tokenizer("KING: My lords,")["input_ids"]
    shaping = SamplingConfig(**SAMPLING)
    runner = ModelRunner(tiny.model)
    p1 = probs_from_logits(runner.forward(prompt)[-1:], shaping)[0]  # [V]
    joint: dict[tuple[int, int], float] = {}
    for a in torch.nonzero(p1).flatten().tolist():
        runner.reset()
        p2 = probs_from_logits(runner.forward([*prompt, a])[-1:], shaping)[0]  # [V]
        for b in torch.nonzero(p2).flatten().tolist():
            joint[(a, b)] = float(p1[a] * p2[b])
    engine = engine_for(tiny, "skip:2", k=3)
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in range(SAMPLES):
        config = GenerationConfig(
            max_new_tokens=2, ignore_eos=True, sampling=SamplingConfig(**SAMPLING, seed=seed)
        )
        ids: list[int] = []
        stats = None
        for event in engine.stream_ids(prompt, config):
            ids.extend(event.token_ids)
            stats = event.stats
        counts[tuple(ids)] += 1
        assert stats is not None
        drafted += stats.drafted_tokens
        accepted += stats.accepted_tokens
    assert 0 < accepted < drafted  # drafts were both accepted and rejected
    assert all(joint.get(seq, 0.0) > 0 for seq in counts), "a sequence p never produces"
    observed, expected, pool_o, pool_e = [], [], 0, 0.0
    for seq, prob in joint.items():
        e = prob * SAMPLES
        if e < 5:
            pool_o, pool_e = pool_o + counts.get(seq, 0), pool_e + e
        else:
            observed.append(counts.get(seq, 0))
            expected.append(e)
    if pool_e:
        observed.append(pool_o)
        expected.append(pool_e)
    pvalue = float(chisquare(observed, [e * SAMPLES / sum(expected) for e in expected]).pvalue)
    assert pvalue > ALPHA, f"self-speculative sampling departs from p (p = {pvalue:.2e})"


# -- calibration file --------------------------------------------------------------------------
def test_saved_calibration_is_used(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    spec = "self"
    fallback = build_speculator(tiny, spec)
    assert fallback.min_confidence == 0.7 and "not calibrated" in fallback.description
    path = save_calibration(tiny, "skip:2@0.2", {"tokens_per_second": 1.0})
    assert path == calibration_path(tiny) and path.is_relative_to(tmp_path)
    speculator = build_speculator(tiny, spec)
    assert speculator.min_confidence == 0.2 and "calibrated" in speculator.description


# -- the trained exit --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data_dir(tiny, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("self_data")
    lines = [f"{p} {i}" for i, p in enumerate(PROMPTS * 6)]
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in lines))
    out = root / "sd"
    generate_data(tiny, prompts, out, max_new_tokens=16, batch_size=8, shard_size=16)
    return out


def test_train_self_reads_several_data_directories(tiny, data_dir, tmp_path):
    """``--data`` repeats (as for eagle and medusa): a second directory answering the same
    prompts adds its positions; the same directory twice is refused, not counted double."""
    more = tmp_path / "more"
    generate_data(tiny, data_dir.parent / "prompts.jsonl", more, max_new_tokens=8, batch_size=8)

    def positions(*dirs: Path) -> int:
        args = ["train", "self", "--layer", "2", "--out", str(tmp_path / f"o{len(dirs)}"),
                "--max-steps", "1", "--batch", "16", "--model", str(tiny.source)]  # fmt: skip
        for d in dirs:
            args += ["--data", str(d)]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        train, held = re.search(r"\((\d+) train / (\d+) held-out", result.output).groups()
        return int(train) + int(held)

    one, both = positions(data_dir), positions(data_dir, more)
    assert both > one
    twice = CliRunner().invoke(
        app,
        ["train", "self", "--layer", "2", "--out", str(tmp_path / "t"), "--model",
         str(tiny.source), "--data", f"{data_dir},{data_dir}"],
    )  # fmt: skip
    assert twice.exit_code == 2 and "given twice" in twice.output, twice.output


def test_trained_exit_end_to_end(tiny, data_dir, tmp_path, other_vocab_model_dir):
    out = tmp_path / "exit"
    before = fingerprint(tiny)
    result = CliRunner().invoke(
        app,
        ["train", "self", "--data", str(data_dir), "--layer", "2", "--out", str(out),
         "--max-steps", "30", "--batch", "64", "--draft-vocab", "200",
         "--model", str(tiny.source)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    adapter = load_self_exit(out)
    assert adapter.config.layer == 2 and adapter.config.draft_vocab == 200
    assert adapter.config.target == tiny.identity()
    assert any(
        float(p.detach().abs().sum()) > 0 for n, p in adapter.named_parameters() if "norm" not in n
    )
    engine = engine_for(tiny, f"adapter:{out}", k=3)
    for prompt in PROMPTS:
        plain = engine.generate(prompt, max_new_tokens=20, chat=False, speculate=False)
        assert engine.generate(prompt, max_new_tokens=20, chat=False).token_ids == plain.token_ids
    assert fingerprint(tiny) == before
    other = load_model(other_vocab_model_dir)
    with pytest.raises(CheckpointError, match="another target"):
        build_speculator(other, options_for("self", layers=f"adapter:{out}"))


def test_training_is_seeded(tiny, data_dir, tmp_path):
    from specdec.training.data import load_data

    data = load_data(data_dir, tiny)
    cfg = SelfExitTrainConfig(layer=1, max_steps=6, batch_positions=32, checkpoint_every=3)
    a = train_self_exit(tiny, data, tmp_path / "a", cfg)
    b = train_self_exit(tiny, data, tmp_path / "b", cfg)
    wa = load_self_exit(tmp_path / "a").state_dict()
    wb = load_self_exit(tmp_path / "b").state_dict()
    assert a.steps == b.steps == 6
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(ConfigError, match="--layer"):
        train_self_exit(tiny, data, tmp_path / "c", SelfExitTrainConfig(layer=4, max_steps=1))


def test_calibrate_cli_saves_a_choice(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    prompts = tmp_path / "train" / "prompts.jsonl"
    prompts.parent.mkdir()
    prompts.write_text("".join(json.dumps({"prompt": p, "category": "x"}) + "\n" for p in PROMPTS))
    args = ["calibrate", "self", "--prompts", str(prompts), "--num-prompts", "2",
            "--max-new-tokens", "8", "--candidate", "exit:3", "--candidate", "skip:2",
            "--thresholds", "0.5", "--model", str(tiny.source)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    saved = json.loads(calibration_path(tiny).read_text())
    assert saved["self_draft"] in {"exit:3", "skip:2", "exit:3@0.5", "skip:2@0.5"}
    assert len(saved["measured"]) == 4
    build_speculator(tiny, "self")  # uses it
    evals = tmp_path / "eval" / "p.jsonl"
    evals.parent.mkdir()
    evals.write_text(prompts.read_text())
    result = CliRunner().invoke(app, [*args[:3], str(evals), *args[4:]])
    assert result.exit_code == 2 and "evaluation set" in result.output
