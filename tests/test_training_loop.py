"""The shared training loop: exact resumption for every trainer, its checkpoint format and its
refusals, and the schedule family it shares with the online learner.

Exact means bitwise: a run interrupted after a checkpoint and resumed must end with the very
weights of a run that was never interrupted (same batches, same ops, on CPU deterministic). The
runs are short but long enough that the checkpoint falls mid-permutation of the data (batches
span epochs), so a sampler that restarted, or was re-seeded, on resume would show up here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from specdec.errors import CheckpointError, ConfigError, DataError
from specdec.heads.optim import Schedule, optimizer_step
from specdec.target import load_model
from specdec.training.checkpoint import CHECKPOINT_DIR
from specdec.training.data import generate_data, load_data
from specdec.training.distill import train_draft
from specdec.training.eagle import EagleTrainConfig, train_eagle
from specdec.training.loop import EpochSampler, ShuffledSampler
from specdec.training.medusa import MedusaTrainConfig, train_medusa
from specdec.training.self_exit import SelfExitTrainConfig, train_self_exit

PROMPTS = [
    "KING: My lords, attend.",
    "To be, or not to be",
    "Now is the winter of our discontent",
    "Friends, Romans, countrymen, lend me your ears;",
    "What's in a name? That which we call a rose",
    "The quality of mercy is not strained;",
    "All the world's a stage,",
    "If music be the food of love, play on;",
    "Once more unto the breach, dear friends,",
    "Is this a dagger which I see before me,",
    "Shall I compare thee to a summer's day?",
    "Good night, good night! Parting is such sweet sorrow,",
]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def data(tiny, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("loop_data")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    generate_data(tiny, prompts, root / "sd", max_new_tokens=16, batch_size=8, shard_size=8)
    return load_data(root / "sd", tiny)


class _Interrupt(Exception):
    pass


def _bar_interrupting_at(step: int) -> Callable[..., Any]:
    """A progress factory whose training bar (unit "step") raises when it reaches ``step``, as
    a killed run would stop; feature-extraction bars pass."""

    class Bar:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.n = kwargs.get("initial", 0)
            self.training = kwargs.get("unit") == "step"

        def update(self, n: int = 1) -> None:
            self.n += n
            if self.training and self.n == step:
                raise _Interrupt

        def set_postfix(self, *args: Any, **kwargs: Any) -> None: ...

        def write(self, *args: Any, **kwargs: Any) -> None: ...

        def close(self) -> None: ...

    return Bar


def _weights(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor a run saved as its result (feature caches aside)."""
    files = sorted(p for p in out.glob("*.safetensors") if not p.name.startswith("features-"))
    assert files, f"no weights in {out}"
    return {f"{p.name}:{k}": v for p in files for k, v in load_file(p).items()}


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


TRAINERS: dict[str, Callable[..., Any]] = {
    # 6 steps, checkpoints every 2, interrupted at 5: the resumed run redoes step 5 from 4
    "medusa": lambda tiny, data, out, **kw: train_medusa(
        tiny, data, out,
        MedusaTrainConfig(num_heads=2, draft_vocab=96, max_steps=6, batch_positions=40,
                          eval_every=3, checkpoint_every=2, soft_weight=0.5, held_out=0.2),
        **kw,
    ),
    "eagle": lambda tiny, data, out, **kw: train_eagle(
        tiny, data, out,
        EagleTrainConfig(variant="eagle3", aux_layers=(1, 2, 3), draft_vocab=96, max_steps=6,
                         batch_sequences=3, eval_every=3, checkpoint_every=2, held_out=0.2),
        **kw,
    ),
    "self-exit": lambda tiny, data, out, **kw: train_self_exit(
        tiny, data, out,
        SelfExitTrainConfig(layer=1, draft_vocab=200, max_steps=6, batch_positions=40,
                            checkpoint_every=2, held_out=0.2),
        **kw,
    ),
    "distill": lambda tiny, data, out, **kw: train_draft(
        tiny, data, out, layers=1, max_steps=6, lr=3e-3, batch_tokens=128, eval_every=3,
        checkpoint_every=2, held_out=0.2, **kw,
    ),
    "distill-topk": lambda tiny, data, out, **kw: train_draft(
        tiny, data, out, layers=1, max_steps=6, lr=3e-3, batch_tokens=128, eval_every=3,
        checkpoint_every=2, held_out=0.2, teacher_topk=8, **kw,
    ),
}  # fmt: skip


