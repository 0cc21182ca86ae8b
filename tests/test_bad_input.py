"""Every bad input is a typed error with a clear message; the CLI prints one line, exits
non-zero, and shows no traceback."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdec import SpeculativeEngine
from specdec.cli.main import app
from specdec.errors import (
    ConfigError,
    CorruptModelError,
    InvalidRequestError,
    ModelNotFoundError,
    PromptTooLongError,
    UnknownSpeculatorError,
)
from specdec.target import load_model


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> SpeculativeEngine:
    return SpeculativeEngine.from_pretrained(tiny_model_dir, speculator="prompt-lookup")


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        (dict(prompt=""), InvalidRequestError, "empty"),
        (dict(prompt="   \n"), InvalidRequestError, "empty"),
        (dict(prompt=[]), InvalidRequestError, "empty"),
        (dict(prompt=[{"content": "x"}]), InvalidRequestError, "role"),
        (dict(max_new_tokens=0), InvalidRequestError, "max_new_tokens"),
        (dict(temperature=-0.5), InvalidRequestError, "temperature"),
        (dict(temperature=float("nan")), InvalidRequestError, "temperature"),
        (dict(top_p=0.0), InvalidRequestError, "top_p"),
        (dict(top_p=1.5), InvalidRequestError, "top_p"),
        (dict(top_k=-1), InvalidRequestError, "top_k"),
        (dict(stop=[""]), InvalidRequestError, "stop"),
        (dict(max_new_tokens=10_000), InvalidRequestError, "context"),
        (dict(prompt="word " * 2000), PromptTooLongError, "context"),
    ],
)
def test_request_errors_are_typed_and_raised_before_decoding(engine, kwargs, error, words):
    kwargs = {"prompt": "hello there", **kwargs}
    prompt = kwargs.pop("prompt")
    with pytest.raises(error, match=words):
        engine.stream(prompt, **kwargs)  # raises on the call, before any token


def test_engine_still_works_after_bad_requests(engine):
    with pytest.raises(InvalidRequestError):
        engine.generate("", max_new_tokens=3)
    assert engine.generate("hello there", max_new_tokens=3, ignore_eos=True).stats.new_tokens == 3


def test_bad_configs(tiny_model_dir, other_vocab_model_dir, tmp_path):
    loaded = load_model(tiny_model_dir)
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        SpeculativeEngine.from_pretrained(loaded, speculator="prompt-lookup", num_draft_tokens=0)
    with pytest.raises(UnknownSpeculatorError, match="available"):
        SpeculativeEngine.from_pretrained(loaded, speculator="telepathy")
    with pytest.raises(ConfigError, match="needs model="):
        SpeculativeEngine.from_pretrained(loaded, speculator="draft")
    with pytest.raises(ConfigError, match="layers:N"):
        SpeculativeEngine.from_pretrained(loaded, speculator="draft:layers:99")
    # a draft with another tokenizer drafts through text (tests/test_cross_vocab.py), chains only
    other = SpeculativeEngine.from_pretrained(loaded, speculator=f"draft:{other_vocab_model_dir}")
    assert type(other.speculator).__name__ == "CrossVocabSpeculator"
    with pytest.raises(ConfigError, match="chains only"):
        SpeculativeEngine.from_pretrained(
            loaded, speculator=f"draft:{other_vocab_model_dir},tree=2x2"
        )
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        SpeculativeEngine.from_pretrained(loaded, speculator=f"draft:{tmp_path / 'nope'}")
    with pytest.raises(ConfigError, match="dtype"):
        load_model(tiny_model_dir, dtype="int3")
    from specdec.server import ServerConfig

    for chunk in (0, 2.5, True):
        with pytest.raises(ConfigError, match="prefill_chunk"):
            ServerConfig(model_name="m", prefill_chunk=chunk)  # type: ignore[arg-type]
    for slowdown in (0.5, float("nan"), "2", True):
        with pytest.raises(ConfigError, match="prefill_slowdown must be >= 1"):
            ServerConfig(model_name="m", prefill_slowdown=slowdown)  # type: ignore[arg-type]


def test_missing_and_corrupt_models(tiny_model_dir, tmp_path):
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        load_model(tmp_path / "missing")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(tmp_path)
    broken = tmp_path / "truncated"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:2000])
    with pytest.raises(CorruptModelError, match="corrupt"):
        load_model(broken)
    bad_gguf = tmp_path / "model.gguf"
    bad_gguf.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 64)
    with pytest.raises(CorruptModelError, match="GGUF"):
        load_model(gguf=bad_gguf, cache_dir=tmp_path / "cache")
    with pytest.raises(ModelNotFoundError):
        load_model(gguf=tmp_path / "absent.gguf", cache_dir=tmp_path / "cache")


@pytest.mark.slow(threads=1)
def test_truncated_real_gguf_is_a_clear_error(tmp_path):
    from specdec.target.loading import default_gguf_path

    try:
        real = default_gguf_path()
    except ModelNotFoundError:
        pytest.skip("bundled model not installed")
    cut = tmp_path / "cut.gguf"
    with real.open("rb") as f:
        cut.write_bytes(f.read(4_000_000))
    with pytest.raises(CorruptModelError, match="cut.gguf"):
        load_model(gguf=cut, cache_dir=tmp_path / "cache")


@pytest.mark.parametrize(
    "args,words",
    [
        (["generate", ""], "empty"),
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--top-p", "2"], "top_p"),
        (["generate", "hi", "-n", "0"], "max_new_tokens"),
        (["generate", "hi", "-k", "0"], "num_draft_tokens"),
        (["generate", "hi", "--speculator", "magic"], "unknown speculator 'magic'"),
        (["generate", "hi", "-s", "draft:modle=x"], "no option 'modle'; its options: k, model"),
        (["generate", "hi", "-s", "draft"], "needs model="),
        (["generate", "hi", "-s", "prompt-lookup:max_ngram=big"], "must be an integer"),
        (["generate", "hi", "-s", "auto:arms=[suffix"], "unbalanced"),
        (["serve", "-s", "magic"], "unknown speculator 'magic'"),
        (["bench", "--methods", "none,magic"], "unknown name 'magic'"),
        (["generate", "hi", "--dtype", "int3"], "dtype"),
    ],
)
def test_cli_errors_are_one_line(tiny_model_dir, args, words):
    result = CliRunner().invoke(app, [*args, "--model", str(tiny_model_dir)])
    assert result.exit_code == 2
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], result.stderr


@pytest.mark.slow(threads=1)
def test_cli_error_in_a_real_process_has_no_traceback(
    tmp_path, other_vocab_model_dir, tiny_model_dir
):
    cases = [
        (["generate", "hi", "--model", str(tmp_path / "missing")], "does not exist"),
        (
            [
                "generate",
                "hi",
                "--model",
                str(tiny_model_dir),
                "--speculator",
                f"draft:model={other_vocab_model_dir},tree=2x2",
            ],
            "chains only",
        ),
    ]
    for args, words in cases:
        proc = subprocess.run(
            [sys.executable, "-m", "specdec.cli.main", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        assert words in proc.stderr


def test_sigterm_stops_a_command_through_its_cleanup():
    """``kill`` (SIGTERM) stops a CLI command as Ctrl-C does: its ``finally`` blocks run (a long
    extraction saves what it has), it exits 143 with one line, and the handler is restored."""
    import os
    import signal

    import typer

    from specdec.cli.common import user_errors

    before = signal.getsignal(signal.SIGTERM)
    cleaned = []
    with pytest.raises(typer.Exit) as stop:
        with user_errors():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):  # the handler runs at the next bytecode
                    pass
                pytest.fail("SIGTERM did not stop the command")
            finally:
                cleaned.append(True)
    assert stop.value.exit_code == 143 and cleaned == [True]
    assert signal.getsignal(signal.SIGTERM) is before
