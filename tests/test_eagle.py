"""EAGLE drafters: the head's incremental passes, EAGLE-2's dynamic tree (its mask, selection
and sizing), training with training-time test, greedy equivalence on tiny real models, and
lossless sampling through the statistical test of test_losslessness.

Greedy equivalence runs in float32 on the tiny models, whose large init keeps argmax ties out
(see conftest); both runs take every argmax from the target's own passes, so the comparison is
exact equality of token ids.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from torch import nn

from specdec import SpeculativeEngine
from specdec.control.budget import CostModel
from specdec.errors import CheckpointError, ConfigError
from specdec.heads.eagle import (
    EagleConfig,
    EagleHead,
    causal_prefix_mask,
    extend_kv,
    layer_config_from,
)
from specdec.speculators import DraftContext, options_for
from specdec.speculators.eagle import EagleSpeculator, EagleTree
from specdec.target import HFTarget, LoadedModel, load_model
from specdec.target.numerics import dense_weight
from specdec.testing import MarkovTarget, word_tokenizer
from specdec.training.data import generate_data, load_data
from specdec.training.eagle import (
    EagleTrainConfig,
    build_head,
    evaluate,
    extract_sequence_features,
    readout_for,
)
from specdec.tree import DraftTree
from specdec.verify import make_generator
from tests.test_losslessness import ALPHA, V, lossless_pvalue, tables

PROMPTS = [
    "ROMEO: But soft, what light through yonder window breaks?",
    "JULIET: O Romeo, Romeo! wherefore art thou Romeo?",
    "Tell me about the king and the queen.",
    "What news from the court today?",
]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> LoadedModel:
    return load_model(tiny_model_dir)


def random_head(loaded: LoadedModel, variant: str, seed: int = 0) -> EagleHead:
    cfg = loaded.model.config
    reduced = variant == "eagle3"
    config = EagleConfig(
        variant=variant,
        layer=layer_config_from(cfg),
        vocab_size=cfg.vocab_size,
        target_hidden_size=cfg.hidden_size,
        aux_layers=(1, 2, 3) if variant == "eagle3" else (-1,),
        draft_vocab_size=200 if reduced else None,
        fc_bias=variant == "eagle1",
    )
    torch.manual_seed(seed)
    head = EagleHead(
        config,
        loaded.model.get_input_embeddings().weight,
        dense_weight(loaded.model.get_output_embeddings()),
    )
    if reduced:
        head.set_vocabulary(torch.randperm(cfg.vocab_size)[:200])
    return head.eval()


# -- the head ------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["eagle1", "eagle3"])
def test_incremental_passes_equal_one_causal_pass(tiny, variant):
    head = random_head(tiny, variant)
    width = 3 * 64 if variant == "eagle3" else 64
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 7, width, generator=g)
    tokens = torch.randint(0, 300, (1, 7), generator=g)
    pos = torch.arange(7)[None]
    with torch.no_grad():
        full, _ = head(head.fuse(feats), tokens, pos)
        a, kv = head(head.fuse(feats[:, :4]), tokens[:, :4], pos[:, :4])
        b, _ = head(head.fuse(feats[:, 4:]), tokens[:, 4:], pos[:, 4:], kv)
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=1e-5, rtol=1e-5)


def test_the_drafting_copy_runs_int8_blocks_close_to_the_trained_head(tiny):
    """On a CPU with the kernel, the drafting copy's linears are Q8_0 blocks (half of fp16's
    bytes): its states stay within int8 rounding of the trained head's, its top tokens agree,
    and the head itself is untouched (still trainable, still fp32)."""
    from specdec.heads.eagle import for_inference
    from specdec.target import kquant

    if not kquant.extension().has_simd():
        pytest.skip("the kernel's SIMD paths are not on this CPU")
    head = random_head(tiny, "eagle3")
    fast = for_inference(head)
    linears = [m for m in fast.modules() if isinstance(m, kquant.KQuantLinear)]
    assert linears and not any(isinstance(m, nn.Linear) for m in fast.modules())
    assert all(isinstance(m, nn.Linear) for m in (head.fc, head.lm_head))
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 7, 3 * 64, generator=g)
    tokens = torch.randint(0, 300, (1, 7), generator=g)
    pos = torch.arange(7)[None]
    with torch.no_grad():
        want, _ = head(head.fuse(feats), tokens, pos)
        got, _ = fast(fast.fuse(feats), tokens, pos)
        err = (got - want).norm() / want.norm()
        same = (head.logits(want).argmax(-1) == fast.logits(got).argmax(-1)).float().mean()
    assert 0 < err < 0.05 and same >= 6 / 7


def test_a_linear_of_partial_blocks_keeps_fp16_weights():
    from specdec.heads.eagle import cpu_linear_maker
    from specdec.target import kquant

    make = cpu_linear_maker()
    assert not isinstance(make(nn.Linear(40, 8)), kquant.KQuantLinear | nn.Linear)
    with pytest.raises(ConfigError, match="32-weight blocks"):
        kquant.KQuantLinear.q8_from_float(nn.Linear(40, 8))


def test_reduced_vocabulary_maps_draft_ids_to_target_ids(tiny):
    head = random_head(tiny, "eagle3")
    ids = head.draft_token_ids()
    assert len(set(ids.tolist())) == 200
    assert bool(head.t2d[ids].all()) and int(head.t2d.sum()) == 200
    assert torch.equal(head.to_target_ids(torch.arange(200)), ids)


def test_target_keeps_the_requested_hidden_layers(tiny):
    target = HFTarget(tiny)
    target.enable_features((1, 3, -1))
    prompt = [5, 17, 42, 8]
    target.begin(prompt)
    ref = tiny.model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
    want = torch.cat([ref[1][0], ref[3][0], ref[-1][0]], -1)[:-1]
    torch.testing.assert_close(target.features, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ConfigError, match="out of range"):
        HFTarget(tiny).enable_features((9,))


# -- the dynamic tree ----------------------------------------------------------------------------
def verify_costs(slope: float) -> CostModel:
    """Frozen verification costs T(n)/T(1) = 1 + slope (n - 1): slope 0 makes every node free."""
    return CostModel(prior_slope=slope, frozen=True)


FREE = verify_costs(0.0)


def _context(
    tiny: LoadedModel, tokens: list[int], layers: Sequence[int], costs: CostModel | None = FREE
) -> DraftContext:
    target = HFTarget(tiny)
    target.enable_features(layers)
    target.begin(tokens)
    from specdec.config import SamplingConfig

    return DraftContext(
        tokens, len(tokens), SamplingConfig(), make_generator(0), target.features, costs
    )


@pytest.mark.parametrize("variant", ["eagle1", "eagle3"])
def test_every_tree_node_is_drafted_from_its_own_path(tiny, variant):
    """The tree mask lets each expanded node see the committed prefix and its ancestors only:
    its state equals running the (same, drafting) head causally along its own path."""
    head = random_head(tiny, variant)
    spec = EagleSpeculator(head, EagleTree(depth=4, top_k=3, total_tokens=30))
    tokens = [5, 17, 42, 8, 9, 11, 60]
    context = _context(tiny, tokens, head.config.aux_layers)
    with torch.no_grad():
        h_root = spec.absorb(context)
        assert h_root is not None
        committed = spec._past
        nodes = spec._expand(h_root, root_pos=len(tokens) - 1, slope=0.0)  # nodes are free
        deep = [i for i, n in enumerate(nodes) if n.depth == 4]
        assert deep and len({nodes[i].parent for i in deep}) > 1  # it branched
        for leaf in deep[:4]:
            path = []
            a = leaf
            while a >= 0:
                path.append(a)
                a = nodes[a].parent
            path.reverse()  # depth 1 .. 4
            state, past = h_root, committed
            for depth, i in enumerate(path[:-1], start=1):
                out, kv = spec.head(
                    state[None, None],
                    torch.tensor([[nodes[i].token]]),
                    torch.tensor([[len(tokens) - 2 + depth]]),
                    past,
                    causal_prefix_mask(1, past[0].shape[2]),
                )
                past = extend_kv(past, kv)
                state = out[0, 0]
            torch.testing.assert_close(nodes[leaf].state, state, atol=1e-5, rtol=1e-5)


def test_selection_is_ancestor_closed_capped_and_priced(tiny):
    head = random_head(tiny, "eagle3")
    tokens = [5, 17, 42, 8, 9]
    tree9 = EagleTree(depth=4, top_k=3, total_tokens=9)
    free = EagleSpeculator(head, tree9)
    tree = free.propose(_context(tiny, tokens, head.config.aux_layers, FREE), budget=100)
    assert len(tree) == 10  # the cap, all of it: nodes are free
    assert all(p < i for i, p in enumerate(tree.parents))
    siblings = [tuple(tree.tokens[c] for c in ch) for ch in tree.children]
    assert all(len(set(s)) == len(s) for s in siblings)
    costly = EagleSpeculator(head, tree9)
    context = _context(tiny, tokens, head.config.aux_layers, verify_costs(5.0))
    tree = costly.propose(context, budget=100)
    assert len(tree) == 1  # an untrained drafter's tree cannot pay for itself
    assert len(free.propose(_context(tiny, tokens, head.config.aux_layers), budget=3)) == 4


@pytest.mark.parametrize("variant", ["eagle1", "eagle3"])
def test_a_saved_and_reloaded_drafter_proposes_the_same_trees(tiny, variant, tmp_path):
    from specdec.heads.eagle_io import load_eagle, save_eagle

    head = random_head(tiny, variant, seed=4)
    save_eagle(head, tmp_path, verifier_name_or_path="tiny", verifier_architectures=["Llama"])
    loaded = load_eagle(tmp_path, tiny)
    tree = EagleTree(depth=4, top_k=3, total_tokens=12)  # drafted in free contexts: all kept
    tokens = [5, 17, 42, 8, 9, 11]
    for t in (tokens, tokens + [60, 61]):
        a = EagleSpeculator(head, tree).propose(_context(tiny, t, head.config.aux_layers), 50)
        b = EagleSpeculator(loaded, tree).propose(_context(tiny, t, head.config.aux_layers), 50)
        assert (a.tokens, a.parents) == (b.tokens, b.parents) and len(a) == 13


def test_tree_settings_parse_and_reject_bad_values():
    assert EagleTree.parse("6,8,60") == EagleTree(6, 8, 60)
    assert EagleTree.parse("3") == EagleTree(depth=3)
    for bad in ["0,4,8", "a,b", "5,4,24,1"]:
        with pytest.raises(ConfigError):
            EagleTree.parse(bad)


# -- training ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data_dir(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    prompts = tmp_path_factory.mktemp("eagle_prompts") / "train.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in PROMPTS))
    out = tmp_path_factory.mktemp("eagle_sd")
    generate_data(tiny, prompts, out, max_new_tokens=24, batch_size=4, shard_size=4)
    return out


def _train_config(variant: str, **kw) -> EagleTrainConfig:
    base = dict(
        variant=variant,
        aux_layers=(1, 2, 3) if variant == "eagle3" else None,
        draft_vocab=96,
        max_steps=120,
        batch_sequences=4,
        lr=1e-2,
        eval_every=60,
        held_out=0.0,  # four prompts of a random model: measure on what it learnt
    )
    base.update(kw)
    return EagleTrainConfig(**base)


@pytest.fixture(scope="module", params=["eagle1", "eagle3"])
def trained(request, tiny, data_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from specdec.training.eagle import train_eagle

    variant = request.param
    out = tmp_path_factory.mktemp(f"trained_{variant}")
    result = train_eagle(tiny, load_data(data_dir, tiny), out, _train_config(variant))
    return variant, out, result


@pytest.mark.slow(threads=1)
def test_training_raises_simulated_tau(tiny, data_dir, trained):
    variant, _, result = trained
    data = load_data(data_dir, tiny)
    cfg = _train_config(variant)
    feats = extract_sequence_features(tiny, data.records, cfg)
    untrained = build_head(tiny, cfg, data.records)
    _, tau_before = evaluate(untrained, feats, readout_for(untrained, cfg, data.records), cfg)
    assert result.simulated_tau > tau_before + 0.5
    assert len(result.step_accuracy) == cfg.ttt_steps
    assert result.history and result.history[-1]["step"] == cfg.max_steps


@pytest.mark.parametrize("variant", ["eagle1", "eagle3"])
def test_unroll_in_the_rows_windows_equals_the_unroll_everywhere(tiny, data_dir, variant):
    """Steps >= 1 skip each row's prompt and padding; in float64 the loss, every gradient and
    the per-position correctness equal the unroll over all positions (only the order of the
    sums differs)."""
    from specdec.training.eagle import active_window, collate, unroll

    data = load_data(data_dir, tiny)
    cfg = _train_config(variant)
    feats = extract_sequence_features(tiny, data.records, cfg)
    head = build_head(tiny, cfg, data.records).double()
    torch.manual_seed(1)
    with torch.no_grad():  # away from the init, so the steps' states differ
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    readout = readout_for(head, cfg, data.records)
    batch = collate(feats, range(len(feats)))
    batch = dataclasses.replace(
        batch,
        features=batch.features.double(),
        final=batch.final.double(),
        top_p=batch.top_p.double(),
    )
    idx, live = active_window(batch.label_ok, cfg.ttt_steps)
    assert idx.shape[1] < batch.tokens.shape[1]  # the windows do skip positions
    assert int(live.sum()) < batch.label_ok.numel()
    runs = []
    for packed in (True, False):
        head.zero_grad()
        stats = unroll(head, batch, readout, cfg, packed=packed)
        stats.loss.backward()
        grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
        runs.append((stats, grads))
    (a, ga), (b, gb) = runs
    assert a.loss.item() == pytest.approx(b.loss.item(), rel=1e-12)
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-10, atol=1e-12, msg=name)
    for x, y in zip(a.correct + a.valid, b.correct + b.valid, strict=True):
        assert torch.equal(x, y)
    assert any(bool(c.any()) for c in a.correct)  # some drafts are right: the test can fail


def _mapped_files(t: torch.Tensor) -> set[str]:
    """The files whose memory maps hold ``t``'s data (from /proc/self/maps)."""
    ptr, found = t.data_ptr(), set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= ptr < hi and len(parts) == 6:
            found.add(parts[5])
    return found


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads /proc/self/maps")
def test_feature_cache_is_memory_mapped_exact_and_reused(tiny, data_dir, tmp_path, monkeypatch):
    """The cache hands back views of memory-mapped files (so all of ShareGPT's 12.7 GB of
    features need no resident memory), equal bit for bit to a direct extraction; a second run
    reads them without a target pass and without rewriting the files."""
    records = load_data(data_dir, tiny).records
    for variant in ("eagle1", "eagle3"):  # (their default feature layers differ: two caches)
        cfg = _train_config(variant)
        direct = extract_sequence_features(tiny, records, cfg)
        cache = tmp_path / f"features-{variant}"
        cached = extract_sequence_features(tiny, records, cfg, cache)
        for got in (cached, extract_sequence_features(tiny, records, cfg, cache)):
            for name in ("tokens", "features", "final", "top_ids", "top_logp"):
                want_rows, got_rows = getattr(direct, name), getattr(got, name)
                assert len(got_rows) == len(want_rows) == len(records)
                for a, b in zip(want_rows, got_rows, strict=True):
                    assert a.dtype == b.dtype and torch.equal(a, b), name
            assert got.first_label == direct.first_label
        column = "final" if variant == "eagle1" else "aux"
        assert _mapped_files(cached.features[1]) == {str(cache / f"{column}.bin")}
    files = sorted(cache.iterdir())
    assert {p.name for p in files} >= {"index.json", "aux.bin", "final.bin", "tokens.bin"}
    before = {p.name: (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns) for p in files}

    def no_target_pass(*args, **kwargs):
        raise AssertionError("the target ran although every answer is cached")

    monkeypatch.setattr(tiny.model, "forward", no_target_pass)
    again = extract_sequence_features(tiny, records, _train_config("eagle3"), cache)
    assert torch.equal(again.features[2], cached.features[2])
    after = {p.name: (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns) for p in files}
    assert after == before