@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_an_interrupted_run_resumes_to_the_same_weights(tiny, data, tmp_path, trainer):
    train = TRAINERS[trainer]
    straight = train(tiny, data, tmp_path / "a")
    with pytest.raises(_Interrupt):
        train(tiny, data, tmp_path / "b", progress=_bar_interrupting_at(5))
    saved = json.loads((tmp_path / "b" / CHECKPOINT_DIR / "state.json").read_text())
    assert saved["step"] == 4 and saved["trainer"] == trainer.split("-topk")[0]
    with pytest.raises(CheckpointError, match="--resume"):  # never silently over an old run
        train(tiny, data, tmp_path / "b")
    torch.manual_seed(12345)  # the resumed run must not depend on the global RNG it finds
    resumed = train(tiny, data, tmp_path / "b", resume=True)
    assert resumed.steps == straight.steps == 6
    _assert_same_weights(tmp_path / "a", tmp_path / "b")
    # the same evaluations, to the last bit (self-exit reports only its final agreement)
    assert getattr(resumed, "history", None) == getattr(straight, "history", None)
    assert getattr(resumed, "agreement", None) == getattr(straight, "agreement", None)


def test_the_batches_after_a_resume_are_the_batches_without_one(tmp_path):
    """The sampler's state survives the checkpoint's round trip (``weights_only`` loading)."""
    for make in (
        lambda: ShuffledSampler(10, 4, seed=3),
        lambda: EpochSampler(lambda e: [[e, 1], [e, 2], [e, 3]][: 2 + e % 2]),
    ):
        straight = make()
        expected = [straight.next_batch() for _ in range(9)]
        first = make()
        head = [first.next_batch() for _ in range(4)]
        buf = tmp_path / "sampler.pt"
        torch.save(first.state_dict(), buf)
        again = make()
        again.load_state_dict(torch.load(buf, weights_only=True))
        assert head + [again.next_batch() for _ in range(5)] == expected


def test_resume_refuses_other_settings_naming_them(tiny, data, tmp_path):
    cfg = dict(num_heads=2, draft_vocab=96, max_steps=3, batch_positions=40, checkpoint_every=1)
    with pytest.raises(_Interrupt):
        train_medusa(tiny, data, tmp_path, MedusaTrainConfig(**cfg),
                     progress=_bar_interrupting_at(2))  # fmt: skip
    with pytest.raises(CheckpointError, match=r"lr=0\.001 \(now 0\.01\)"):
        train_medusa(tiny, data, tmp_path, MedusaTrainConfig(**cfg, lr=1e-2), resume=True)
    # the run's length may change: resuming to a longer run is what resume is for
    longer = train_medusa(tiny, data, tmp_path, MedusaTrainConfig(**{**cfg, "max_steps": 4}),
                          resume=True)  # fmt: skip
    assert longer.steps == 4 and not (tmp_path / CHECKPOINT_DIR).exists()
    with pytest.raises(CheckpointError, match="no checkpoint to resume"):
        train_medusa(tiny, data, tmp_path, MedusaTrainConfig(**cfg), resume=True)


def test_a_broken_checkpoint_is_a_clear_error(tiny, data, tmp_path):
    cfg = SelfExitTrainConfig(layer=1, draft_vocab=200, max_steps=3, batch_positions=40,
                              checkpoint_every=1)  # fmt: skip
    with pytest.raises(_Interrupt):
        train_self_exit(tiny, data, tmp_path, cfg, progress=_bar_interrupting_at(2))
    state = tmp_path / CHECKPOINT_DIR / "state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        train_self_exit(tiny, data, tmp_path, cfg, resume=True)
    (tmp_path / CHECKPOINT_DIR / "state.json").write_text("{")
    with pytest.raises(CheckpointError, match="cannot resume"):
        train_self_exit(tiny, data, tmp_path, cfg, resume=True)


def test_an_interrupted_save_keeps_the_previous_checkpoint(tiny, data, tmp_path, monkeypatch):
    cfg = SelfExitTrainConfig(layer=1, draft_vocab=200, max_steps=4, batch_positions=40,
                              checkpoint_every=1)  # fmt: skip
    real_save = torch.save
    saves: list[int] = []

    def failing_second_save(obj: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        saves.append(1)
        if len(saves) == 2:
            raise _Interrupt  # the process dies half-way through writing checkpoint 2
        real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_second_save)
    with pytest.raises(_Interrupt):
        train_self_exit(tiny, data, tmp_path, cfg)
    monkeypatch.setattr(torch, "save", real_save)
    assert json.loads((tmp_path / CHECKPOINT_DIR / "state.json").read_text())["step"] == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".checkpoint")] == []
    assert train_self_exit(tiny, data, tmp_path, cfg, resume=True).steps == 4


# -- the schedule family -------------------------------------------------------------------------
def test_the_schedules_are_the_ones_the_trainers_had():
    """The heads' trainers had ``min(1, (s + 1) / 20) * max(0.05, 1 - s / total)`` (LambdaLR);
    distillation a warm-up, then a cosine to a tenth; the online learner a warm-up only."""
    total = 37
    heads = Schedule()
    for s in range(total):
        assert heads.factor(s, total) == min(1.0, (s + 1) / 20) * max(0.05, 1 - s / total)
    cosine = Schedule(5, "cosine", 0.1)
    for s in range(total):
        progress = min(1.0, (s - 5) / (total - 5)) if s >= 5 else 0.0
        old = (s + 1) / 5 if s < 5 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        assert cosine.factor(s, total) == pytest.approx(old, rel=1e-15)
    assert [Schedule(0, "constant").factor(s) for s in range(3)] == [1.0, 1.0, 1.0]
    with pytest.raises(ConfigError, match="warm-up"):
        Schedule(-1)
    with pytest.raises(ConfigError, match="total steps"):
        Schedule().factor(3)


