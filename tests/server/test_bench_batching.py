"""The batching benchmark's client side against a real server: its all-clients-busy window."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from .conftest import Server

pytestmark = pytest.mark.slow(threads=1)  # servers in subprocesses

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import batching  # noqa: E402


def test_the_busy_window_ends_when_the_first_client_runs_out_of_requests(
    tiny_server: Server,
) -> None:
    model = httpx.get(f"{tiny_server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    server = SimpleNamespace(
        url=tiny_server.url,
        model=model,
        decoded_tokens=lambda: batching.decoded_tokens(tiny_server.url),
    )
    before = batching.decoded_tokens(tiny_server.url)
    busy = batching.Busy()
    results, wall = batching.run_clients(server, 2, 5, [8], busy=busy)  # type: ignore[arg-type]
    assert [r.error for r in results if not r.ok] == []
    assert [r.tokens for r in results] == [8] * 5
    # the counter saw every token, and the window only those before one client went idle
    assert batching.decoded_tokens(tiny_server.url) - before == 40
    assert 0 < busy.seconds < wall
    assert 0 < busy.tokens <= 40
