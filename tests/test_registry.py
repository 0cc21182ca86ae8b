"""A speculator defined here, outside the package, is usable everywhere a built-in one is: the
library, ``specdec generate`` (and its help), and ``specdec bench``. Plus the spec grammar itself:
splitting, parsing, formatting back, and an error that names the problem for every mistake."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
from typer.testing import CliRunner

from specdec import SpeculativeEngine
from specdec.cli.main import app
from specdec.errors import ConfigError, UnknownSpeculatorError
from specdec.speculators import DraftContext, Speculator, spec
from specdec.speculators.spec import (
    SpeculatorOptions,
    format_spec,
    option,
    parse_spec,
    register,
    split_specs,
)
from specdec.target import LoadedModel
from specdec.tree import DraftTree

runner = CliRunner()
NAME = "test-repeat"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RepeatOptions(SpeculatorOptions):
    primary: ClassVar[str | None] = "times"
    times: int = option(help="how many times the last token is drafted")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.times < 1:
            raise ConfigError(f"{NAME}: times must be >= 1, got {self.times}")


class RepeatLast(Speculator):
    """Drafts the last token ``times`` times: right on runs of a repeated token, wrong
    elsewhere, and verification keeps the output exact either way."""

    name: ClassVar[str] = NAME
    proposals: ClassVar[int] = 0  # across instances, so a test can see it was used

    def __init__(self, times: int) -> None:
        self.times = times

    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        type(self).proposals += 1
        last = context.tokens[-1]
        return DraftTree.chain(last, [last] * min(self.times, budget))


@pytest.fixture(autouse=True)
def repeat_registered() -> Iterator[None]:
    def build(target: LoadedModel, options: RepeatOptions) -> RepeatLast:
        """drafts the last token N times (a test speculator)"""
        return RepeatLast(options.times)

    register(NAME, RepeatOptions)(build)
    RepeatLast.proposals = 0
    try:
        yield
    finally:
        spec.unregister(NAME)


def flat(text: str) -> str:
    """Help text with rich's box drawing and line wrapping undone."""
    return " ".join(text.replace("│", " ").split())


# -- through the library, the CLI and the bench -----------------------------------------------


def test_library_builds_it_from_a_spec_and_output_is_plain_greedy(tiny_model_dir: Path) -> None:
    engine = SpeculativeEngine.from_pretrained(
        tiny_model_dir, speculator=f"{NAME}:times=2", adaptive=False
    )
    assert engine.method == NAME
    prompt = "ROMEO: But soft, what light through yonder window breaks?"
    plain = engine.generate(prompt, max_new_tokens=24, speculate=False)
    result = engine.generate(prompt, max_new_tokens=24)
    assert result.token_ids == plain.token_ids
    assert RepeatLast.proposals > 0 and result.stats.drafted_tokens > 0
    assert len(result.stats.drafted_at) <= 2  # never more than `times` deep
    # an options object works as well as its text, and k= applies to it like to any spec
    same = SpeculativeEngine.from_pretrained(
        engine.loaded, speculator=RepeatOptions(times=3, k=1), adaptive=False
    )
    again = same.generate(prompt, max_new_tokens=24)
    assert again.token_ids == plain.token_ids and len(again.stats.drafted_at) <= 1


