"""The OpenAI-compatible API against a live server, through the official ``openai`` client."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from .conftest import CHAT_QUESTION as CHAT_Q
from .conftest import COMPLETION_PROMPT as PROMPT
from .conftest import TINY_NAME, CliRun, Server

pytestmark = pytest.mark.slow(threads=1)  # servers in subprocesses


def _stream_completion(client: OpenAI, **kwargs: Any) -> tuple[str, str | None, Any, dict]:
    chunks = list(
        client.completions.create(
            model=TINY_NAME, stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert all(f is None for f in finishes[:-1]), "finish_reason only on the last choice chunk"
    spec = [
        c.model_extra["speculation"] for c in chunks if (c.model_extra or {}).get("speculation")
    ]
    assert len(spec) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    return text, finishes[-1], chunks[-1].usage, spec[0]


def test_models_and_health(tiny_server: Server) -> None:
    models = tiny_server.client().models.list()
    assert [m.id for m in models.data] == [TINY_NAME]
    assert tiny_server.client().models.retrieve(TINY_NAME).id == TINY_NAME
    health = tiny_server.health()
    assert health["status"] == "ok" and health["method"] == "prompt-lookup"
    assert health["speculator"] == "prompt-lookup"  # the spec served, as given to --speculator
    assert tiny_server.client().models.retrieve(TINY_NAME).model_extra["speculator"] == (
        "prompt-lookup"
    )
    assert health["context_length"] == 512


def test_completion_stream_equals_whole_equals_cli(
    tiny_server: Server, cli_references: dict[str, CliRun]
) -> None:
    client = tiny_server.client()
    whole = client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=40, temperature=0)
    text, finish, usage, spec = _stream_completion(
        client, prompt=PROMPT, max_tokens=40, temperature=0
    )
    ref = cli_references["completion"].result()
    assert whole.choices[0].text == text == ref["text"]
    assert whole.choices[0].finish_reason == finish == ref["finish_reason"]
    assert whole.usage.completion_tokens == usage.completion_tokens == len(ref["token_ids"])
    assert whole.usage.prompt_tokens == usage.prompt_tokens == ref["stats"]["prompt_tokens"]
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    extra = whole.model_extra["speculation"]
    assert extra["method"] == spec["method"] == "prompt-lookup"
    forwards, accepted, drafted = (
        extra[k] for k in ("target_forwards", "accepted_tokens", "drafted_tokens")
    )
    assert forwards > 0 and drafted >= accepted
    assert extra["mean_accepted"] == pytest.approx((accepted + forwards) / forwards, abs=1e-4)
    assert extra["acceptance_rate"] == pytest.approx(
        accepted / drafted if drafted else 0.0, abs=1e-4
    )
    assert extra["target_forwards"] <= whole.usage.completion_tokens + 1
    assert extra["accepted_tokens"] == spec["accepted_tokens"]  # same greedy run


def test_chat_stream_equals_whole(tiny_server: Server) -> None:
    client = tiny_server.client()
    messages = [{"role": "user", "content": CHAT_Q}]
    whole = client.chat.completions.create(
        model=TINY_NAME, messages=messages, max_tokens=30, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=TINY_NAME,
            messages=messages,
            max_completion_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == streamed
    assert whole.choices[0].finish_reason == chunks[-2].choices[0].finish_reason
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens
    # The chat template was applied: it wraps the question as <|user|>...<eos><|assistant|>,
    # which is exactly what a completion of the templated text continues.
    templated = f"<|user|>{CHAT_Q}<eos><|assistant|>"
    same = client.completions.create(
        model=TINY_NAME, prompt=templated, max_tokens=30, temperature=0
    )
    assert same.usage.prompt_tokens == whole.usage.prompt_tokens
    assert same.choices[0].text == whole.choices[0].message.content


def test_stop_seed_and_token_prompt(tiny_server: Server) -> None:
    client = tiny_server.client()
    full = (
        client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=40, temperature=0)
        .choices[0]
        .text
    )
    # a stop string from the middle of the greedy text: output ends right before it
    at = next(
        i
        for i in range(3, len(full) - 2)
        if full[i : i + 2].isascii() and full[i : i + 2].isalpha()
    )
    stop = full[at : at + 2]
    first = full.find(stop)
    stopped = client.completions.create(
        model=TINY_NAME, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "\x00never"]
    )
    assert stopped.choices[0].text == full[:first]
    assert stopped.choices[0].finish_reason == "stop"
    streamed, finish, _, _ = _stream_completion(
        client, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop
    )
    assert (streamed, finish) == (full[:first], "stop")
    # sampling with a seed is reproducible, streamed or not
    kw: dict[str, Any] = dict(prompt=PROMPT, max_tokens=24, temperature=0.9, top_p=0.95)
    a = client.completions.create(model=TINY_NAME, seed=1234, **kw).choices[0].text
    b = _stream_completion(client, seed=1234, **kw)[0]
    assert a == b
    others = {
        client.completions.create(model=TINY_NAME, seed=s, **kw).choices[0].text for s in (1, 2, 3)
    }
    assert others - {a}, "different seeds should not all give the seed-1234 text"
    # a prompt given as token ids decodes like the same text
    with tiny_server.http() as http:
        usage = client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=1).usage
        ids = list(range(5, 5 + usage.prompt_tokens))
        r = http.post(
            "/v1/completions",
            json={"model": TINY_NAME, "prompt": ids, "max_tokens": 3, "temperature": 0},
        )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)


LONG = "the " * 2000  # far beyond the tiny model's 512-token context
OK = {"model": TINY_NAME, "prompt": "hello", "max_tokens": 4}
OK_CHAT = {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD: list[tuple[str, str, Any, int, str | None]] = [
    # (id, path, body (str = raw bytes), status, param)
    ("malformed-json", "/v1/completions", '{"model": "tiny", "prompt": "x",', 400, None),
    ("not-an-object", "/v1/chat/completions", "[1, 2]", 400, None),
    ("missing-prompt", "/v1/completions", {"model": TINY_NAME}, 400, "prompt"),
    ("missing-model", "/v1/completions", {"prompt": "x"}, 400, "model"),
    ("missing-messages", "/v1/chat/completions", {"model": TINY_NAME}, 400, "messages"),
    ("empty-messages", "/v1/chat/completions", {**OK_CHAT, "messages": []}, 400, "messages"),
    (
        "bad-role",
        "/v1/chat/completions",
        {**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages.0.role",
    ),
    ("unknown-model", "/v1/completions", {**OK, "model": "gpt-9"}, 404, "model"),
    ("unknown-model-chat", "/v1/chat/completions", {**OK_CHAT, "model": "gpt-9"}, 404, "model"),
    ("max-tokens-0", "/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens"),
    (
        "max-tokens-negative",
        "/v1/chat/completions",
        {**OK_CHAT, "max_tokens": -3},
        400,
        "max_tokens",
    ),
    ("max-tokens-type", "/v1/completions", {**OK, "max_tokens": "many"}, 400, "max_tokens"),
    (
        "max-tokens-beyond-context",
        "/v1/completions",
        {**OK, "max_tokens": 100_000},
        400,
        "max_tokens",
    ),
    (
        "max-completion-tokens-beyond",
        "/v1/chat/completions",
        {**OK_CHAT, "max_tokens": None, "max_completion_tokens": 600},
        400,
        "max_completion_tokens",
    ),
    (
        "max-completion-tokens-0",
        "/v1/chat/completions",
        {**OK_CHAT, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    ("seed-overflow", "/v1/completions", {**OK, "seed": 2**70}, 400, "seed"),
    ("temperature-negative", "/v1/completions", {**OK, "temperature": -0.5}, 400, "temperature"),
    ("top-p-zero", "/v1/completions", {**OK, "top_p": 0}, 400, "top_p"),
    ("top-p-above-one", "/v1/chat/completions", {**OK_CHAT, "top_p": 1.5}, 400, "top_p"),
    ("prompt-too-long", "/v1/completions", {**OK, "prompt": LONG}, 400, "prompt"),
    (
        "chat-too-long",
        "/v1/chat/completions",
        {**OK_CHAT, "messages": [{"role": "user", "content": LONG}]},
        400,
        "messages",
    ),
    ("empty-prompt", "/v1/completions", {**OK, "prompt": "  "}, 400, "prompt"),
    ("token-out-of-vocab", "/v1/completions", {**OK, "prompt": [1, 99999]}, 400, "prompt"),
    ("n-0", "/v1/completions", {**OK, "n": 0}, 400, "n"),
    ("n-17-chat-stream", "/v1/chat/completions", {**OK_CHAT, "n": 17, "stream": True}, 400, "n"),
    (
        "bad-temperature-stream",
        "/v1/chat/completions",
        {**OK_CHAT, "temperature": -1, "stream": True},
        400,
        "temperature",
    ),
    ("empty-stop", "/v1/completions", {**OK, "stop": [""]}, 400, "stop"),
    ("echo-unsupported", "/v1/completions", {**OK, "echo": True}, 400, "echo"),
]


def test_bad_requests_get_openai_errors_and_server_keeps_serving(tiny_server: Server) -> None:
    with tiny_server.http() as http:
        for name, path, body, status, param in BAD:
            if isinstance(body, str):
                r = http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = http.post(path, json=body)
            assert r.status_code == status, (name, r.text)
            assert r.headers["content-type"].startswith("application/json"), name
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, name
            assert err["message"] and err["type"] == "invalid_request_error", name
            assert err["param"] == param, (name, err)
        # the server is unharmed: a good request, both endpoints
        assert http.post("/v1/completions", json=OK).status_code == 200
        assert http.post("/v1/chat/completions", json=OK_CHAT).status_code == 200
        assert http.get("/v1/nothing-here").json()["error"]["type"] == "not_found_error"
    assert tiny_server.health()["status"] == "ok"


def metric_samples(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_in_prometheus_format(tiny_server: Server) -> None:
    before = metric_samples(tiny_server)
    ok = ("specdec_requests_total", (("endpoint", "/v1/completions"), ("outcome", "ok")))
    client = tiny_server.client()
    for _ in range(2):
        client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    _stream_completion(client, prompt=PROMPT, max_tokens=12, temperature=0)
    with tiny_server.http() as http:
        http.post("/v1/completions", json={**OK, "top_p": 7})
    after = metric_samples(tiny_server)
    assert after[ok] - before.get(ok, 0) == 3
    invalid = ("specdec_requests_total", (("endpoint", "/v1/completions"), ("outcome", "invalid")))
    assert after[invalid] - before.get(invalid, 0) == 1
    gen = ("specdec_completion_tokens_total", ())
    assert after[gen] - before.get(gen, 0) >= 3
    # counted step by step as they are handed out; once the requests are over, the same total
    decoded = ("specdec_decoded_tokens_total", ())
    assert after[decoded] - before.get(decoded, 0) == after[gen] - before.get(gen, 0)
    ttft = ("specdec_time_to_first_token_seconds_count", ())
    assert after[ttft] - before.get(ttft, 0) == 3
    itl = ("specdec_inter_token_latency_seconds_count", ())
    assert after[itl] > before.get(itl, 0)
    m = (("method", "prompt-lookup"),)
    forwards = after[("specdec_target_forwards_total", m)]
    accepted = after[("specdec_accepted_tokens_total", m)]
    drafted = after[("specdec_drafted_tokens_total", m)]
    assert after[("specdec_tau", m)] == pytest.approx((accepted + forwards) / forwards)
    assert drafted >= accepted
    assert after[("specdec_acceptance_rate", m)] == pytest.approx(
        accepted / drafted if drafted else 0.0
    )
    assert after[("specdec_target_forwards_total", m)] > before.get(
        ("specdec_target_forwards_total", m), 0
    )
