"""Continuous batching in a live server, through the official ``openai`` client.

The main test server batches (``--max-batch`` 8, prompt lookup); the strict server decodes one
request at a time with no speculation, so its greedy outputs are the serial reference. Both run
the tiny float32 model with one thread; the batched pass and the single pass of a tiny model
agree far below the margin of its (large-init, peaked) argmaxes, so outputs compare exactly.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import TINY_NAME, Server, run_server

pytestmark = pytest.mark.slow(threads=1)  # servers in subprocesses

PROMPTS = [
    "ROMEO: But soft, what light through yonder window breaks?",
    "First Citizen: Before we proceed any further, hear me speak.",
    "the the the the the the the the",
    "KING RICHARD III: Now is the winter of our discontent",
    "To be, or not to be, that is the question:",
    "a b c a b c a b c a b c",
    "hello",
    "ROMEO: But soft, what light through yonder window breaks?",
]


def _complete(server: Server, prompt: str, max_tokens: int = 24) -> str:
    out = server.client().completions.create(
        model=TINY_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return out.choices[0].text


def test_concurrent_requests_equal_serial_ones(tiny_server: Server, strict_server: Server) -> None:
    serial = [_complete(strict_server, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        batched = list(pool.map(lambda p: _complete(tiny_server, p), PROMPTS))
    assert batched == serial
    with tiny_server.http() as http:
        metrics = http.get("/metrics").text
    sizes = {
        s.labels["le"]: s.value
        for f in text_string_to_metric_families(metrics)
        if f.name == "specdec_batch_size"
        for s in f.samples
        if s.name.endswith("_bucket")
    }
    assert sizes["+Inf"] > 0
    assert sizes["1.0"] < sizes["+Inf"], "no step ever verified more than one sequence"


def test_streams_with_disconnects_leave_the_others_whole(
    tiny_server: Server, strict_server: Server
) -> None:
    serial = [_complete(strict_server, p, max_tokens=40) for p in PROMPTS[:6]]
    texts: dict[int, str] = {}

    def stream(i: int) -> None:
        chunks = tiny_server.client().completions.create(
            model=TINY_NAME, prompt=PROMPTS[i], max_tokens=40, temperature=0, stream=True
        )
        parts = []
        for n, chunk in enumerate(chunks):
            if chunk.choices:
                parts.append(chunk.choices[0].text)
            if i % 2 and n == 1:
                chunks.close()  # hang up mid-stream
                return
        texts[i] = "".join(parts)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(texts) == [0, 2, 4]
    for i, text in texts.items():
        assert text == serial[i]
    deadline = time.monotonic() + 10
    while tiny_server.health()["busy"]:  # every row freed, abandoned ones included
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_n_choices_are_independently_seeded_members_of_the_batch(tiny_server: Server) -> None:
    client = tiny_server.client()
    kw = {"model": TINY_NAME, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 1.0}
    kw["extra_body"] = {"ignore_eos": True}  # every choice makes exactly 12 tokens
    many = client.completions.create(n=3, seed=11, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    singles = [client.completions.create(seed=11 + i, **kw).choices[0].text for i in range(3)]
    assert [c.text for c in many.choices] == singles
    assert len(set(singles)) > 1
    assert many.usage.completion_tokens == 36
    assert many.usage.total_tokens == many.usage.prompt_tokens + 36

    chat = client.chat.completions.create(
        model=TINY_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=10,
        temperature=1.0,
        seed=5,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts: dict[int, list[str]] = {0: [], 1: []}
    finishes: dict[int, str] = {}
    usage = []
    for chunk in chat:
        if chunk.usage is not None:
            usage.append(chunk.usage)
        for c in chunk.choices:
            parts[c.index].append(c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert set(finishes) == {0, 1} and len(usage) == 1
    whole = client.chat.completions.create(
        model=TINY_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=10,
        temperature=1.0,
        seed=5,
        n=2,
    )
    assert ["".join(parts[i]) for i in (0, 1)] == [c.message.content for c in whole.choices]


def test_a_full_batch_with_no_waiting_room_answers_429(tmp_path: Path, tiny_model_dir) -> None:
    args = ["--model", str(tiny_model_dir), "--served-model-name", TINY_NAME]
    args += ["--speculator", "none"]
    args += ["--max-batch", "2", "--max-queue", "0"]
    with run_server(args, tmp_path / "batch2.log") as server:
        client = server.client()
        long = {"model": TINY_NAME, "prompt": "hello", "max_tokens": 400, "temperature": 0}
        streams = [
            client.completions.create(stream=True, extra_body={"ignore_eos": True}, **long)
            for _ in range(2)
        ]
        iters = [iter(s) for s in streams]
        for it in iters:
            next(it)  # both decode now, side by side
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=TINY_NAME, prompt="hi", max_tokens=2)
        assert server.health()["max_batch"] == 2
        next(iters[0])  # still decoding: the refusal met a full batch
        for s in streams:
            s.close()
        deadline = time.monotonic() + 10
        while server.health()["busy"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            fine = http.post("/v1/completions", json={**long, "max_tokens": 3})
        assert fine.status_code == 200