def test_trained_drafter_is_lossless_greedy_and_accepts(tiny, trained):
    _, out, _ = trained
    engine = SpeculativeEngine.from_pretrained(tiny, speculator=options_for("eagle", dir=str(out)))
    accepted = 0
    for prompt in PROMPTS[:3]:
        plain = engine.generate(prompt, max_new_tokens=30, ignore_eos=True, speculate=False)
        spec = engine.generate(prompt, max_new_tokens=30, ignore_eos=True)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.target_forwards <= plain.stats.target_forwards
    for prompt in PROMPTS:
        accepted += engine.generate(prompt, max_new_tokens=24, chat=True).stats.accepted_tokens
    assert accepted > 20  # on its training prompts the drafter is right most of the time


def test_a_fixed_length_eagle_chain_drafts_its_whole_depth(tiny, trained):
    """adaptive=False: the tree is drafted whole, priced or not, so a chain DEPTHx1xDEPTH drafts
    exactly its depth every step (the shape vLLM's EAGLE drafts), and stays lossless."""
    _, out, _ = trained
    spec = options_for("eagle", dir=str(out), tree="3x1x3")
    engine = SpeculativeEngine.from_pretrained(tiny, speculator=spec, adaptive=False)
    for prompt in PROMPTS[:3]:
        plain = engine.generate(prompt, max_new_tokens=24, chat=True, speculate=False)
        got = engine.generate(prompt, max_new_tokens=24, chat=True)
        assert got.token_ids == plain.token_ids
        stats = got.stats
        assert stats.drafted_at[0] == stats.drafted_at[2] > 0  # every drafting step: 3 deep
        assert stats.drafted_tokens == 3 * stats.drafted_at[0]


