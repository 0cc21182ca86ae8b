"""The README's examples on the bundled model, run as a user would run them.

Every command in the README's ```bash blocks is either run here, through the installed
``specdec`` script in a fresh working directory, or set aside by a rule that says why (an install
step, the Qwen pair, a server, training, the usage synopsis). A command no rule covers fails the
test, so a new example is run or consciously set aside, and an example that stops running (a
renamed option, a removed speculator) fails here before a user meets it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

README = REPO / "README.md"
TIMEOUT_S = 600  # per command; each takes well under a minute on one idle core

# (rule, why a matching command is not run here); the first matching rule wins.
SET_ASIDE: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\binstall\.sh\b|\bpip\b"), "an install step"),
    (re.compile(r"--qwen-pair|qwen", re.I), "the Qwen pair (1.6 GB of wheels; not in CI)"),
    (re.compile(r"\bpytest\b"), "the test suite itself"),
    (re.compile(r"\[--|\|"), "the usage synopsis, not a command"),
    (re.compile(r"\bspecdec serve\b|\bcurl\b"), "a long-running server (tests/server run it)"),
    (
        re.compile(r"\bspecdec (data|train)\b"),
        "training (downloads ShareGPT, minutes; tests/test_training_loop et al. cover it)",
    ),
    (re.compile(r":dir=|\bmedusa:"), "a head the user trained first"),
]
# Shortened so that each run takes seconds: options appended after the README's own, where the
# last occurrence of an option wins. Everything else runs exactly as written.
SHORTER: list[tuple[re.Pattern[str], list[str]]] = [
    (
        re.compile(r"\bspecdec bench\b(?!.*--quick)"),
        ["--per-category", "1", "--max-new-tokens", "16"],
    ),
]


def bash_commands(markdown: str) -> list[str]:
    """Every command line in the ```bash blocks: continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", markdown, re.S | re.M):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def set_aside_reason(command: str) -> str | None:
    bare = " ".join(shlex.split(command, comments=True))  # without a trailing comment
    for rule, why in SET_ASIDE:
        if rule.search(bare):
            return why
    return None


COMMANDS = bash_commands(README.read_text(encoding="utf-8"))
RUN = [c for c in COMMANDS if set_aside_reason(c) is None]


def llama_cpp_installed() -> bool:
    from specdec.target import llamacpp

    return llamacpp.available()


def specdec_argv(command: str) -> list[str]:
    """The command's argv with ``specdec`` / ``.venv/bin/specdec`` as the installed script."""
    words = shlex.split(command, comments=True)
    assert Path(words[0]).name == "specdec", f"not a specdec command: {command}"
    script = Path(sys.executable).with_name("specdec")
    head = [str(script)] if script.is_file() else [sys.executable, "-m", "specdec.cli.main"]
    extra = [arg for rule, args in SHORTER if rule.search(command) for arg in args]
    return head + words[1:] + extra


def test_the_readme_has_bundled_model_examples():
    """The parse found the examples a user starts with (so the test below runs something)."""
    assert any(re.search(r"specdec generate .*--compare", c) for c in RUN), RUN
    assert any(c.startswith("specdec bench") for c in RUN), RUN
    assert any(c.startswith("specdec export") for c in RUN), RUN


@pytest.mark.parametrize("command", RUN, ids=[c[:60] for c in RUN])
def test_readme_command_runs(command: str, smol_dir: Path, tmp_path: Path):
    """Exit 0 and the parts the README says the command prints (smol_dir: the bundled model,
    converted once into the tests' shared store, or the test skips where it is not installed)."""
    proc = subprocess.run(
        specdec_argv(command),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "COLUMNS": "200"},
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{command}\n{output[-4000:]}"
    assert "Traceback" not in output
    sub = shlex.split(command, comments=True)[1]
    if sub == "generate":
        assert proc.stdout.strip(), output  # the generated text
        assert re.search(r"\d tok/s", output), output
        if "--compare" in command:
            for part in ("τ (mean accepted)", "acceptance by position", "plain decoding:"):
                assert part in output, output
            assert re.search(r"speedup\s+\d+\.\d+x", output), output
            assert re.search(r"identical to plain greedy\s+yes", output), output
            if "--model" not in command and llama_cpp_installed():  # the bundled GGUF
                assert re.search(r"vs llama\.cpp plain\s+\d+\.\d+x", output), output
    elif sub == "bench":
        report = next(tmp_path.rglob("report.md"), None)  # in --out, or the default folder
        assert report is not None, f"no report.md under {tmp_path}\n{output}"
        assert "## Overall" in report.read_text()
        assert (report.parent / "results.jsonl").is_file()
    elif sub == "speculators":
        for name in ("prompt-lookup", "suffix", "draft", "eagle", "auto"):
            assert name in output, output
    elif sub == "export":
        assert "vllm serve" in output, output
    else:
        pytest.fail(f"no expectations for `specdec {sub}`: add them here ({command})")


def test_every_command_not_set_aside_is_a_specdec_command():
    """A new kind of example (another tool, a script) needs a rule above, not a silent skip."""
    for command in RUN:
        assert Path(shlex.split(command, comments=True)[0]).name == "specdec", command
