"""The real bundled model (SmolLM2-135M-Instruct) behind the server: greedy chat output equals
``specdec generate``'s, streamed or not, and prompt lookup really accepts drafts."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import SMOL_NAME, CliRun, run_server

QUESTION = "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog."


@pytest.mark.slow
def test_smol_chat_greedy_equals_cli_and_speculates(smol_dir: Path, tmp_path: Path) -> None:
    reference = CliRun(smol_dir, QUESTION, "--chat", "-n", "24", "--speculator", "prompt-lookup")
    try:
        args = [
            "--model",
            str(smol_dir),
            "--speculator",
            "prompt-lookup",
            "--served-model-name",
            SMOL_NAME,
        ]
        with run_server(args, tmp_path / "server.log") as server:
            client = server.client()
            messages = [{"role": "user", "content": QUESTION}]
            whole = client.chat.completions.create(
                model=SMOL_NAME, messages=messages, max_tokens=24, temperature=0
            )
            streamed = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(
                    model=SMOL_NAME,
                    messages=messages,
                    max_tokens=24,
                    temperature=0,
                    stream=True,
                )
                if c.choices
            )
        ref = reference.result()
    finally:
        reference.kill()
    assert whole.choices[0].message.content == streamed == ref["text"]
    assert "quick brown fox" in streamed  # a real model answering, not noise
    spec = whole.model_extra["speculation"]
    assert spec["method"] == "prompt-lookup"
    assert spec["accepted_tokens"] > 0 and spec["mean_accepted"] > 1.0  # copying pays off
    assert whole.usage.completion_tokens == len(ref["token_ids"])
