"""``specdec bench`` end to end: tiny real models for the fast checks, the bundled model for the
CI quick mode, and every bad input as one line with a non-zero exit."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdec.cli.bench import EXIT_BAD_LINES
from specdec.cli.main import app

runner = CliRunner()


def q(qid: int, cat: str, text: str) -> str:
    return json.dumps({"question_id": qid, "category": cat, "turns": [text]})


@pytest.fixture
def tiny_dataset(tmp_path: Path) -> Path:
    p = tmp_path / "questions.jsonl"
    p.write_text(
        "\n".join(
            [
                q(81, "writing", "ROMEO: But soft, what light through yonder window breaks?"),
                q(321, "qa", "First Citizen: Before we proceed any further, hear me speak."),
                "{broken",
                q(322, "qa", "KING RICHARD III: Now is the winter of our discontent"),
            ]
        )
        + "\n",
        encoding="utf-8",
    )
    return p


def invoke(args: list[str]):
    result = runner.invoke(app, ["bench", *args])
    assert "Traceback" not in result.output, result.output
    return result


def read_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def check_outputs(out: Path, methods: list[str], prompts: int) -> list[dict]:
    rows = read_rows(out)
    assert [r["method"] for r in rows[: len(methods)]] == methods  # interleaved per prompt
    assert len(rows) == len(methods) * prompts
    for r in rows:
        assert r["identical"] is True, r
        assert r["new_tokens"] > 0 and math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0
        assert r["seconds"] > 0
        assert {"cpu", "threads", "torch", "transformers", "dtype"} <= set(r["env"])
        if r["method"] in ("none", "prompt-lookup") or r["method"].startswith("draft"):
            forwards, accepted = r["target_forwards"], sum(r["accepted_at"])
            assert 0 < forwards <= r["new_tokens"] + 1
            assert r["mean_accepted"] == pytest.approx((accepted + forwards) / forwards)
            if r["method"] == "none":
                assert accepted == 0 and r["mean_accepted"] == 1.0
    report = (out / "report.md").read_text()
    assert "## Overall" in report
    for m in methods:
        assert f"| `{m}` |" in report
    for png in ("speedup.png", "tau.png", "acceptance.png"):
        assert (out / png).stat().st_size > 1000
    return rows


@pytest.mark.slow(threads=1)
def test_tiny_all_kinds_of_method_and_a_malformed_line(tiny_model_dir, tiny_dataset, tmp_path):
    out = tmp_path / "out"
    methods = [
        "none",
        "prompt-lookup",
        "draft:layers:2",
        "hf",
        "hf-prompt-lookup",
        "hf-assisted:layers:2",
    ]
    result = invoke(
        [
            "--model",
            str(tiny_model_dir),
            "--dataset",
            str(tiny_dataset),
            "--methods",
            ",".join(methods),
            "--max-new-tokens",
            "12",
            "--out",
            str(out),
            "--no-plots",
            "--threads",
            "1",
        ]
    )
    # the malformed line is reported with its number, the other questions still run
    assert result.exit_code == EXIT_BAD_LINES, result.output
    assert "questions.jsonl:3" in result.output
    rows = read_rows(out)
    assert {r["question_id"] for r in rows} == {81, 321, 322}
    assert {r["group"] for r in rows} == {"mt_bench", "qa"}
    assert all(r["identical"] for r in rows)
    # --from-results rebuilds the report and plots from the rows alone
    result = invoke(["--from-results", str(out / "results.jsonl"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    check_outputs(out, methods, prompts=3)
    assert "line 3" in (out / "report.md").read_text()  # skipped lines are in the report


@pytest.mark.parametrize(
    "args,message",
    [
        (["--dataset", "/nonexistent/q.jsonl"], "does not exist"),
        (["--methods", "none,medusa2"], "unknown name 'medusa2'"),
        (["--methods", "none,eagle:dir=/nonexistent"], "does not exist"),
        (["--methods", "none,medusa"], "needs dir="),
        (["--methods", "none,eagle:dir=d,depth=3"], "no option 'depth'; its options: k, dir"),
        (["--methods", "none,hf-assisted"], "needs draft="),
        (["--categories", "poetry"], "unknown category 'poetry'"),
        (["--per-category", "0"], "--per-category must be >= 1"),
        (["--methods", "draft"], "needs model="),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, tiny_dataset, tiny_model_dir, tmp_path):
    base = [
        "--dataset",
        str(tiny_dataset),
        "--model",
        str(tiny_model_dir),
        "--out",
        str(tmp_path / "o"),
    ]
    result = invoke(base + args)  # later options win
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert result.output.strip().count("\n") == 0 or "warning" in result.output
    assert not (tmp_path / "o" / "results.jsonl").exists()  # failed before any model work


@pytest.mark.slow
def test_quick_mode_on_the_bundled_model(smol_dir, tmp_path):
    """The CI check: --quick on the real model; identity must hold for every method."""
    out = tmp_path / "quick"
    methods = ["none", "prompt-lookup", "hf"]
    result = invoke(
        [
            "--quick",
            "--model",
            str(smol_dir),
            "--methods",
            ",".join(methods),
            "--categories",
            "qa,math_reasoning",
            "--threads",
            "1",
            "--out",
            str(out),
        ]
    )
    assert result.exit_code == 0, result.output
    rows = check_outputs(out, methods, prompts=2)
    assert all(r["new_tokens"] <= 32 for r in rows)
    assert {r["group"] for r in rows} == {"qa", "math_reasoning"}


@pytest.mark.slow
def test_llamacpp_is_timed_beside_our_methods_on_the_same_file(tmp_path):
    """`llamacpp` decodes the bundled GGUF in llama.cpp itself, interleaved with our runs: the
    report gains a column against it, and its own numerics are not held to identity."""
    from specdec.target import llamacpp

    if not llamacpp.available():
        pytest.skip(llamacpp.INSTALL_HINT)
    out = tmp_path / "peer"
    args = ["--quick", "--methods", "none,llamacpp", "--categories", "qa", "--threads", "1"]
    result = invoke([*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = read_rows(out)
    assert [r["method"] for r in rows] == ["none", "llamacpp"]
    peer = rows[1]
    assert peer["identical"] is None and peer["tokens_per_s"] > 0 and peer["new_tokens"] > 0
    report = (out / "report.md").read_text()
    assert "speedup vs `llamacpp`" in report and "| `llamacpp` |" in report


def test_llamacpp_needs_a_gguf_target(tiny_model_dir, tmp_path):
    result = invoke(["--quick", "--model", str(tiny_model_dir), "--methods", "none,llamacpp"])
    assert result.exit_code != 0
    assert "has none" in result.output and "--gguf" in result.output


# Python run as `specdec` with matplotlib unimportable, as after `pip install specdec` without
# the bench extra: None in sys.modules makes `import matplotlib` raise ModuleNotFoundError.
NO_MATPLOTLIB = (
    "import sys; sys.modules['matplotlib'] = None; sys.argv = ['specdec', *sys.argv[1:]]; "
    "from specdec.cli.main import main; main()"
)


@pytest.mark.slow(threads=1)
def test_quick_without_matplotlib_says_so_first_and_writes_the_report(tiny_model_dir, tmp_path):
    """The plotting extra missing is announced before the run, and the run still ends with a
    report (no plots) and exit 0, never a traceback after the work is done."""
    data = tmp_path / "q.jsonl"
    data.write_text(q(81, "writing", "ROMEO: But soft, what light?") + "\n", encoding="utf-8")
    out = tmp_path / "out"
    args = [
        "bench",
        "--quick",
        "--model",
        str(tiny_model_dir),
        "--dataset",
        str(data),
        "--methods",
        "none,prompt-lookup",
        "--max-new-tokens",
        "6",
        "--out",
        str(out),
    ]
    proc = subprocess.run(
        [sys.executable, "-c", NO_MATPLOTLIB, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    warning = proc.stderr.index("matplotlib is not installed")
    assert warning < proc.stderr.index("prompts ×")  # said before the run starts
    last = " ".join(proc.stderr[proc.stderr.rindex("wrote ") :].split())  # rich wraps it
    assert "report.md (no plots: pip install 'specdec[bench]')" in last, proc.stderr
    assert (out / "report.md").is_file() and not list(out.glob("*.png"))
    assert len(read_rows(out)) == 2
