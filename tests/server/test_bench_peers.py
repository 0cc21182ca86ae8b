"""The peer benchmark's client side against a real server: levels, and what fails a run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import Server

pytestmark = pytest.mark.slow(threads=1)  # servers in subprocesses

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import peers  # noqa: E402


def test_a_level_counts_tokens_and_compares_answers_with_solo(tiny_server: Server) -> None:
    model = httpx.get(f"{tiny_server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    server = peers.Running(proc=None, url=tiny_server.url, model=model, start_s=0.0)  # type: ignore[arg-type]
    prompts = ["Count: one two three", "Name a colour."]
    solo = peers.level(server, prompts, clients=1, requests=2, max_tokens=6)
    both = peers.level(server, prompts, clients=2, requests=3, max_tokens=6)
    for lv, n in ((solo, 2), (both, 3)):
        assert (lv["lost"], lv["truncated"], lv["tokens"]) == (0, 0, 6 * n)
        assert lv["tok_s"] > 0 and lv["itl_p50_ms"] >= 0
    answers = dict(solo["answers"])
    assert all(text == answers[p] for p, text in both["answers"])  # greedy, batched = solo


def test_only_specdec_answers_that_differ_from_solo_fail_the_run() -> None:
    def record(name: str, kind: str, mixed: int) -> dict[str, Any]:
        lv = {"clients": 4, "lost": 0, "mixed": mixed, "truncated": 0}
        return {"name": name, "kind": kind, "levels": [lv]}

    results = {
        "targets": {
            "bundled": [
                record("llama", "llama", 3),
                record("specdec", "specdec", 1),
                {"name": "vllm", "kind": "vllm", "start_error": "boom"},
            ]
        }
    }
    assert peers.failures(results) == ["specdec at 4 clients: 1 mixed", "vllm: did not start"]


def test_a_spec_carries_serve_options_and_a_busy_core_leaves_threads_to_the_plan(
    tmp_path: Path,
) -> None:
    import argparse

    args = argparse.Namespace(
        specdec_bundled="prompt-lookup;prompt-lookup --prefill-chunk 32",
        max_batch=16,
        threads=2,
        busy_core=None,
        peers=set(),
    )
    plain, chunked = peers.specs_for("bundled", None, args, tmp_path, None)
    assert (plain.name, chunked.name) == (
        "bundled-specdec-prompt-lookup",
        "bundled-specdec-prompt-lookup-prefill-chunk-32",
    )
    assert chunked.argv[-2:] == ["--prefill-chunk", "32"] and "--threads" in chunked.argv
    args.busy_core = 1
    assert all(
        "--threads" not in s.argv for s in peers.specs_for("bundled", None, args, tmp_path, None)
    )
