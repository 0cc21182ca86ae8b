"""Real ``specdec serve`` processes on 127.0.0.1, and helpers to talk to them.

Servers run as subprocesses exactly as a user starts them (``python -m specdec.cli.main serve``)
on a free loopback port; fixtures wait for ``/health`` and always terminate them. The tiny-model
servers and the CLI reference runs are launched together, so their start-up (imports, model
load) overlaps. Engines run with one torch thread so that timings stay sane on a shared machine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

TINY_NAME = "tiny"
SMOL_NAME = "smol"
# Same numerics in every process (server and CLI reference): one intra-op thread.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def server_env() -> dict[str, str]:
    """The environment as it is now, when the process starts (not at import): it carries the
    isolated XDG_CACHE_HOME of the running test, or of the session for session fixtures."""
    return {**os.environ, **THREAD_ENV}


STARTUP_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A ``specdec serve`` subprocess and clients for it."""

    def __init__(self, args: list[str], log: Path) -> None:
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "specdec.cli.main",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--threads",
            "1",
            "--log-level",
            "warning",
            *args,
        ]
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._clients: list[OpenAI] = []
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=server_env()
            )

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> Server:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server did not come up in {timeout} s:\n{self.log_text()}")
            time.sleep(0.2)

    def stop(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # graceful: uvicorn runs the lifespan exit
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def client(self, **kwargs: Any) -> OpenAI:
        """The official client; no automatic retries, so a 429 is seen as a 429. It is closed
        with the server, so no test leaks its connections."""
        options: dict[str, Any] = {"max_retries": 0, "timeout": 120.0, **kwargs}
        client = OpenAI(base_url=self.v1, api_key="not-needed", **options)
        self._clients.append(client)
        return client

    def http(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120.0, **kwargs)

    def health(self) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/health", timeout=10)
        r.raise_for_status()
        return r.json()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@contextmanager
def run_server(args: list[str], log: Path) -> Iterator[Server]:
    """Start ``specdec serve`` with ``args``; yield once it answers /health; always stop it."""
    server = Server(args, log)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


class CliRun:
    """``specdec generate --json`` as a user runs it (the reference for greedy output), started
    in the background so that its model load overlaps the servers'."""

    def __init__(self, model_dir: Path, prompt: str, *args: str) -> None:
        cmd = [
            sys.executable,
            "-m",
            "specdec.cli.main",
            "generate",
            prompt,
            "--model",
            str(model_dir),
            "--json",
            "--temperature",
            "0",
            *args,
        ]
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=server_env()
        )
        self._result: dict[str, Any] | None = None

    def result(self) -> dict[str, Any]:
        if self._result is None:
            out, err = self._proc.communicate(timeout=300)
            assert self._proc.returncode == 0, err
            self._result = json.loads(out.strip().splitlines()[-1])
        return self._result

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.communicate()  # reap it and close its pipes


# Greedy references from the CLI for test_api.py: (prompt, generate flags). The chat template
# path is compared with the CLI on the real model in test_smol.py.
COMPLETION_PROMPT = "ROMEO: But soft, what light through yonder window breaks? It is the east, and"
CHAT_QUESTION = "Tell me about the winter of our discontent."
CLI_CASES = {
    "completion": (COMPLETION_PROMPT, ("--no-chat", "-n", "40", "--speculator", "prompt-lookup")),
}


@dataclass
class _Fleet:
    tiny: Server
    strict: Server
    cli: dict[str, CliRun]


@pytest.fixture(scope="session")
def _tiny_fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Fleet]:
    logs = tmp_path_factory.mktemp("servers")
    model = ["--model", str(tiny_model_dir), "--served-model-name", TINY_NAME]
    started: list[Server] = []
    cli: dict[str, CliRun] = {}
    try:
        # The main server of the suite: prompt-lookup speculation, room for 64 waiting requests,
        # prompts entering the batch at most 8 tokens a step (most of them over several steps),
        # a step carrying them at most 1.5 full-batch steps.
        started.append(
            Server(
                [*model, "--speculator", "prompt-lookup", "--max-queue", "64"]
                + ["--prefill-chunk", "8", "--prefill-slowdown", "1.5"],
                logs / "tiny.log",
            )
        )
        # No waiting room at all and one slot: one request decodes, others are refused while
        # it runs (the batching server of test_batching has its own limits).
        started.append(
            Server(
                [
                    *model,
                    *("--speculator", "none", "--max-queue", "0", "--max-batch", "1"),
                    *("--request-timeout", "60"),
                ],
                logs / "strict.log",
            )
        )
        cli = {name: CliRun(tiny_model_dir, p, *f) for name, (p, f) in CLI_CASES.items()}
        yield _Fleet(started[0], started[1], cli)
    finally:
        for server in started:
            server.stop()
        for run in cli.values():
            run.kill()


@pytest.fixture(scope="session")
def tiny_server(_tiny_fleet: _Fleet) -> Server:
    return _tiny_fleet.tiny.wait_ready()


@pytest.fixture(scope="session")
def strict_server(_tiny_fleet: _Fleet) -> Server:
    return _tiny_fleet.strict.wait_ready()


@pytest.fixture(scope="session")
def cli_references(_tiny_fleet: _Fleet) -> dict[str, CliRun]:
    return _tiny_fleet.cli
