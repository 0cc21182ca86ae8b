"""Many real clients at once: fair queueing, no mixed streams, bounded memory, disconnects."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from .conftest import TINY_NAME, Server
from .test_api import metric_samples

pytestmark = pytest.mark.slow(threads=1)  # servers in subprocesses

LINES = [
    "First Citizen: Before we proceed any further, hear me speak.",
    "MENENIUS: What work's, my countrymen, in hand? where go you",
    "CORIOLANUS: Thanks. What's the matter, you dissentious rogues,",
    "VOLUMNIA: I pray you, daughter, sing; or express yourself",
    "BRUTUS: Being mov'd, he will not spare to gird the gods.",
    "SICINIUS: Such a nature, tickled with good success, disdains",
    "LARTIUS: So, the good horse is mine. Agreed.",
    "AUFIDIUS: Is it not yours? What ever have been thought on",
]
PROMPTS = [f"{line} {i}" for i in range(2) for line in LINES]  # 16 distinct prompts
CLIENTS = 16
REQUESTS_EACH = 2
MAX_TOKENS = 16
RSS_GROWTH_LIMIT = 150 * 2**20


class _Sampler(threading.Thread):
    """Peak RSS of the server process and peak queue depth while the clients run."""

    def __init__(self, server: Server) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.proc = psutil.Process(server.proc.pid)
        self.peak_rss = self.proc.memory_info().rss
        self.peak_queue = 0
        self.stop = threading.Event()

    def run(self) -> None:
        with self.server.http() as http:
            while not self.stop.is_set():
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
                depth = http.get("/health").json()["queue_depth"]
                self.peak_queue = max(self.peak_queue, depth)
                time.sleep(0.05)


def test_concurrent_streaming_clients_get_their_own_exact_output(tiny_server: Server) -> None:
    client = tiny_server.client()
    reference = {
        p: client.completions.create(
            model=TINY_NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0
        )
        .choices[0]
        .text
        for p in PROMPTS
    }
    assert len(set(reference.values())) == len(PROMPTS), "distinct outputs reveal any mix-up"
    rss_before = psutil.Process(tiny_server.proc.pid).memory_info().rss
    sampler = _Sampler(tiny_server)
    sampler.start()

    def one_client(i: int) -> list[tuple[str, str, str | None]]:
        own = tiny_server.client()  # its own connection pool, like a separate user
        got = []
        for r in range(REQUESTS_EACH):
            prompt = PROMPTS[(i + 5 * r) % len(PROMPTS)]
            if r % 2:
                stream = own.chat.completions.create(
                    model=TINY_NAME,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    stream=True,
                )
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                got.append(("chat:" + prompt, text, None))
                continue
            chunks = list(
                own.completions.create(
                    model=TINY_NAME,
                    prompt=prompt,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    stream=True,
                )
            )
            ids = {c.id for c in chunks}
            assert len(ids) == 1, "every chunk of a stream carries the stream's own id"
            got.append(
                (
                    prompt,
                    "".join(c.choices[0].text for c in chunks if c.choices),
                    chunks[-1].choices[0].finish_reason,
                )
            )
        return got

    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            results = [r for rs in pool.map(one_client, range(CLIENTS)) for r in rs]
    finally:
        sampler.stop.set()
        sampler.join()
    chat_refs = {
        p: client.chat.completions.create(
            model=TINY_NAME,
            messages=[{"role": "user", "content": p}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        .choices[0]
        .message.content
        for p in {p.removeprefix("chat:") for p, _, _ in results if p.startswith("chat:")}
    }
    assert len(results) == CLIENTS * REQUESTS_EACH
    for prompt, text, finish in results:
        if prompt.startswith("chat:"):
            assert text == chat_refs[prompt.removeprefix("chat:")], prompt
        else:
            assert text == reference[prompt], prompt
            assert finish in ("length", "stop")
    assert sampler.peak_queue >= 2, "the clients really overlapped"
    assert sampler.peak_rss - rss_before < RSS_GROWTH_LIMIT
    health = tiny_server.health()
    assert health["status"] == "ok" and health["queue_depth"] == 0 and not health["busy"]


def _wait_idle(server: Server, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        h = server.health()
        if not h["busy"] and h["queue_depth"] == 0:
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"server still busy after {timeout} s: {server.health()}")


def test_disconnecting_clients_are_cancelled_and_server_keeps_serving(tiny_server: Server):
    long = {
        "model": TINY_NAME,
        "prompt": "KING RICHARD III: Now is the winter",
        "max_tokens": 480,
        "temperature": 0,
        "ignore_eos": True,
    }
    before = metric_samples(tiny_server)
    hung_up = 0
    with tiny_server.http() as http:
        for _ in range(3):  # streaming clients that read two chunks, then hang up
            with http.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                assert r.status_code == 200
                data_lines = 0
                for line in r.iter_lines():
                    data_lines += line.startswith("data: ")
                    if data_lines == 2:
                        break
            hung_up += 1
            _wait_idle(tiny_server, 3.0)  # stopped at the next step, not after 480 tokens
    # a non-streaming client that gives up while its request is being decoded
    try:
        httpx.post(f"{tiny_server.url}/v1/completions", json=long, timeout=0.3)
    except httpx.ReadTimeout:
        hung_up += 1
    assert hung_up == 4
    _wait_idle(tiny_server, 3.0)
    after = metric_samples(tiny_server)
    cancelled = (
        "specdec_requests_total",
        (("endpoint", "/v1/completions"), ("outcome", "cancelled")),
    )
    assert after[cancelled] - before.get(cancelled, 0) == 4
    made = (
        after[("specdec_completion_tokens_total", ())]
        - before[("specdec_completion_tokens_total", ())]
    )
    assert made < 4 * 480 / 2, "abandoned requests were not decoded to the end"
    ok = tiny_server.client().completions.create(
        model=TINY_NAME, prompt="hello", max_tokens=5, temperature=0
    )
    assert ok.usage.completion_tokens >= 1
    assert tiny_server.health()["status"] == "ok"
