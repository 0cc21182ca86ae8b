"""Online-distilled Medusa heads (method ``osd``): they learn from served traffic in a
background thread, swap weights atomically between steps, stay lossless, and save/restore.

All on a tiny random float64 target built from a config (no argmax ties), with heads started
from the target's LM head, as `specdec train medusa` starts them.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch

from specdec import SpeculativeEngine
from specdec.errors import CheckpointError, ConfigError
from specdec.heads.medusa import MedusaConfig, MedusaHeads, load_medusa
from specdec.speculators import options_for, parse_spec
from specdec.speculators.medusa import best_sized_topology, head_accuracy
from specdec.speculators.osd import OnlineConfig, OnlineMedusaSpeculator, OnlineTrainer
from specdec.target import HFTarget
from specdec.tree.topology import expected_accepted, generic_profile, load_topology

PROMPTS = [
    "ROMEO: But soft, what light",
    "the the the the the the the",
    "KING RICHARD III: Now is the winter of our discontent made glorious summer by",
]


@pytest.fixture(scope="module")
def heads_dir(tiny64, tmp_path_factory) -> Path:
    cfg = tiny64.model.config
    mcfg = MedusaConfig(cfg.hidden_size, cfg.vocab_size, num_heads=3, target=tiny64.identity())
    heads = MedusaHeads(mcfg)
    heads.init_from_lm_head(tiny64.model.get_output_embeddings().weight)
    out = tmp_path_factory.mktemp("heads")
    heads.save(out)
    return out


def fingerprint(heads: MedusaHeads) -> str:
    h = hashlib.sha256()
    for name, t in sorted(heads.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def test_learns_from_traffic_and_stays_lossless_while_swapping(tiny64, heads_dir, tmp_path):
    """Decode while the background thread trains and publishes every step: outputs equal
    plain decoding, weights are swapped many times, each proposal used one published copy,
    and no published copy was ever modified after publication (so no step saw a mixture)."""
    engine = SpeculativeEngine.from_pretrained(
        tiny64, speculator=options_for("osd", heads=str(heads_dir), state=str(tmp_path / "state"))
    )
    spec = engine.speculator
    assert isinstance(spec, OnlineMedusaSpeculator)
    trainer = spec.trainer
    trainer.stop()
    trainer.config = OnlineConfig(batch=8, min_examples=8, steps_per_round=1, publish_every=1)
    published: dict[int, tuple[MedusaHeads, str]] = {}
    original = trainer.publish

    def publish_and_record() -> None:
        original()
        snap = trainer.published
        published[snap.version] = (snap.heads, fingerprint(snap.heads))

    trainer.publish = publish_and_record  # type: ignore[method-assign]
    trainer.start()
    try:
        for _ in range(3):
            for prompt in PROMPTS:
                plain = engine.generate(prompt, max_new_tokens=30, ignore_eos=True, speculate=False)
                out = engine.generate(prompt, max_new_tokens=30, ignore_eos=True)
                assert out.token_ids == plain.token_ids
    finally:
        trainer.stop()
    assert trainer.steps > 5 and spec.version > 5, (trainer.steps, spec.version)
    assert len(set(spec.versions_used)) > 2  # decoding really ran across several swaps
    for version, (heads, digest) in published.items():
        assert fingerprint(heads) == digest, version  # never modified after publication
    assert (tmp_path / "state" / "config.json").is_file()  # saved at each request's end


def test_training_lowers_the_loss_on_the_traffic(tiny64, heads_dir):
    """Synchronous rounds (no thread) on one repeated request: the heads learn it."""
    heads = load_medusa(heads_dir)
    topo = load_topology("sparse-8", heads.config.num_heads)
    cfg = OnlineConfig(batch=16, min_examples=16, steps_per_round=10, publish_every=5, lr=3e-3)
    spec = OnlineMedusaSpeculator(heads, topo, cfg, background=False)
    engine = SpeculativeEngine(HFTarget(tiny64), tiny64.tokenizer, spec, loaded=tiny64)
    taus = []
    for _ in range(6):
        out = engine.generate(PROMPTS[0], max_new_tokens=40, ignore_eos=True)
        taus.append(out.stats.mean_accepted)
        while spec.trainer.train_round():
            pass
    assert spec.trainer.steps >= 10 and spec.version >= 2
    assert spec.trainer.last_loss is not None
    assert taus[-1] > taus[0], taus  # the heads now draft this answer


def test_save_and_restore(tiny64, heads_dir, tmp_path):
    heads = load_medusa(heads_dir)
    topo = load_topology("sparse-8", heads.config.num_heads)
    spec = OnlineMedusaSpeculator(heads, topo, OnlineConfig(), background=False)
    with torch.no_grad():
        spec.trainer._shadow.heads[0].proj.weight.add_(1.0)
    spec.trainer.publish()
    spec.save(tmp_path / "state")
    spec.save(tmp_path / "state")  # replacing an existing state
    restored = SpeculativeEngine.from_pretrained(
        tiny64, speculator=options_for("osd", heads=str(heads_dir), state=str(tmp_path / "state"))
    ).speculator
    assert fingerprint(restored.trainer.published.heads) == fingerprint(
        spec.trainer.published.heads
    )
    restored.close()


def test_bad_configurations(tiny64, other_vocab_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="osd:heads=DIR"):
        SpeculativeEngine.from_pretrained(tiny64, speculator="osd")
    with pytest.raises(CheckpointError):
        SpeculativeEngine.from_pretrained(
            tiny64, speculator=options_for("osd", heads=str(other_vocab_model_dir))
        )
    with pytest.raises(ConfigError):
        OnlineConfig(batch=0)
    with pytest.raises(ConfigError, match="warmup"):
        OnlineConfig(warmup=-1)


def test_learning_rate_warms_up(heads_dir):
    """The first online steps move a trained head little (Adam's first steps move every
    weight by about lr, which measurably hurt in-domain acceptance before the warm-up)."""
    cfg = OnlineConfig(batch=4, min_examples=4, steps_per_round=1, lr=1e-3, warmup=4)
    trainer = OnlineTrainer(load_medusa(heads_dir), cfg)
    k, h = trainer.num_heads, load_medusa(heads_dir).config.hidden_size
    lrs = []
    for _ in range(6):
        trainer.add(torch.randn(4, h), torch.randint(0, 50, (4, k)))
        assert trainer.train_round()
        lrs.append(trainer._opt.param_groups[0]["lr"])
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


def test_auto_guards_the_learner_with_the_static_heads(tiny64, heads_dir, tmp_path):
    arms = (
        *(parse_spec(n) for n in ("prompt-lookup", "suffix", "lookahead")),
        options_for("medusa", dir=str(heads_dir)),
        options_for("osd", heads=str(heads_dir), state=str(tmp_path / "s")),
    )
    engine = SpeculativeEngine.from_pretrained(tiny64, speculator=options_for("auto", arms=arms))
    auto = engine.arms
    assert auto is not None
    assert {"medusa", "osd"} <= set(auto.arms)
    assert next(s for s in auto.specs if s.name == "osd").guard == "medusa"
    for prompt in PROMPTS:
        plain = engine.generate(prompt, max_new_tokens=24, ignore_eos=True, speculate=False)
        assert engine.generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids == (
            plain.token_ids
        )
    assert auto.arms["osd"].trainer.examples > 0  # it watched every step, drafting or not
    auto.arms["osd"].close()


def test_trainer_thread_stops(tiny64, heads_dir):
    trainer = OnlineTrainer(load_medusa(heads_dir), OnlineConfig())
    trainer.start()
    thread = trainer._thread
    assert thread is not None and thread.is_alive()
    trainer.stop()
    assert not thread.is_alive()


def test_the_tree_is_resized_from_accuracy_measured_before_training(heads_dir):
    """Each round measures the heads on traffic they have not trained on yet, and the published
    tree is the sizing rule applied to those accuracies: heads that predict the traffic get a
    deeper tree, with more expected accepted tokens, than the checkpoint's prior figures gave."""
    heads = load_medusa(heads_dir)
    cfg = OnlineConfig(batch=64, min_examples=64, steps_per_round=1, publish_every=1, lr=1e-6,
                       accuracy_prior=256, accuracy_window=512)  # fmt: skip
    trainer = OnlineTrainer(heads, cfg, sizer=best_sized_topology)
    prior = trainer.accuracy()
    profile = generic_profile()[: heads.config.num_heads]  # the heads carry no figures of their own
    assert [a for row in prior for a in row] == pytest.approx([a for row in profile for a in row])
    h = torch.randn(64, heads.config.hidden_size)
    with torch.no_grad():
        labels = heads.to_target_ids(heads(h).argmax(-1))  # [64, K]: what the heads predict
    trainer.add(h, labels)
    assert trainer.train_round()
    decay = math.exp(-64 / 512)
    measured = trainer.accuracy()
    for k in range(heads.config.num_heads):  # rank 0 was right on all 64 new examples
        assert measured[k][0] == pytest.approx(
            (prior[k][0] * 256 * decay + 64) / (256 * decay + 64)
        )
        assert measured[k][1] == pytest.approx(prior[k][1] * 256 * decay / (256 * decay + 64))
    published = trainer.published
    assert published.heads.config.accuracy == measured
    assert published.topology == best_sized_topology(measured)
    for _ in range(5):  # more of the same traffic: the measured figures approach 1
        h = torch.randn(64, heads.config.hidden_size)
        with torch.no_grad():
            trainer.add(h, heads.to_target_ids(heads(h).argmax(-1)))
        assert trainer.train_round()
    assert min(row[0] for row in trainer.accuracy()) > 0.75
    tree, start = trainer.published.topology, best_sized_topology(prior)
    assert max(map(len, tree)) == heads.config.num_heads > max(map(len, start))  # deeper
    assert expected_accepted(tree, trainer.accuracy()) > expected_accepted(start, prior)