def test_sampled_eagle_is_seeded(tiny, trained):
    _, out, _ = trained
    engine = SpeculativeEngine.from_pretrained(tiny, speculator=options_for("eagle", dir=str(out)))
    a = engine.generate(PROMPTS[1], max_new_tokens=20, temperature=0.9, seed=3)
    b = engine.generate(PROMPTS[1], max_new_tokens=20, temperature=0.9, seed=3)
    assert a.token_ids == b.token_ids and a.stats.lossless


def test_batched_eagle_drafts_from_the_whole_prompt(tiny, trained):
    """In a batch a prompt's last chunk rides a verification pass, so its features exist only
    after it: an EAGLE sequence decodes from the next pass, and then drafts from the features of
    its whole prompt, as alone. So each sequence's drafts, not only its output, are its solo
    ones (fixed K): same tokens, same number accepted. A seeded sampled sequence draws alike."""
    _, out, _ = trained
    engine = SpeculativeEngine.from_pretrained(
        tiny, speculator=options_for("eagle", dir=str(out)), adaptive=False
    )
    kw = {"max_new_tokens": 24, "ignore_eos": True, "chat": True}  # its training prompts
    solo = [engine.generate(p, **kw) for p in PROMPTS[:4]]
    batched = engine.generate_batch(PROMPTS[:4], max_batch=3, **kw)
    assert [r.token_ids for r in batched] == [r.token_ids for r in solo]
    assert [r.stats.accepted_tokens for r in batched] == [r.stats.accepted_tokens for r in solo]
    assert sum(r.stats.accepted_tokens for r in batched) > 10
    sampled = {"temperature": 0.9, "top_k": 20, **kw}
    alone = engine.generate(PROMPTS[1], seed=3, **sampled).token_ids
    mates = engine.generate_batch(PROMPTS[:3], seeds=[1, 3, 2], **sampled)
    assert mates[1].token_ids == alone


