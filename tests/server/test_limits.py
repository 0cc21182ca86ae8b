"""Admission limits of a live server with no waiting room (``--max-queue 0``): a request that
arrives while another is decoding gets 429 with Retry-After, and a request over its time budget
ends with a timeout error (504, or an error event once streaming has begun)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from .conftest import TINY_NAME, Server

pytestmark = pytest.mark.slow(threads=1)  # servers in subprocesses

SHORT = {"model": TINY_NAME, "prompt": "hello there", "max_tokens": 4, "temperature": 0}
LONG = {**SHORT, "max_tokens": 500, "ignore_eos": True}  # takes well over 0.3 s


def _wait_idle(server: Server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while server.health()["busy"]:
        assert time.monotonic() < deadline, "server stayed busy"
        time.sleep(0.02)


def test_full_queue_answers_429_with_retry_after(strict_server: Server) -> None:
    client = strict_server.client()
    stream = client.completions.create(
        model=TINY_NAME,
        prompt=LONG["prompt"],
        max_tokens=500,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)  # the long request is being decoded now
    with strict_server.http() as http:
        busy = http.post("/v1/completions", json=SHORT)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(
                model=TINY_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        next(chunks)  # still decoding after both probes: they really met a busy server
        stream.close()  # hang up; the server drops the long request at its next step
        _wait_idle(strict_server)
        fine = http.post("/v1/completions", json=SHORT)
        metrics = http.get("/metrics").text
    assert busy.status_code == 429
    assert int(busy.headers["retry-after"]) >= 1
    err = busy.json()["error"]
    assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
    assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] >= 1
    assert 'specdec_requests_total{endpoint="/v1/completions",outcome="rejected"} 1.0' in metrics
    assert (
        'specdec_requests_total{endpoint="/v1/chat/completions",outcome="rejected"} 1.0' in metrics
    )


def test_requests_over_their_time_budget_time_out(strict_server: Server) -> None:
    client = strict_server.client()
    # streaming: the status is already 200, so the timeout arrives as an error event
    with pytest.raises(openai.APIError, match="timeout"):
        for _ in client.completions.create(
            model=TINY_NAME,
            prompt=LONG["prompt"],
            max_tokens=500,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "timeout": 0.3},
        ):
            pass
    _wait_idle(strict_server)
    with strict_server.http() as http:
        slow = http.post("/v1/completions", json={**LONG, "timeout": 0.3})
        assert slow.status_code == 504 and slow.json()["error"]["code"] == "request_timeout"
        _wait_idle(strict_server)
        fine = http.post("/v1/completions", json={**SHORT, "timeout": 30})
        assert fine.status_code == 200
        bad = http.post("/v1/completions", json={**SHORT, "timeout": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "timeout"
        metrics = http.get("/metrics").text
    assert 'specdec_requests_total{endpoint="/v1/completions",outcome="timeout"} 2.0' in metrics
    assert strict_server.health()["status"] == "ok"


def test_health_survives_garbage(strict_server: Server) -> None:
    with httpx.Client(base_url=strict_server.url, timeout=10) as http:
        r = http.post(
            "/v1/completions",
            content=b"\xff\xfe not json at all",
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        assert http.get("/v1/completions").status_code == 405
    assert strict_server.health()["status"] == "ok"