def test_a_restored_learner_starts_from_its_resized_tree(tiny64, heads_dir, tmp_path):
    engine = SpeculativeEngine.from_pretrained(
        tiny64, speculator=options_for("osd", heads=str(heads_dir), state=str(tmp_path / "state"))
    )
    spec = engine.speculator
    spec.trainer.stop()  # drive the rounds here
    for prompt in PROMPTS * 2:
        engine.generate(prompt, max_new_tokens=40, ignore_eos=True)
        while spec.trainer.train_round():
            pass
    assert spec.version > 0
    # the default tree: the calibrated tree from the published accuracies, sized (at the prior
    # costs) by the rule static Medusa uses
    assert spec.current_topology == best_sized_topology(head_accuracy(spec.trainer.published.heads))
    spec.save(tmp_path / "state")
    restored = SpeculativeEngine.from_pretrained(
        tiny64, speculator=options_for("osd", heads=str(heads_dir), state=str(tmp_path / "state"))
    ).speculator
    assert restored.current_topology == spec.current_topology
    restored.close()
    fixed = SpeculativeEngine.from_pretrained(
        tiny64, speculator=options_for("osd", heads=str(heads_dir), tree="sparse-8")
    ).speculator
    fixed.trainer.publish()
    assert fixed.current_topology == load_topology("sparse-8", 3)  # a named tree stays fixed
    fixed.close()
