"""``MainThreadServer``: the engine loop runs on the calling (main) thread while uvicorn serves
from another, answers are the engine's own, a shutdown from any thread ends both, and a port
that is taken is a clear error rather than a hang."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from specdec import SpeculativeEngine
from specdec.server import ServerConfig, create_app
from specdec.server.host import MainThreadServer, ServeError

from .conftest import free_port

PROMPT = "ROMEO: But soft, what light"


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> SpeculativeEngine:
    return SpeculativeEngine.from_pretrained(tiny_model_dir, speculator="prompt-lookup")


def _wait_healthy(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError("server never became healthy")


@pytest.mark.parametrize("max_batch", [1, 4])
def test_engine_on_main_thread_http_beside_it(engine: SpeculativeEngine, max_batch: int) -> None:
    assert threading.current_thread() is threading.main_thread()  # pytest runs tests there
    expected = engine.generate(PROMPT, chat=False, max_new_tokens=16, ignore_eos=True).text
    app = create_app(engine, ServerConfig(model_name="tiny", max_batch=max_batch))
    port = free_port()
    host = MainThreadServer(app, host="127.0.0.1", port=port, log_level="warning")
    answers: list[str] = []
    seen_threads: list[threading.Thread | None] = []

    def client() -> None:
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url)
            seen_threads.append(host.worker.loop_thread)
            api = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            for _ in range(2):
                r = api.completions.create(
                    model="tiny",
                    prompt=PROMPT,
                    max_tokens=16,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                answers.append(r.choices[0].text)
        finally:
            host.shutdown()

    t = threading.Thread(target=client)
    t.start()
    host.run()  # returns once the client thread asked for the shutdown
    t.join(30)
    assert seen_threads == [threading.main_thread()]
    assert answers == [expected, expected]
    assert not host.worker.alive


def test_port_in_use_is_a_clear_error(engine: SpeculativeEngine) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        app = create_app(engine, ServerConfig(model_name="tiny"))
        host = MainThreadServer(app, host="127.0.0.1", port=port, log_level="critical")
        with pytest.raises(ServeError, match=f"did not start on 127.0.0.1:{port}.*free --port"):
            host.run()
