"""``specdec serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from specdec.cli.common import (
    AdaptiveOpt,
    ChatTemplateOpt,
    DeviceOpt,
    DtypeOpt,
    GgufOpt,
    KOpt,
    ModelOpt,
    SpeculatorOpt,
    ThreadsOpt,
    TypicalOpt,
    err_console,
    load_engine,
    user_errors,
)


def _served_name(model: Path | None, gguf: Path | None) -> str:
    """What clients pass as ``model``: the directory or file name the server was started with."""
    if model is not None:
        return model.resolve().name
    if gguf is not None:
        return gguf.stem
    from specdec.target.loading import default_gguf_path

    return default_gguf_path().stem


def serve(
    model: ModelOpt = None,
    gguf: GgufOpt = None,
    speculator: SpeculatorOpt = "prompt-lookup",
    num_draft_tokens: KOpt = None,
    adaptive: AdaptiveOpt = True,
    typical: TypicalOpt = False,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    chat_template: ChatTemplateOpt = None,
    threads: ThreadsOpt = None,
    host: Annotated[
        str, typer.Option(help="Interface to listen on (loopback by default).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    served_model_name: Annotated[
        str | None,
        typer.Option(help="Model id clients send (default: the model's directory/file name)."),
    ] = None,
    max_batch: Annotated[
        int,
        typer.Option(
            help="Requests decoded together (continuous batching, one target pass per step); "
            "1 decodes one at a time."
        ),
    ] = 8,
    max_queue: Annotated[
        int, typer.Option(help="Requests allowed to wait; beyond it the server answers 429.")
    ] = 64,
    prefill_chunk: Annotated[
        int,
        typer.Option(
            help="Most prompt tokens one step carries while others decode (chunked prefill): "
            "smaller keeps their inter-token latency down, larger admits newcomers sooner."
        ),
    ] = 64,
    prefill_slowdown: Annotated[
        float,
        typer.Option(
            help="Most a step carrying prompt tokens or drafts may cost, as a multiple of a "
            "full batch's plain step (measured as it serves; at least 16 prompt tokens a step): "
            "higher admits newcomers sooner, at the others' worst inter-token gap."
        ),
    ] = 2.0,
    request_timeout: Annotated[
        float, typer.Option(help="Seconds a request may spend queued plus decoding.")
    ] = 300.0,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics)."""
    from specdec.server import ServerConfig, create_app
    from specdec.server.host import MainThreadServer

    with user_errors():
        config = ServerConfig(
            model_name=served_model_name or _served_name(model, gguf),
            speculator=speculator,
            max_queue=max_queue,
            max_batch=max_batch,
            request_timeout=request_timeout,
            prefill_chunk=prefill_chunk,
            prefill_slowdown=prefill_slowdown,
        )
        engine = load_engine(
            model,
            gguf,
            speculator,
            num_draft_tokens,
            dtype,
            adaptive,
            typical,
            threads,
            device=device,
            chat_template=chat_template,
        )
        app = create_app(engine, config)
    err_console.print(
        f"serving {config.model_name!r} (speculator {escape(speculator)}) on "
        f"http://{host}:{port}/v1",
        highlight=False,
    )
    # One process, one engine: requests are batched on the main thread, HTTP runs beside it.
    with user_errors():
        MainThreadServer(app, host=host, port=port, log_level=log_level).run()