def test_cli_generate_uses_it_and_its_help_lists_it(tiny_model_dir: Path) -> None:
    args = ["generate", "ROMEO: But soft", "--model", str(tiny_model_dir), "-n", "16",
            "--speculator", f"{NAME}:times=2", "--fixed", "--compare", "--json"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["method"] == NAME and out["identical"] is True
    assert RepeatLast.proposals > 0
    # the help is built when shown, so a speculator registered after import is listed
    for command in ("generate", "serve"):
        shown = runner.invoke(app, [command, "--help"])
        assert shown.exit_code == 0, shown.output
        text = flat(shown.output)
        assert f"{NAME}: drafts the last token N times" in text
        assert "times (an integer, required): how many times the last token is drafted" in text
    listed = runner.invoke(app, ["speculators"])
    summary = f"  {NAME}: drafts the last token N times (a test speculator) (NAME:VALUE sets times)"
    assert summary + "\n      times (an integer, required): how many times" in listed.output
    assert runner.invoke(app, ["generate", "x", "-s", "help"]).output == listed.output
    # and once unregistered, it is gone from the list
    spec.unregister(NAME)
    assert NAME not in runner.invoke(app, ["speculators"]).output


def test_bench_runs_it_next_to_plain_decoding(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "q.jsonl"
    data.write_text(
        json.dumps({"question_id": 321, "category": "qa", "turns": ["First Citizen: Hear me"]})
        + "\n",
        encoding="utf-8",
    )
    out = tmp_path / "out"
    methods = ["none", f"{NAME}:times=2"]
    result = runner.invoke(app, [
        "bench", "--model", str(tiny_model_dir), "--dataset", str(data), "--methods",
        ",".join(methods), "--max-new-tokens", "12", "--out", str(out), "--no-plots",
        "--threads", "1",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == methods  # the label is the spec as written
    assert all(r["identical"] for r in rows)
    assert f"| `{NAME}:times=2` |" in (out / "report.md").read_text()


# -- the grammar ----------------------------------------------------------------------------


def test_split_specs_keeps_options_and_brackets_with_their_spec() -> None:
    text = "none, eagle:dir=d,tree=5x4x24,auto:arms=[suffix,draft:model=m,k=3],hf,self:[exit:2,3]"
    assert split_specs(text) == [
        "none", "eagle:dir=d,tree=5x4x24", "auto:arms=[suffix,draft:model=m,k=3]", "hf",
        "self:[exit:2,3]",
    ]  # fmt: skip
    assert split_specs(f"{NAME}:times=2,k=3,none") == [f"{NAME}:times=2,k=3", "none"]
    assert split_specs(" , ") == []


@pytest.mark.parametrize(
    "text,canonical",
    [
        (NAME + ":2", NAME + ":times=2"),  # a bare first value sets the primary option
        (NAME + ":times=2,k=4", NAME + ":k=4,times=2"),
        ("none", "none"),
        ("prompt-lookup:max_ngram=4", "prompt-lookup:max_ngram=4"),
        ("draft:layers:8", "draft:model=layers:8"),
        ("medusa:heads,tree=calibrated:8", "medusa:dir=heads,tree=calibrated:8"),
        ("eagle:dir=e3,tree=6x8x60", "eagle:dir=e3,tree=6x8x60"),
        ("self:layers=[skip:2-4,7]", "self:layers=[skip:2-4,7]"),
        ("auto:arms=suffix+prompt-lookup", "auto:arms=[suffix,prompt-lookup]"),
        (
            f"auto:arms=[suffix:alpha=2.0,{NAME}:times=3]",
            f"auto:arms=[suffix:alpha=2.0,{NAME}:times=3]",
        ),
    ],
)
def test_parse_and_format_round_trip(text: str, canonical: str) -> None:
    options = parse_spec(text)
    assert format_spec(options) == canonical
    assert parse_spec(canonical) == options
    assert parse_spec(options) is options  # an options object passes through


def test_options_from_python_values_equal_the_parsed_ones() -> None:
    assert parse_spec(f"{NAME}:times=2,k=3") == RepeatOptions(times=2, k=3)
    assert spec.options_for(NAME, times=2) == RepeatOptions(times=2)


@pytest.mark.parametrize(
    "text,error,words",
    [
        (
            "telepathy",
            UnknownSpeculatorError,
            f"unknown speculator 'telepathy'; available: .*{NAME}",
        ),
        (f"{NAME}:tims=2", ConfigError, f"'{NAME}' has no option 'tims'; its options: k, times"),
        (f"{NAME}:times=two", ConfigError, "option times must be an integer, got 'two'"),
        (f"{NAME}:times=2,k=0", ConfigError, "option k must be >= 1"),
        (f"{NAME}:times=0", ConfigError, "times must be >= 1"),
        (NAME, ConfigError, f"'{NAME}' needs times=.*how many times.*write {NAME}:times=VALUE"),
        (f"{NAME}:", ConfigError, "has ':' but no options"),
        (f"{NAME}:times=2,,k=1", ConfigError, "empty option"),
        (f"{NAME}:times=2,times=3", ConfigError, "sets times twice"),
        ("prompt-lookup:4", ConfigError, "'4' is not KEY=VALUE"),
        ("lookahead:context_ngrams=maybe", ConfigError, "must be true or false"),
        ("auto:arms=[suffix,none", ConfigError, r"unbalanced '\['"),
        ("auto:arms=suffix]", ConfigError, r"unbalanced '\]'"),
        ("auto:arms=suffix+telepathy", UnknownSpeculatorError, "unknown speculator 'telepathy'"),
        ("", ConfigError, "non-empty string"),
    ],
)
def test_every_mistake_is_named(text: str, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        parse_spec(text)


def test_an_options_class_belongs_to_one_name() -> None:
    with pytest.raises(ConfigError, match="already registered for 'test-repeat'"):
        register("test-repeat-2", RepeatOptions)(lambda target, options: RepeatLast(1))
    spec.unregister(NAME)
    with pytest.raises(UnknownSpeculatorError, match="unknown speculator 'test-repeat'"):
        parse_spec(f"{NAME}:times=2")
    with pytest.raises(UnknownSpeculatorError, match="not registered"):
        format_spec(RepeatOptions(times=2))


def test_generate_and_serve_share_the_engine_options_and_the_old_ones_are_gone() -> None:
    import typer

    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]

    def flags(name: str) -> set[str]:
        return {flag for param in commands[name].params for flag in param.opts}

    engine = {"--model", "--gguf", "--speculator", "-s", "--num-draft-tokens", "-k",
              "--adaptive", "--typical", "--dtype", "--threads"}  # fmt: skip
    assert engine <= flags("generate") and engine <= flags("serve")
    old = {"--method", "--draft", "--medusa", "--tree", "--lookahead", "--suffix-cache",
           "--self-draft", "--arms", "--osd", "--eagle", "--eagle-tree"}  # fmt: skip
    assert not old & (flags("generate") | flags("serve") | flags("bench"))