def test_the_step_helper_sets_the_rate_and_clips():
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    opt = torch.optim.SGD([w], lr=1.0)
    optimizer_step(opt, (w * w).sum() * 0.5, lr=0.5, clip=1.0)  # gradient (3, 4), norm 5
    assert opt.param_groups[0]["lr"] == 0.5
    torch.testing.assert_close(w.detach(), torch.tensor([3.0 - 0.3, 4.0 - 0.4]))


def test_a_diverged_run_stops_at_once_with_a_clear_error(tmp_path):
    """A NaN loss would stay NaN for the rest of the schedule (a GPU run at a too-high learning
    rate trained 2,000 steps of NaN before it said so): the loop stops at the step it appears,
    naming the step, the learning rate and what to change."""
    from specdec.errors import TrainingDivergedError
    from specdec.training.checkpoint import CheckpointStore
    from specdec.training.loop import LoopSettings, StepOutput, TrainTask, train_loop

    class Task(TrainTask):
        def __init__(self) -> None:
            self.module = torch.nn.Linear(2, 1)
            self.calls = 0

        def loss(self, batch: list[int]) -> StepOutput:
            self.calls += 1
            scale = math.nan if self.calls == 3 else 1.0
            return StepOutput(self.module(torch.ones(1, 2)).sum() * scale, {})

        def evaluate(self, step: int, last: dict[str, float]) -> Any:
            raise AssertionError("no evaluation before the end")

    task = Task()
    opt = torch.optim.SGD(task.module.parameters(), lr=0.1)
    settings = LoopSettings(total_steps=50, lr=0.1, eval_every=100)
    with pytest.raises(TrainingDivergedError, match=r"became nan at step 3 .*lower --lr"):
        train_loop(task, opt, ShuffledSampler(4, 2, seed=0), settings,
                   CheckpointStore(tmp_path, {"run": "t"}))  # fmt: skip
    assert task.calls == 3


def test_written_answers_are_stored_as_the_targets_response_tokens(tiny, tmp_path):
    """``answers="source"``: each line's own response, tokenized after the same prompt ids the
    target's answer would follow, cut at ``max_new_tokens`` or ended by the EOS; the data then
    trains a drafter (labels come from the target), keeps its origin through the compact token
    format, and refuses to be extended by the target's answers."""
    from specdec.request import encode_prompt
    from specdec.training.shards import load_token_data, save_token_data

    tok = tiny.tokenizer
    lines = [
        {"prompt": "To be, or not to be", "response": "that is the question"},
        {"prompt": "All the world's a stage,", "response": "and all the men " * 20},
        {"prompt": "Friends, Romans, countrymen,", "response": "lend me your ears"},
    ]
    prompts = tmp_path / "written.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "sd"
    manifest = generate_data(tiny, prompts, out, max_new_tokens=16, answers="source")
    assert manifest.answers == "source" and manifest.records == 3
    data = load_data(out, tiny)
    chat = bool(getattr(tok, "chat_template", None))
    for r in data.records:
        line = lines[r.index]
        assert list(r.tokens[: r.prompt_len]) == encode_prompt(tok, line["prompt"], chat=chat)
        ids = tok.encode(line["response"], add_special_tokens=False)
        want = ids[:16] if len(ids) >= 16 else ids + [tok.eos_token_id]
        assert list(r.response) == want
    assert sum(len(r.response) == 16 for r in data.records) == 1  # the long one, cut

    compact = tmp_path / "compact"
    save_token_data(data, compact)
    assert load_token_data(compact).manifest.answers == "source"

    result = train_eagle(
        tiny, data, tmp_path / "head",
        EagleTrainConfig(variant="eagle3", aux_layers=(1, 2, 3), draft_vocab=96, max_steps=2,
                         batch_sequences=2, eval_every=2, held_out=0.3),
    )  # fmt: skip
    assert result.steps == 2 and result.train_positions > 0

    with pytest.raises(DataError, match="answers"):
        generate_data(tiny, prompts, out, max_new_tokens=16)  # the target's answers: refused


def test_written_answers_need_a_response_on_every_line(tiny, tmp_path):
    prompts = tmp_path / "half.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "a", "response": "b"}) + "\n" + json.dumps({"prompt": "c"}) + "\n"
    )
    with pytest.raises(DataError, match=r"half.jsonl:2: .*'response'.*--answers target"):
        generate_data(tiny, prompts, tmp_path / "sd", answers="source")
    with pytest.raises(DataError, match="--answers source runs none"):
        generate_data(tiny, prompts, tmp_path / "sd", answers="source", temperature=0.7)
    with pytest.raises(DataError, match="answers must be one of"):
        generate_data(tiny, prompts, tmp_path / "sd", answers="gpt")
