"""Structured output and logprobs through the OpenAI-compatible API (in-process, tiny model).

``response_format`` (json_object, json_schema) and the ``grammar`` extra constrain the output;
``logprobs`` / ``top_logprobs`` come back in OpenAI's shapes and equal the library's plain
decoding; every OpenAI field the server does not implement is refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("llguidance")

from fastapi.testclient import TestClient  # noqa: E402

from specdec import SpeculativeEngine  # noqa: E402
from specdec.server.app import create_app  # noqa: E402
from specdec.server.config import ServerConfig  # noqa: E402
from specdec.target import load_model  # noqa: E402

CHAT = "/v1/chat/completions"
REGEX_A = {"type": "regex", "value": "a"}
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> SpeculativeEngine:
    loaded = load_model(tiny_model_dir, dtype="float64")
    return SpeculativeEngine.from_pretrained(loaded, speculator="prompt-lookup")


@pytest.fixture(scope="module")
def client(engine: SpeculativeEngine) -> Iterator[TestClient]:
    app = create_app(engine, ServerConfig(model_name="tiny"))
    with TestClient(app) as c:
        yield c


def chat(client: TestClient, **body):
    return client.post(CHAT, json={"model": "tiny", "messages": MESSAGES, **body})


def test_json_schema_response_format_is_honoured(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    r = chat(client, response_format=fmt, temperature=0, max_tokens=40)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    value = json.loads(choice["message"]["content"])
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)


def test_json_object_response_format_is_honoured(client):
    r = chat(client, response_format={"type": "json_object"}, temperature=0, max_tokens=48)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"]
    assert text.lstrip().startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


def test_grammar_extra_regex_and_ebnf(client):
    r = chat(client, grammar={"type": "regex", "value": "(yes|no)!"}, temperature=0.9, seed=3)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("yes!", "no!")
    ebnf = 'root ::= "A" [0-9] [0-9]?'  # llama.cpp GBNF
    r = client.post(
        COMPLETIONS,
        json={"model": "tiny", "prompt": "Code:", "grammar": {"type": "ebnf", "value": ebnf}},
    )
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text[0] == "A" and text[1:].isdigit() and 1 <= len(text) - 1 <= 2


def test_chat_logprobs_shape_and_values(client, engine):
    r = chat(client, logprobs=True, top_logprobs=3, temperature=0, max_tokens=12)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    raw = b"".join(bytes(item["bytes"]) for item in content)  # a token may end mid-character
    assert raw.decode("utf-8", errors="replace") == choice["message"]["content"]
    assert all(len(item["top_logprobs"]) == 3 for item in content)
    ref = engine.generate(
        MESSAGES,
        max_new_tokens=12,
        speculate=False,
        logprobs=True,
        top_logprobs=3,
    )
    assert [round(x["logprob"], 6) for x in content] == [
        round(lp.logprob, 6) for lp in ref.logprobs
    ]


def test_completion_logprobs_legacy_shape(client):
    body = {"model": "tiny", "prompt": "ROMEO:", "logprobs": 2, "max_tokens": 8, "temperature": 0}
    r = client.post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"][0] == 0
    assert all(len(top) <= 2 for top in lp["top_logprobs"])
    assert all(x <= 0.0 for x in lp["token_logprobs"])


def test_streamed_chat_carries_logprobs(client):
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "stream": True,
        "logprobs": True,
        "max_tokens": 10,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
    }
    text, tokens = "", []
    with client.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk.get("choices", []):
                text += choice["delta"].get("content") or ""
                if choice.get("logprobs"):
                    tokens += [item["token"] for item in choice["logprobs"]["content"]]
    assert text and "".join(tokens) == text
    assert text.startswith('{"ok"')


@pytest.mark.parametrize(
    "field,value",
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "auto"),
        ("logit_bias", {"5": 1}),
        ("presence_penalty", 0.5),
        ("audio", {"voice": "x"}),
        ("modalities", ["text", "audio"]),
        ("reasoning_effort", "low"),
        ("store", True),
        ("prediction", {"type": "content", "content": "x"}),
    ],
)
def test_unsupported_openai_fields_are_refused_by_name(client, field, value):
    r = chat(client, **{field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported" and err["param"] == field


@pytest.mark.parametrize(
    "body,param",
    [
        ({"grammar": {"type": "regex", "value": "(a|"}}, "grammar"),
        ({"response_format": {"type": "json_object"}, "grammar": REGEX_A}, "grammar"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ],
)
def test_bad_structured_requests_are_400(client, body, param):
    r = chat(client, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
