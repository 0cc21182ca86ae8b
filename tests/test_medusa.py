"""Self-distilled data, Medusa heads (training, checkpoints, tree drafting), tree topologies,
typical acceptance, and the target's hidden-state features — on tiny random-weight models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specdec import SpeculativeEngine
from specdec.config import GenerationConfig, SamplingConfig
from specdec.errors import CheckpointError, ConfigError, DataError
from specdec.heads.medusa import IGNORE, MedusaConfig, MedusaHeads, candidate_hits, load_medusa
from specdec.speculators import options_for
from specdec.target import HFTarget, ModelRunner, load_model
from specdec.training.data import generate_data, load_data, load_prompts, prompt_order
from specdec.training.medusa import MedusaTrainConfig, train_medusa
from specdec.tree import DraftTree
from specdec.tree.topology import (
    accepted_lengths,
    calibrated_topology,
    expected_accepted,
    load_topology,
    preset_names,
    tree_from_topology,
    validate_topology,
)
from specdec.verify import TypicalAcceptanceRule

PROMPTS = [
    "ROMEO: But soft, what light through yonder window breaks?",
    "JULIET: O Romeo, Romeo! wherefore art thou Romeo?",
    "Tell me about the king and the queen.",
    "What news from the court today?",
    "Speak of love and war.",
    "Where is the prince tonight?",
]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("prompts") / "train.jsonl"
    p.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in PROMPTS))
    return p


@pytest.fixture(scope="module")
def data_dir(tiny, prompt_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sd")
    generate_data(tiny, prompt_file, out, max_new_tokens=24, batch_size=4, shard_size=4)
    return out


@pytest.fixture(scope="module")
def medusa_dir(tiny, data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("medusa")
    cfg = MedusaTrainConfig(
        num_heads=3,
        draft_vocab=96,
        max_steps=150,
        batch_positions=32,
        lr=1e-2,
        eval_every=50,
        held_out=0.0,  # six prompts of a random model: measure on what it learnt
    )
    train_medusa(tiny, load_data(data_dir, tiny), out, cfg)
    return out


# -- self-distilled data ------------------------------------------------------------------------
def test_data_is_the_targets_own_greedy_output(tiny, data_dir: Path):
    data = load_data(data_dir, tiny)
    assert len(data.records) == len(PROMPTS)
    assert sorted(r.index for r in data.records) == list(range(len(PROMPTS)))
    # stored in the seeded order, whatever the batching did
    assert [r.index for r in data.records] == prompt_order(len(PROMPTS), 0)
    engine = SpeculativeEngine.from_pretrained(tiny)
    for r in data.records[:3]:
        ids = []
        for ev in engine.stream_ids(
            list(r.tokens[: r.prompt_len]), GenerationConfig(24), speculate=False
        ):
            ids.extend(ev.token_ids)
        response = list(r.response)
        if response and response[-1] in tiny.eos_token_ids:
            response = response[:-1]
        assert ids == response


def test_data_generation_resumes_and_refuses_other_settings(tiny, prompt_file, tmp_path):
    out = tmp_path / "sd"
    m1 = generate_data(tiny, prompt_file, out, max_new_tokens=8, limit=4, shard_size=2)
    assert m1.records == 4 and len(m1.shards) == 2
    first = (out / m1.shards[0]).stat().st_mtime_ns
    (out / m1.shards[1]).unlink()  # an interrupted run lost its last shard
    m2 = generate_data(tiny, prompt_file, out, max_new_tokens=8, limit=6, shard_size=2)
    assert m2.records == 6 and len(m2.shards) == 3
    assert (out / m1.shards[0]).stat().st_mtime_ns == first  # finished shards are kept
    with pytest.raises(DataError, match="other settings"):
        generate_data(tiny, prompt_file, out, max_new_tokens=9, shard_size=2)


def test_data_selects_categories_from_its_prompt_file(tiny, tmp_path):
    """``--categories`` / ``--exclude-categories``: records are picked by the category of the
    prompt they answer, read back from the prompt file the manifest names."""
    prompts = tmp_path / "p.jsonl"
    cats = ["chat", "code", "chat", "translation", "code", "chat"]
    prompts.write_text(
        "".join(
            json.dumps({"prompt": t, "category": c}) + "\n"
            for t, c in zip(PROMPTS, cats, strict=True)
        )
    )
    out = tmp_path / "sd"
    generate_data(tiny, prompts, out, max_new_tokens=4, batch_size=6, shard_size=6)
    data = load_data(out, tiny)
    by_index = {r.index: r for r in data.records}
    assert data.categories() == [cats[r.index] for r in data.records]
    chat = data.select(["chat"])
    assert sorted(r.index for r in chat.records) == [0, 2, 5]
    assert all(by_index[r.index] == r for r in chat.records)
    rest = data.select(exclude=["translation", "code"])
    assert sorted(r.index for r in rest.records) == [0, 2, 5]
    assert rest.selection == {"exclude_categories": ["translation", "code"]}  # saved by trainers
    assert data.select() is data
    with pytest.raises(DataError, match="unknown category cod;"):
        data.select(["cod"])
    with pytest.raises(DataError, match="no record is left"):
        data.select(["chat"], exclude=["chat"])
    prompts.write_text(prompts.read_text() + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(DataError, match="changed since this data was generated"):
        data.categories()


def test_data_errors(tiny, prompt_file, data_dir, tmp_path, tiny_draft_dir):
    with pytest.raises(DataError, match="does not exist"):
        load_data(tmp_path / "nope")
    with pytest.raises(DataError, match="no manifest"):
        load_data(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(DataError, match=r"bad.jsonl:2"):
        load_prompts(bad)
    evaldir = tmp_path / "eval"
    evaldir.mkdir()
    (evaldir / "q.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(DataError, match="evaluation set"):
        generate_data(tiny, evaldir / "q.jsonl", tmp_path / "o")
    other = load_model(tiny_draft_dir)
    with pytest.raises(DataError, match="another target"):
        load_data(data_dir, other)
    # a truncated shard is named, not a crash
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in data_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    shard = sorted(broken.glob("shard-*"))[0]
    shard.write_bytes(shard.read_bytes()[:50])
    with pytest.raises(DataError, match="truncated or corrupt"):
        load_data(broken)


# -- topologies --------------------------------------------------------------------------------
def test_calibrated_topology_is_greedy_optimal_on_a_worked_example():
    acc = [[0.6, 0.3], [0.5, 0.2]]
    top = calibrated_topology(acc, 4)
    # values: (0,) .6, (0,0) .3, (1,) .3, (0,1) .12, (1,0) .15
    assert top[:2] == ((0,), (0, 0)) and set(top[2:]) == {(1,), (1, 0)}
    assert expected_accepted(top, acc) == pytest.approx(0.6 + 0.3 + 0.3 + 0.15)
    for name in preset_names():
        validate_topology(load_topology(name, 4))


def test_topology_errors(tmp_path):
    with pytest.raises(ConfigError, match="before its parent"):
        validate_topology([[0, 0], [0]])
    with pytest.raises(ConfigError, match="only 2 heads"):
        load_topology("sparse-64", 2)
    f = tmp_path / "t.json"
    f.write_text("[[0], [1], [0, 0]]")
    assert load_topology(str(f), 2) == ((0,), (1,), (0, 0))
    with pytest.raises(ConfigError, match="unknown tree"):
        load_topology("no-such-tree", 4)


def test_tree_from_topology_truncates_to_a_valid_prefix():
    top = ((0,), (1,), (0, 0), (1, 0), (0, 0, 0))
    t = tree_from_topology(7, top, [[1, 2], [3, 4], [5]], budget=3)
    assert t.tokens == (7, 1, 2, 3) and t.parents == (-1, 0, 0, 1)


# -- heads and checkpoints ---------------------------------------------------------------------
def test_medusa_training_learns_and_records_accuracy(medusa_dir: Path):
    cfg = json.loads((medusa_dir / "config.json").read_text())
    assert cfg["specdec_model_type"] == "medusa" and cfg["num_heads"] == 3
    assert len(cfg["accuracy"]) == 3 and len(cfg["accuracy"][0]) == 10
    # six memorisable sequences: the heads must learn them (untrained: about 0.1)
    assert min(a[0] for a in cfg["accuracy"]) > 0.8
    heads = load_medusa(medusa_dir)
    distinct = {id(h) for h in heads.heads} | {id(b) for h in heads.heads for b in h.blocks}
    assert len(distinct) == 3 + 3  # independent modules, no shared block
    assert heads.heads[0].proj.weight.data_ptr() != heads.heads[1].proj.weight.data_ptr()
    info = cfg["training"]
    # the served tree's measured tokens per step on these (memorised) positions
    assert 1 <= info["calibrated_tree_nodes"] and info["held_out_simulated_tau"] > 2.0


def test_original_medusa_format_loads_with_the_same_outputs(tmp_path):
    cfg = MedusaConfig(hidden_size=8, vocab_size=20, num_heads=2, num_layers=1)
    torch.manual_seed(0)
    heads = MedusaHeads(cfg)
    for p in heads.parameters():
        p.data.normal_()
    raw = {}
    for i, head in enumerate(heads.heads):
        raw[f"{i}.0.linear.weight"] = head.blocks[0].linear.weight.data
        raw[f"{i}.0.linear.bias"] = head.blocks[0].linear.bias.data
        raw[f"{i}.1.weight"] = head.proj.weight.data
    save_file(raw, str(tmp_path / "medusa_lm_head.safetensors"))
    (tmp_path / "config.json").write_text(
        json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "x"})
    )
    loaded = load_medusa(tmp_path)
    h = torch.randn(3, 8)
    torch.testing.assert_close(loaded(h), heads(h))


def test_checkpoint_errors(tiny, medusa_dir: Path, tmp_path, tiny_draft_dir):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_medusa(tmp_path / "none")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((medusa_dir / "config.json").read_text())
    (broken / "medusa.safetensors").write_bytes(
        (medusa_dir / "medusa.safetensors").read_bytes()[:99]
    )
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_medusa(broken)
    with pytest.raises(CheckpointError, match="another"):
        SpeculativeEngine.from_pretrained(
            tiny_draft_dir, speculator=options_for("medusa", dir=str(medusa_dir))
        )
    with pytest.raises(ConfigError, match="only 3 heads"):
        SpeculativeEngine.from_pretrained(
            tiny, speculator=options_for("medusa", dir=str(medusa_dir), tree="sparse-64")
        )
    with pytest.raises(ConfigError, match="needs dir="):
        SpeculativeEngine.from_pretrained(tiny, speculator="medusa")


# -- decoding with Medusa trees ------------------------------------------------------------------
@pytest.mark.parametrize("tree", ["calibrated:12", "calibrated:2", "chain-file"])
def test_medusa_greedy_equals_plain_decoding(tiny, medusa_dir: Path, tree: str, tmp_path):
    """Greedy output equals plain greedy decoding on the same target. Both decode in float32:
    every argmax compared comes from the same kind of pass, and the tiny model's large init
    keeps ties out (see conftest), so this is exact equality."""
    if tree == "chain-file":
        tree = str(tmp_path / "chain.json")
        Path(tree).write_text("[[0], [0, 0], [0, 0, 0]]")
    engine = SpeculativeEngine.from_pretrained(
        tiny, speculator=options_for("medusa", dir=str(medusa_dir), tree=tree)
    )
    for prompt in PROMPTS[:3]:
        plain = engine.generate(prompt, max_new_tokens=40, ignore_eos=True, speculate=False)
        spec = engine.generate(prompt, max_new_tokens=40, ignore_eos=True)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.target_forwards <= plain.stats.target_forwards
    assert spec.stats.drafted_tokens > 0


def test_medusa_accepts_on_training_prompts(tiny, medusa_dir: Path):
    """On the prompts it was trained on, the heads draft tokens that get accepted (tau > 1)."""
    engine = SpeculativeEngine.from_pretrained(
        tiny, speculator=options_for("medusa", dir=str(medusa_dir))
    )
    res = engine.generate(PROMPTS[0], max_new_tokens=24, chat=True)
    assert res.stats.mean_accepted > 1.0


def test_medusa_sampling_is_seeded_and_lossless_flagged(tiny, medusa_dir: Path):
    engine = SpeculativeEngine.from_pretrained(
        tiny, speculator=options_for("medusa", dir=str(medusa_dir))
    )
    a = engine.generate(PROMPTS[1], max_new_tokens=20, temperature=0.9, seed=3)
    b = engine.generate(PROMPTS[1], max_new_tokens=20, temperature=0.9, seed=3)
    assert a.token_ids == b.token_ids and a.stats.lossless
    typical = SpeculativeEngine.from_pretrained(
        tiny, speculator=options_for("medusa", dir=str(medusa_dir)), typical_acceptance=True
    )
    c = typical.generate(PROMPTS[1], max_new_tokens=20, temperature=0.9, seed=3)
    assert not c.stats.lossless and c.stats.to_dict()["lossless"] is False
    assert typical.generate(PROMPTS[1], max_new_tokens=5).stats.lossless is False


# -- hidden-state features -----------------------------------------------------------------------
def test_features_are_the_final_hidden_states_of_the_committed_positions(tiny):
    target = HFTarget(tiny)
    target.enable_features()
    prompt = [5, 17, 42, 8, 9]
    target.begin(prompt)
    ref = tiny.model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][
        0
    ]
    torch.testing.assert_close(target.features, ref[:-1], atol=1e-4, rtol=1e-4)
    tree = DraftTree(tokens=(9, 30, 31, 32), parents=(-1, 0, 0, 2))
    target.verify(tree)
    target.commit([0, 2, 3])  # keep 9, 31, 32
    seq = prompt + [31, 32]
    ref = tiny.model(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(target.features, ref[-3:], atol=1e-4, rtol=1e-4)
    assert len(ModelRunner(tiny.model).cache) == 0


# -- typical acceptance ----------------------------------------------------------------------
def test_typical_acceptance_worked_example():
    rule = TypicalAcceptanceRule(epsilon=0.09, alpha=0.3)
    assert not rule.lossless
    # p at the root: token 1 has 0.5 (typical), token 2 has 0.02 (not)
    logits = torch.log(torch.tensor([[0.48, 0.5, 0.02], [0.4, 0.3, 0.3], [0.4, 0.3, 0.3]]))
    tree = DraftTree(tokens=(0, 2, 1), parents=(-1, 0, 0))
    acc = rule.accept(
        tree, logits, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0)
    )
    assert acc.path == (0, 2) and acc.tokens[0] == 1
    with pytest.raises(ConfigError):
        TypicalAcceptanceRule(epsilon=0.0)


def test_chained_accuracies_multiply_to_a_chains_acceptance():
    """Heads whose errors coincide (the usual case): head 2 is right exactly where head 1 is.
    Counted after a right chain, the figures multiply to the chain's true acceptance; the
    unconditional ones would predict half of it for the second token."""
    labels = torch.tensor([[5, 6], [5, 6], [7, 8], [7, 8]])  # [B=4, K=2]
    wrong = torch.tensor([[9, 9], [9, 9]])
    top = torch.stack([labels[0], labels[1], wrong[0], wrong[1]])[..., None]  # [4, 2, R=1]
    match, valid, chained = candidate_hits(top, labels)
    assert valid.all()
    assert chained.tolist() == [[True, True], [True, True], [True, False], [True, False]]
    conditional = [
        float((match[:, k, 0] & chained[:, k]).sum() / chained[:, k].sum()) for k in (0, 1)
    ]
    unconditional = match[..., 0].float().mean(0).tolist()
    chain = ((0,), (0, 0))
    true_accepted = 2 * 0.5  # half the positions accept both tokens, the rest none
    assert expected_accepted(chain, [[a] for a in conditional]) == pytest.approx(true_accepted)
    assert expected_accepted(chain, [[a] for a in unconditional]) == pytest.approx(0.75)
    labels[0, 1] = IGNORE  # a head without a label is neither counted nor chained
    _, valid, chained = candidate_hits(top, labels)
    assert not valid[0, 1] and not chained[0, 1]


def test_accepted_lengths_follow_a_greedy_walk_of_the_instantiated_tree():
    """The simulated tau counts, per position, what greedy verification of the tree built from
    the heads' candidates would accept: walk from the root to the child holding the next true
    token while there is one. Small vocabularies make partial and full hits common."""
    gen = torch.Generator().manual_seed(0)
    topology = calibrated_topology([[0.6, 0.3, 0.1], [0.5, 0.3, 0.1], [0.4, 0.3, 0.1]], 12)
    for _ in range(300):
        vocab = int(torch.randint(3, 7, (1,), generator=gen))
        top = torch.stack([torch.randperm(vocab, generator=gen)[:3] for _ in range(3)])  # [K, R]
        labels = torch.randint(0, vocab, (3,), generator=gen)  # [K]
        match, _, _ = candidate_hits(top[None], labels[None])
        tree = tree_from_topology(99, topology, top.tolist(), budget=len(topology))
        node, walked = 0, 0
        while walked < 3:
            children = [i for i, p in enumerate(tree.parents) if p == node]
            right = [c for c in children if tree.tokens[c] == int(labels[walked])]
            if not right:
                break
            node, walked = right[0], walked + 1
        assert int(accepted_lengths(topology, match)[0]) == walked


def test_training_on_a_fixed_held_out_set(tiny, data_dir: Path, tmp_path):
    """``held_out_records`` measures on exactly those answers and keeps them out of training,
    so checkpoints trained on different amounts of data compare on the same positions."""
    data = load_data(data_dir, tiny)
    held = data.records[:1]
    # with half of the loss on the target's distributions (the path runs end to end)
    cfg = MedusaTrainConfig(
        num_heads=2, draft_vocab=96, max_steps=2, batch_positions=16, soft_weight=0.5
    )
    res = train_medusa(tiny, data, tmp_path / "m", cfg, held_out_records=held)
    r = held[0]
    assert res.held_out_positions == len(r.tokens) - r.prompt_len  # one per response token
    train_total = sum(len(x.tokens) - x.prompt_len for x in data.records)
    assert res.train_positions == train_total - res.held_out_positions
    with pytest.raises(DataError, match="every record is held out"):
        train_medusa(tiny, data, tmp_path / "m2", cfg, held_out_records=data.records)
    with pytest.raises(ConfigError, match="--soft-weight"):
        MedusaTrainConfig(soft_weight=1.5)


def test_soft_targets_are_the_targets_prediction_of_each_heads_label(tiny, data_dir: Path):
    """Head k's soft target at row i is read from cached row i + k + 1. On greedy data from
    the same model, the argmax of that distribution must be the label itself wherever the
    extraction pass agrees with generation (``target_agreement``; asserted to be all of them
    here, so a misaligned row shows up as a mismatch rather than being averaged away)."""
    from specdec.target.numerics import dense_weight
    from specdec.training.medusa import extract_features, teacher_probs

    data = load_data(data_dir, tiny)
    feats = extract_features(tiny, data.records, num_heads=3)
    assert feats.target_agreement == 1.0
    teacher = dense_weight(tiny.model.get_output_embeddings()).float()  # [V, H]
    idx = torch.arange(len(feats))
    probs = teacher_probs(feats.hidden, idx, feats.labels, teacher)  # [P, K, V]
    has = feats.labels != IGNORE
    assert has[:, 2].any()
    assert torch.equal(probs.argmax(-1)[has], feats.labels[has])
    # shifted by one row, the same tensors disagree: the test can tell alignment apart
    shifted = teacher_probs(
        feats.hidden, (idx + 1).clamp_max(len(feats) - 1), feats.labels, teacher
    )
    assert not torch.equal(shifted.argmax(-1)[has], feats.labels[has])


def test_feature_cache_extracts_only_answers_it_does_not_hold(tiny, data_dir: Path, tmp_path):
    """Data grows between trainings (``data generate`` resumes with a larger --limit); the
    cache keys every answer, so only new answers cost a target pass, and what comes back is
    exactly what a fresh extraction gives."""
    from specdec.training.feature_cache import (
        PER_RECORD_FORMAT,
        features_per_record,
        fingerprint,
        record_digest,
        save_cached,
        store_dir,
    )
    from specdec.training.medusa import extract_features

    records = load_data(data_dir, tiny).records
    cache = tmp_path / "f.safetensors"
    calls: list[int] = []

    def extract(r):  # tensors of different row counts, and one skipped record
        calls.append(r.index)
        if r.index == records[0].index:
            return None
        return {"x": torch.tensor([[r.index, len(r.tokens)]]), "n": torch.arange(r.index % 3)}

    first = features_per_record(cache, records[:3], {"m": 1}, "s", extract)
    assert calls == [r.index for r in records[:3]] and first[0] is None
    calls.clear()
    every = features_per_record(cache, records, {"m": 1}, "s", extract)
    assert calls == [r.index for r in records[3:]]
    assert every[0] is None
    for a, b in zip(first[1:], every[1:3], strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("x", "n"))
    calls.clear()
    features_per_record(cache, records[3:4], {"m": 1}, "s", extract)  # a subset's run
    features_per_record(cache, records, {"m": 1}, "s", extract)
    assert calls == []  # ... kept every answer for the next run on the whole set
    interrupted = tmp_path / "i.safetensors"

    def fails_at_third(r):
        if len(calls) == 2:
            raise KeyboardInterrupt
        return extract(r)

    with pytest.raises(KeyboardInterrupt):
        features_per_record(interrupted, records, {"m": 1}, "s", fails_at_third, save_every=0)
    calls.clear()
    features_per_record(interrupted, records, {"m": 1}, "s", extract)
    assert calls == [r.index for r in records[2:]]  # resumed after the saved answers
    calls.clear()
    features_per_record(cache, records, {"m": 1}, "other settings", extract)
    assert len(calls) == len(records)  # other settings never reuse features
    (store_dir(cache) / "index.json").write_bytes(b"not an index")
    calls.clear()
    features_per_record(cache, records, {"m": 1}, "s", extract)
    assert len(calls) == len(records)  # a broken cache is rebuilt
    with (store_dir(cache) / "x.bin").open("r+b") as f:
        f.truncate(8)  # a data file shorter than its index: rebuilt too
    calls.clear()
    features_per_record(cache, records, {"m": 1}, "s", extract)
    assert len(calls) == len(records)

    # the single safetensors file an earlier version wrote is imported, not extracted again
    legacy = tmp_path / "old.safetensors"
    rows = [extract(r) for r in records]
    kept = [(record_digest(r), x) for r, x in zip(records, rows, strict=True) if x is not None]
    tensors = {}
    for name in ("n", "x"):
        tensors[name] = torch.cat([x[name] for _, x in kept])
        tensors[f"rows.{name}"] = torch.tensor([len(x[name]) for _, x in kept])
    meta = {"format": PER_RECORD_FORMAT, "kept": json.dumps([d for d, _ in kept]),
            "skipped": json.dumps([record_digest(records[0])])}  # fmt: skip
    save_cached(legacy, fingerprint((), {"m": 1}, "s"), tensors, meta)
    calls.clear()
    imported = features_per_record(legacy, records, {"m": 1}, "s", extract)
    assert calls == [] and imported[0] is None and not legacy.exists()
    for a, b in zip(rows[1:], imported[1:], strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("x", "n"))

    real = tmp_path / "real.safetensors"
    extract_features(tiny, records[:2], 3, real)
    grown = extract_features(tiny, records, 3, real)
    fresh = extract_features(tiny, records, 3)
    assert torch.equal(grown.hidden, fresh.hidden) and torch.equal(grown.labels, fresh.labels)
    assert grown.target_agreement == fresh.target_agreement


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_training_with_the_target_on_cuda(tiny_model_dir: Path, data_dir: Path, tmp_path):
    """`specdec train medusa --device cuda`: features from the target on the GPU (cached on the
    CPU), heads trained there, with the soft labels too; the saved heads serve a CPU target
    losslessly."""
    on_gpu = load_model(tiny_model_dir, device="cuda")
    cfg = MedusaTrainConfig(num_heads=3, draft_vocab=96, max_steps=150, batch_positions=32,
                            lr=1e-2, eval_every=150, held_out=0.0, soft_weight=0.5)  # fmt: skip
    res = train_medusa(on_gpu, load_data(data_dir, on_gpu), tmp_path, cfg)
    assert res.top1[0] > 0.3 and res.simulated_tau > 1.2
    cpu = load_model(tiny_model_dir)
    engine = SpeculativeEngine.from_pretrained(
        cpu, speculator=options_for("medusa", dir=str(tmp_path))
    )
    plain = engine.generate(PROMPTS[0], max_new_tokens=20, ignore_eos=True, speculate=False)
    assert (
        engine.generate(PROMPTS[0], max_new_tokens=20, ignore_eos=True).token_ids == plain.token_ids
    )
