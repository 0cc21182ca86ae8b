"""The suffix cache behind the server: it learns from one request for the next, and its file
carries what it learned into a restarted server. Outputs never change."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import TINY_NAME, run_server

pytestmark = pytest.mark.slow(threads=1)  # servers in subprocesses

PROMPT = "KING RICHARD III: Now is the winter of our discontent"


def _complete(server) -> tuple[str, dict]:
    reply = server.client().completions.create(
        model=TINY_NAME, prompt=PROMPT, max_tokens=32, temperature=0
    )
    return reply.choices[0].text, reply.model_extra["speculation"]


def test_suffix_cache_learns_across_requests_and_restarts(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "suffix.cache"
    args = ["--model", str(tiny_model_dir), "--speculator", f"suffix:cache={cache}",
            "--served-model-name", TINY_NAME]  # fmt: skip
    with run_server(args, tmp_path / "first.log") as server:
        first_text, first = _complete(server)
        again_text, again = _complete(server)
        assert server.health()["speculator"] == f"suffix:cache={cache}"
    assert first["method"] == "suffix"
    assert again_text == first_text and len(first_text) > 0
    assert again["target_forwards"] < first["target_forwards"]  # drafted from the first answer
    assert cache.is_file()
    with run_server(args, tmp_path / "second.log") as server:
        restarted_text, restarted = _complete(server)
    assert restarted_text == first_text
    assert restarted["target_forwards"] < first["target_forwards"]  # remembered from the file