class _StopAt:
    """A progress bar that interrupts training after ``stop`` steps, like a killed run."""

    stop = 3

    def __init__(self, *args, **kwargs) -> None:
        self.n = kwargs.get("initial", 0)
        self.training = str(kwargs.get("desc", "")).startswith("training")

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.training and self.n == self.stop:
            raise KeyboardInterrupt

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def write(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


def test_an_interrupted_run_resumes_from_its_checkpoint(tiny, data_dir, tmp_path):
    from specdec.training.eagle import train_eagle

    data = load_data(data_dir, tiny)
    cfg = _train_config("eagle3", max_steps=4, eval_every=2, checkpoint_every=2)
    with pytest.raises(KeyboardInterrupt):
        train_eagle(tiny, data, tmp_path, cfg, progress=_StopAt)
    state = tmp_path / "checkpoint" / "state.json"
    assert state.is_file()
    resumed = train_eagle(tiny, data, tmp_path, cfg, resume=True)
    assert [h["step"] for h in resumed.history] == [2.0, 4.0]  # step 2 came from the checkpoint
    assert not state.exists()
    state.parent.mkdir()
    state.write_bytes(b"broken")
    with pytest.raises(CheckpointError, match="cannot resume"):
        train_eagle(tiny, data, tmp_path, cfg, resume=True)


def test_a_drafter_continues_from_its_own_weights_and_vocabulary(tiny, data_dir, trained, tmp_path):
    from specdec.heads.eagle_io import load_eagle
    from specdec.training.eagle import train_eagle

    variant, first_dir, first = trained
    data = load_data(data_dir, tiny)
    cfg = _train_config(variant, max_steps=6, eval_every=3, lr=1e-3, init_from=str(first_dir))
    result = train_eagle(tiny, data, tmp_path, cfg)
    # step 0 is the first run's head on the same held-out positions: it starts there, not
    # from the target's rows (a fresh head scores far lower; see the test above)
    assert result.history[0]["step"] == 0
    assert result.history[0]["simulated_tau"] == pytest.approx(first.simulated_tau, abs=1e-6)
    start, after = load_eagle(first_dir, tiny), load_eagle(tmp_path, tiny)
    if variant == "eagle3":
        assert torch.equal(start.draft_token_ids(), after.draft_token_ids())
    assert not torch.equal(start.fc.weight, after.fc.weight)  # and it did train
    record = json.loads((tmp_path / "config.json").read_text())
    assert "held_out_simulated_tau_at_start" in json.dumps(record)
    # settings that would feed it other inputs or another vocabulary are refused up front
    other = "eagle1" if variant == "eagle3" else "eagle3"
    with pytest.raises(ConfigError, match=f"--variant {variant}"):
        train_eagle(tiny, data, tmp_path / "x", _train_config(other, init_from=str(first_dir)))
    if variant == "eagle3":
        with pytest.raises(ConfigError, match="--draft-vocab 96"):
            train_eagle(
                tiny,
                data,
                tmp_path / "y",
                _train_config(variant, draft_vocab=64, init_from=str(first_dir)),
            )
        with pytest.raises(ConfigError, match="--aux-layers 1,2,3"):
            train_eagle(
                tiny,
                data,
                tmp_path / "z",
                _train_config(variant, aux_layers=(1, 2, 2), init_from=str(first_dir)),
            )


def test_continuing_the_shipped_head_on_another_target_fails_before_extracting(
    tiny_model_dir, data_dir, tmp_path
):
    from typer.testing import CliRunner

    from specdec.cli.main import app

    args = ["train", "eagle", "--data", str(data_dir), "--out", str(tmp_path / "e")]
    result = CliRunner().invoke(app, [*args, "--init", "bundled", "--model", str(tiny_model_dir)])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "another model" in lines[0], lines
    assert not (tmp_path / "e" / "features-train").exists()  # refused before any target pass


def test_bad_settings_fail_fast(tiny):
    with pytest.raises(CheckpointError, match="shipped EAGLE-3 head .*--speculator eagle:DIR"):
        SpeculativeEngine.from_pretrained(tiny, speculator="eagle")  # the shipped head's target
    with pytest.raises(ConfigError, match="precision 'fp8'.*bf16-mixed"):
        EagleTrainConfig(precision="fp8")
    with pytest.raises(ConfigError, match="variant"):
        EagleTrainConfig(variant="eagle2")
    with pytest.raises(ConfigError, match="out of range"):
        build_head(tiny, EagleTrainConfig(aux_layers=(1, 9)), [])
    with pytest.raises(ConfigError, match="ttt"):
        EagleTrainConfig(ttt_steps=0)


# -- lossless sampling ---------------------------------------------------------------------------
class FeatureMarkovTarget(MarkovTarget):
    """The Markov table target of test_losslessness, also handing out 'hidden states': a
    fixed random vector per committed token, so a real EAGLE head drafts real trees from it."""

    def __init__(self, table: torch.Tensor, width: int) -> None:
        super().__init__(table)
        self.rows = torch.randn(table.shape[0], width, generator=torch.Generator().manual_seed(5))
        self._features: torch.Tensor | None = None
        self._tree: DraftTree | None = None

    provides_features = True

    def enable_features(self, layers: Sequence[int] = (-1,)) -> None:
        pass

    def begin(self, prompt: Sequence[int]) -> None:
        self._features = self.rows[list(prompt[:-1])] if len(prompt) > 1 else None

    def verify(self, tree: DraftTree) -> torch.Tensor:
        self._tree = tree
        return super().verify(tree)

    def commit(self, path: Sequence[int]) -> None:
        assert self._tree is not None
        self._features = self.rows[[self._tree.tokens[i] for i in path]]

    @property
    def features(self) -> torch.Tensor | None:
        return self._features


class CountingEagle(EagleSpeculator):
    """Drafts at free verification costs (every node pays: full trees), counting branching."""

    branching = 0

    def propose(self, context, budget):
        tree = super().propose(dataclasses.replace(context, costs=FREE), budget)
        if any(len(c) >= 2 for c in tree.children):
            CountingEagle.branching += 1
        return tree


@pytest.mark.slow(threads=1)
def test_eagle_trees_sample_exactly_the_target_distribution():
    """A real EAGLE head drafting dynamic trees (branching, several depths) over the Markov
    target: through multi-draft rejection sampling the output follows p exactly."""
    from transformers import LlamaConfig

    hidden = 16
    lc = layer_config_from(
        LlamaConfig(
            vocab_size=V,
            hidden_size=hidden,
            intermediate_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_hidden_layers=1,
        )
    )
    config = EagleConfig("eagle1", lc, vocab_size=V, target_hidden_size=hidden, fc_bias=True)
    g = torch.Generator().manual_seed(3)
    head = EagleHead(
        config, torch.randn(V, hidden, generator=g), torch.randn(V, hidden, generator=g)
    )
    CountingEagle.branching = 0
    speculator = CountingEagle(head, EagleTree(depth=3, top_k=2, total_tokens=6))
    target, _ = tables()
    engine = SpeculativeEngine(
        FeatureMarkovTarget(target, hidden), word_tokenizer(V), speculator, adaptive=False
    )
    pvalue = lossless_pvalue(engine)
    assert pvalue > ALPHA, f"EAGLE sampling departs from p (chi-square p = {pvalue:.2e})"
    assert CountingEagle.branching > 1000


LOCKSTEP_TREE = EagleTree(depth=3, top_k=3, total_tokens=8)  # drafted at FREE costs


def drafting_every_step(tiny: LoadedModel, head: EagleHead, steps: int):
    """A greedy run in which one drafter drafts every step: yields each step's context and that
    drafter's tree, so a drafter that only watches some steps can be compared with it."""
    from specdec.config import SamplingConfig
    from specdec.verify import rule_for

    every = EagleSpeculator(head, LOCKSTEP_TREE)
    target = HFTarget(tiny)
    target.enable_features(head.config.aux_layers)
    tokens = [5, 17, 42, 8, 9]
    target.begin(tokens)
    rule, sampling = rule_for(SamplingConfig()), SamplingConfig()
    for step in range(steps):
        ctx = DraftContext(list(tokens), 5, sampling, make_generator(0), target.features, FREE)
        drafted = every.propose(ctx, 50)
        yield step, ctx, drafted
        acceptance = rule.accept(drafted, target.verify(drafted), sampling, make_generator(0))
        target.commit(acceptance.path)
        tokens += list(acceptance.tokens)


def test_watching_steps_it_did_not_draft_keeps_the_drafter_in_sync(tiny):
    """Under ``auto`` the drafter sees every step through ``watch`` but drafts only some: its
    trees on the steps it drafts equal those of a drafter that drafted every step."""
    head = random_head(tiny, "eagle3", seed=2)
    sometimes = EagleSpeculator(head, LOCKSTEP_TREE)
    for step, ctx, drafted in drafting_every_step(tiny, head, 8):
        sometimes.watch(ctx)
        if step % 3 == 2:
            again = sometimes.propose(ctx, 50)
            assert (again.tokens, again.parents) == (drafted.tokens, drafted.parents)


def test_auto_defers_watching_to_one_batch_before_drafting(tiny):
    """``auto`` does not run the drafter's cache update on every step (a few ms each, paid even
    when another arm drafts): it keeps the steps' feature rows and absorbs them in one pass
    when EAGLE drafts. The trees equal those of a drafter that absorbed every step."""
    from specdec.speculators.auto import ArmController

    head = random_head(tiny, "eagle3", seed=2)
    deferred = EagleSpeculator(head, LOCKSTEP_TREE)
    auto = ArmController([deferred], num_layers=tiny.model.config.num_hidden_layers)
    for step, ctx, drafted in drafting_every_step(tiny, head, 10):
        auto._watch("eagle", deferred, ctx)
        if step % 4 == 3:
            assert deferred.cached < len(ctx.tokens) - 1  # nothing absorbed since the last draft
            again, _ = auto._propose("eagle", ctx, 50)
            assert (again.tokens, again.parents) == (drafted.tokens, drafted.parents)


@pytest.mark.slow(threads=1)
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_both_precisions_train(tiny, data_dir, tmp_path, precision):
    """bf16-mixed is the default where bf16 matmuls are native (this project's CPUs); fp32
    stays available. Either learns: the held-out τ rises well above the untrained head's."""
    from specdec.training.eagle import train_eagle
    from specdec.training.precision import autocast

    cfg = _train_config("eagle3", precision=precision, max_steps=80, eval_every=80)
    with autocast(precision, "cpu"):
        engaged = torch.is_autocast_enabled("cpu")
    assert engaged == (precision == "bf16-mixed")
    data = load_data(data_dir, tiny)
    feats = extract_sequence_features(tiny, data.records, cfg)
    untrained = build_head(tiny, cfg, data.records)
    _, before = evaluate(untrained, feats, readout_for(untrained, cfg, data.records), cfg)
    result = train_eagle(tiny, data, tmp_path, cfg)
    assert result.simulated_tau > before + 0.5


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_training_with_the_target_on_cuda(tiny_model_dir, data_dir, tmp_path):
    """`specdec train eagle --device cuda`: features come from the target on the GPU and are
    cached on the CPU; the head learns, and the saved drafter serves a CPU target losslessly."""
    from specdec.training.eagle import train_eagle

    on_gpu = load_model(tiny_model_dir, device="cuda")
    cfg = _train_config("eagle3", max_steps=80, eval_every=80)
    data = load_data(data_dir, on_gpu)
    feats = extract_sequence_features(on_gpu, data.records, cfg)
    assert feats.tokens[0].device.type == "cpu"
    untrained = build_head(on_gpu, cfg, data.records)
    _, before = evaluate(untrained, feats, readout_for(untrained, cfg, data.records), cfg)
    result = train_eagle(on_gpu, data, tmp_path, cfg)
    assert result.simulated_tau > before + 0.5
    cpu = load_model(tiny_model_dir)
    engine = SpeculativeEngine.from_pretrained(
        cpu, speculator=options_for("eagle", dir=str(tmp_path))
    )
    plain = engine.generate(PROMPTS[0], max_new_tokens=20, ignore_eos=True, speculate=False)
    assert (
        engine.generate(PROMPTS[0], max_new_tokens=20, ignore_eos=True).token_ids == plain.token_ids
    )


def test_cli_defaults_are_the_trainers() -> None:
    """``specdec train eagle``'s option defaults equal :class:`EagleTrainConfig`'s: the feature
    cache's key includes the settings, so a script on the API with other defaults would miss
    (and redo) a CLI run's hours of extracted features."""
    import inspect

    from specdec.cli.train_eagle import eagle as cli

    params = inspect.signature(cli).parameters
    config = EagleTrainConfig()
    shared = {
        "variant": "variant",
        "draft_vocab": "draft_vocab",
        "ttt_steps": "ttt_steps",
        "epochs": "epochs",
        "lr": "lr",
        "batch": "batch_sequences",
        "context": "context",
        "speculative_tokens": "speculative_tokens",
        "eval_every": "eval_every",
        "seed": "seed",
        "precision": "precision",
    }
    for option, field in shared.items():
        assert params[option].default == getattr(config, field), option
