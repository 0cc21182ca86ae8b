"""The FastAPI application: validation, admission, streaming and metrics around one worker.

A generation request goes through four stages, each with one owner:

1. **prepare** (event loop): check the model name and the fields, encode the prompt with a
   private copy of the tokenizer and build the engine's :class:`GenerationConfig`; every value
   error becomes a 400 *before* the request takes a queue slot.
2. **admit**: put a :class:`Job` on the bounded FIFO queue, or answer 429 + Retry-After.
3. **run** (worker thread): the engine decodes; messages flow back through the job.
4. **respond** (event loop): one JSON body, or server-sent events ending with ``data: [DONE]``.
   Whatever way the response ends (finished, client gone, timeout, error), :meth:`_Run.close`
   runs exactly once: it withdraws the job from the worker and records the metrics.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from specdec.batch import StepReport
from specdec.config import GenerationConfig, SamplingConfig
from specdec.engine import SpeculativeEngine
from specdec.errors import InvalidRequestError
from specdec.events import TokenEvent
from specdec.grammar import Grammar
from specdec.logprobs import TokenLogprob
from specdec.metrics import RequestStats
from specdec.request import Prompt, check_fits, encode_prompt
from specdec.server import errors
from specdec.server.batch_worker import BatchWorker
from specdec.server.config import ServerConfig
from specdec.server.errors import APIError
from specdec.server.metrics import CONTENT_TYPE, ServerMetrics
from specdec.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    ModelCard,
    ModelList,
    Speculation,
    TopLogprob,
    Usage,
)
from specdec.server.worker import (
    Ended,
    EngineWorker,
    Job,
    Message,
    Outcome,
    Produced,
    QueueFullError,
    ShuttingDownError,
    Started,
)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# How often a request that is waiting (queued, or decoding without streaming) checks whether
# its client has gone away; a streaming response learns it from the server at once.
_DISCONNECT_POLL_S = 0.25
MAX_CHOICES = 16  # the most choices (n) one request may ask for
_CLIENT_CLOSED = 499  # nginx's "client closed request"; nobody reads it, the logs do


class Engine(Protocol):
    """What the server needs of :class:`specdec.SpeculativeEngine`."""

    tokenizer: Any

    @property
    def method(self) -> str: ...

    @property
    def context_length(self) -> int: ...

    def stream_ids(self, prompt_ids: Any, config: GenerationConfig, **options: Any) -> Any: ...


class _ClientGone(Exception):
    """The client disconnected while its request was waiting."""


@dataclass(frozen=True)
class _Prepared:
    """A validated request, ready to queue."""

    endpoint: str
    model: str
    prompt_ids: list[int]
    config: GenerationConfig
    stream: bool
    include_usage: bool
    timeout: float
    id: str
    created: int
    # the engine's grammar / logprobs / top_logprobs keyword arguments, when asked for
    options: dict[str, Any]
    logprobs: bool = False
    n: int = 1  # choices asked for; each is one sequence of the batch, with its own seed
    index: int = 0  # this sequence's choice index


class _Service:
    """State shared by the routes: engine facts, private tokenizer, worker, metrics."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.config = config
        self.method = engine.method
        self.context_length = engine.context_length
        # A private copy: the worker thread detokenizes with the engine's tokenizer, and sharing
        # one tokenizer object across threads is not guaranteed to be safe.
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.vocab_size = len(self.tokenizer)
        self.started = int(time.time())
        self.metrics = ServerMetrics(self.method)
        self.worker: EngineWorker | BatchWorker
        if config.max_batch > 1 and isinstance(engine, SpeculativeEngine) and engine.batchable:
            worker = BatchWorker(
                engine,
                max_batch=config.max_batch,
                max_queue=config.max_queue,
                chunk=config.prefill_chunk,
                slowdown=config.prefill_slowdown,
            )
            worker.on_step = self._observe_step
            self.worker = worker
        else:  # one request at a time (max_batch 1, or a target the batch cannot drive)
            self.worker = EngineWorker(engine.stream_ids, max_queue=config.max_queue)

    def _observe_step(self, report: StepReport) -> None:
        self.metrics.batch_size.observe(report.batch_size)
        self.metrics.draft_length.observe(report.draft_length)

    # -- stage 1: prepare -----------------------------------------------------------------------
    def prepare(self, body: CompletionRequest | ChatCompletionRequest) -> _Prepared:
        chat = isinstance(body, ChatCompletionRequest)
        if body.model != self.config.model_name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server serves "
                f"{self.config.model_name!r} (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        if not 1 <= body.n <= MAX_CHOICES:
            raise APIError(
                400,
                f"n must be between 1 and {MAX_CHOICES}, got n={body.n}",
                param="n",
                code="invalid_value",
            )
        bad = body.unsupported_field()
        if bad is not None:
            raise APIError(
                400, f"{bad!r} is not supported by this server", param=bad, code="unsupported"
            )
        options = self._structured_options(body)
        if isinstance(body, ChatCompletionRequest):
            newer = body.max_completion_tokens is not None
            limit_name = "max_completion_tokens" if newer else "max_tokens"
            requested = body.max_completion_tokens if newer else body.max_tokens
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            prompt_ids = self._encode(messages, chat=True, param="messages")
            default = self.config.default_max_tokens
        else:
            limit_name = "max_tokens"
            requested = body.max_tokens
            prompt_ids = self._completion_prompt(body.prompt)
            default = self.config.default_completion_tokens
        if requested is None:  # as much as asked by default, as much as fits at most
            requested = max(1, min(default, self.context_length - len(prompt_ids)))
        names = {"max_new_tokens": limit_name, "prompt": "messages" if chat else "prompt"}
        try:
            config = GenerationConfig(
                max_new_tokens=requested,
                stop=body.stop_strings(),
                ignore_eos=body.ignore_eos,
                sampling=SamplingConfig(
                    temperature=body.temperature,
                    top_p=body.top_p,
                    top_k=body.top_k,
                    seed=body.seed,
                ),
            )
            check_fits(len(prompt_ids), config.max_new_tokens, self.context_length)
        except InvalidRequestError as e:
            raise errors.from_engine_error(e, names) from None
        stream_options = body.stream_options
        return _Prepared(
            endpoint=CHAT if chat else COMPLETIONS,
            model=self.config.model_name,
            prompt_ids=prompt_ids,
            config=config,
            stream=body.stream,
            include_usage=bool(stream_options and stream_options.include_usage),
            timeout=min(self.config.request_timeout, body.timeout or self.config.request_timeout),
            id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            created=int(time.time()),
            options=options,
            logprobs=bool(options.get("logprobs")),
            n=body.n,
        )

    def _structured_options(
        self, body: CompletionRequest | ChatCompletionRequest
    ) -> dict[str, Any]:
        """The engine's ``grammar`` / ``logprobs`` / ``top_logprobs`` for this request."""
        options: dict[str, Any] = {}
        if isinstance(body, ChatCompletionRequest):
            if body.top_logprobs and not body.logprobs:
                raise APIError(
                    400,
                    "top_logprobs needs logprobs: true",
                    param="top_logprobs",
                    code="invalid_value",
                )
            if body.logprobs:
                options.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
        elif body.logprobs is not None:
            options.update(logprobs=True, top_logprobs=body.logprobs)
        grammar = _grammar(body)
        if grammar is not None:
            if importlib.util.find_spec("llguidance") is None:
                raise APIError(
                    400,
                    "structured output needs the grammar engine, which this server lacks; "
                    "install it with: pip install 'specdec[structured]'",
                    param="grammar" if body.grammar is not None else "response_format",
                    code="unsupported",
                )
            options["grammar"] = grammar
        return options

    def _completion_prompt(self, prompt: str | list[str] | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self._encode(prompt, chat=False, param="prompt")
        if prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise APIError(
                    400,
                    "batched prompts are not supported; send one prompt per request",
                    param="prompt",
                    code="invalid_value",
                )
            return self._encode(str(prompt[0]), chat=False, param="prompt")
        ids = [int(t) for t in prompt]
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise APIError(
                400,
                f"token ids must lie in [0, {self.vocab_size})",
                param="prompt",
                code="invalid_value",
            )
        return ids

    def _encode(self, prompt: Prompt, *, chat: bool, param: str) -> list[int]:
        try:
            return encode_prompt(self.tokenizer, prompt, chat)
        except InvalidRequestError as e:
            raise errors.from_engine_error(e, {"prompt": param}) from None
        except jinja2.TemplateError as e:  # e.g. a template that insists roles alternate
            raise APIError(
                400,
                f"the model's chat template rejected the messages: {e}",
                param="messages",
                code="invalid_value",
            ) from None

    # -- stage 2: admit -------------------------------------------------------------------------
    def admit(self, prepared: _Prepared) -> _Run:
        job = Job(
            prepared.prompt_ids,
            prepared.config,
            timeout=prepared.timeout,
            loop=asyncio.get_running_loop(),
            options=prepared.options,
        )
        try:
            self.worker.submit(job)
        except QueueFullError:
            self.metrics.request(prepared.endpoint, "rejected")
            raise errors.queue_full(self.worker.retry_after()) from None
        except ShuttingDownError:
            self.metrics.request(prepared.endpoint, "rejected")
            raise errors.shutting_down() from None
        self.metrics.queue_depth.set(len(self.worker.queue))
        return _Run(self, prepared, job)

    def admit_all(self, prepared: _Prepared) -> list[_Run]:
        """Admit the request's ``n`` sequences together, or none of them."""
        runs: list[_Run] = []
        try:
            for p in _choices(prepared):
                runs.append(self.admit(p))
        except APIError:
            for run in runs:
                run.close("rejected")
            raise
        return runs

    # -- stage 4: respond -----------------------------------------------------------------------
    async def respond(self, prepared: _Prepared, request: Request, render: _Renderer) -> Response:
        if prepared.n > 1:
            return await self.respond_many(prepared, request, render)
        run = self.admit(prepared)
        try:
            await _closing_on_failure(run, run.wait_started(request))
            if prepared.stream:
                return _StreamResponse(run.sse(render), on_close=lambda: run.close("cancelled"))
            text, final = await _closing_on_failure(run, run.collect(request))
        except _ClientGone:
            return Response(status_code=_CLIENT_CLOSED)
        run.close("ok")
        return JSONResponse(render.whole(prepared, text, final, self.method))

    async def respond_many(
        self, prepared: _Prepared, request: Request, render: _Renderer
    ) -> Response:
        """``n > 1``: the sequences decode as members of the batch; one body (or one stream)
        carries every choice with its index. Usage counts the prompt once and every choice's
        tokens; the ``speculation`` field is choice 0's."""
        runs = self.admit_all(prepared)

        def close_all(outcome: str) -> None:
            for run in runs:
                run.close(outcome)

        try:
            for run in runs:
                await _closing_on_failure(run, run.wait_started(request))
            if prepared.stream:
                return _StreamResponse(
                    _merged_sse(runs, render), on_close=lambda: close_all("cancelled")
                )
            results = await asyncio.gather(*(run.collect(request) for run in runs))
        except _ClientGone:
            close_all("cancelled")
            return Response(status_code=_CLIENT_CLOSED)
        except BaseException:
            close_all("error")
            raise
        close_all("ok")
        bodies = [
            render.whole(run.prepared, text, final, self.method)
            for run, (text, final) in zip(runs, results, strict=True)
        ]
        body = bodies[0]
        body["choices"] = [c for b in bodies for c in b["choices"]]
        body["usage"] = Usage.of(_summed_stats([final.stats for _, final in results])).model_dump()
        return JSONResponse(body)


def _choices(prepared: _Prepared) -> list[_Prepared]:
    """One prepared sequence per choice: index i, seed + i when seeded (independent draws)."""
    if prepared.n == 1:
        return [prepared]
    out = []
    sampling = prepared.config.sampling
    for i in range(prepared.n):
        seed = None if sampling.seed is None else (sampling.seed + i) % 2**64
        config = replace(prepared.config, sampling=replace(sampling, seed=seed))
        out.append(replace(prepared, index=i, config=config))
    return out


def _summed_stats(stats: list[RequestStats]) -> RequestStats:
    """Choice 0's stats with every choice's tokens: what the usage of ``n`` choices counts
    (the prompt once, all completions)."""
    return replace(stats[0], new_tokens=sum(s.new_tokens for s in stats))


async def _merged_sse(runs: list[_Run], render: _Renderer) -> AsyncIterator[bytes]:
    """The streams of ``n`` choices interleaved as their chunks come, then one usage chunk (if
    asked for) and one ``data: [DONE]``."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def pump(run: _Run) -> None:
        try:
            async for frame in run.sse(render, final_frames=False):
                await queue.put(frame)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(run)) for run in runs]
    try:
        left = len(runs)
        while left:
            frame = await queue.get()
            if frame is None:
                left -= 1
                continue
            yield frame
        p = runs[0].prepared
        stats = [run.final_stats for run in runs]
        done = [x for x in stats if x is not None]
        if p.include_usage and len(done) == len(runs):
            yield _sse(render.usage(p, _Final("stop", _summed_stats(done))))
        yield format_sse_event(data_str="[DONE]")
    finally:
        for task in tasks:
            task.cancel()


class _Renderer(Protocol):
    """Builds one endpoint's response body and stream chunks."""

    def whole(self, p: _Prepared, text: str, final: _Final, method: str) -> dict[str, Any]: ...

    def opening(self, p: _Prepared) -> BaseModel | None: ...

    def chunk(
        self, p: _Prepared, text: str, logprobs: tuple[TokenLogprob, ...] | None
    ) -> BaseModel: ...

    def closing(self, p: _Prepared, final: _Final, method: str) -> BaseModel: ...

    def usage(self, p: _Prepared, final: _Final) -> BaseModel: ...


@dataclass(frozen=True)
class _Final:
    finish_reason: str
    stats: RequestStats
    logprobs: tuple[TokenLogprob, ...] = ()  # every token's, for a whole (non-streamed) body


class _Run:
    """One admitted request on the asyncio side: reads its job's messages, keeps the timings,
    and on :meth:`close` withdraws the job and records the request's metrics, exactly once."""

    def __init__(self, service: _Service, prepared: _Prepared, job: Job) -> None:
        self.service = service
        self.prepared = prepared
        self.job = job
        self._getter: asyncio.Future[Message] | None = None
        self._next_check = time.monotonic() + _DISCONNECT_POLL_S
        self._ended = False
        self._closed = False
        self._first_at: float | None = None
        self._last_at: float | None = None
        self._stats: RequestStats | None = None

    async def _next(self, request: Request | None) -> Message:
        """The job's next message; with ``request``, give up if the client disconnects."""
        while True:
            timeout = None
            if request is not None:  # on a clock, not on idleness: messages may never pause
                now = time.monotonic()
                if now >= self._next_check:
                    self._next_check = now + _DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        raise _ClientGone
                timeout = max(0.0, self._next_check - now)
            if self._getter is None:
                self._getter = asyncio.ensure_future(self.job.messages.get())
            done, _ = await asyncio.wait({self._getter}, timeout=timeout)
            if done:
                message = self._getter.result()
                self._getter = None
                if isinstance(message, Ended):
                    self._ended = True
                return message

    def _observe(self, produced: Produced) -> TokenEvent:
        metrics = self.service.metrics
        self._stats = produced.stats
        if produced.event.token_ids:
            metrics.decoded_tokens.inc(len(produced.event.token_ids))
            if self._first_at is None:
                self._first_at = produced.at
                metrics.ttft.observe(produced.at - self.job.submitted)
            else:
                assert self._last_at is not None
                metrics.itl.observe(produced.at - self._last_at)
            self._last_at = produced.at
        return produced.event

    def _failure(self, ended: Ended) -> APIError:
        if ended.outcome is Outcome.TIMEOUT:
            if self._first_at is None and self._stats is None:
                return errors.queue_timeout(self.service.worker.retry_after())
            return errors.decode_timeout()
        if ended.outcome is Outcome.CANCELLED:
            return errors.shutting_down()
        if isinstance(ended.error, InvalidRequestError):
            return errors.from_engine_error(ended.error, {"max_new_tokens": "max_tokens"})
        return errors.internal()

    async def wait_started(self, request: Request) -> None:
        """Wait (queued) until the worker starts the job; raise its error if it never does."""
        message = await self._next(request)
        if isinstance(message, Started):
            self.service.metrics.queue_wait.observe(message.at - self.job.submitted)
            return
        assert isinstance(message, Ended), message
        raise self._failure(message)

    async def collect(self, request: Request) -> tuple[str, _Final]:
        parts: list[str] = []
        logprobs: list[TokenLogprob] = []
        final: _Final | None = None
        while True:
            message = await self._next(request)
            if isinstance(message, Produced):
                event = self._observe(message)
                parts.append(event.text)
                logprobs.extend(event.logprobs or ())
                if event.finish_reason is not None:
                    final = _Final(event.finish_reason, message.stats, tuple(logprobs))
            elif isinstance(message, Ended):
                if message.outcome is Outcome.DONE and final is not None:
                    return "".join(parts), final
                raise self._failure(message)

    @property
    def final_stats(self) -> RequestStats | None:
        """The stats of the last step, once the request finished."""
        return self._stats if self._ended else None

    async def sse(self, render: _Renderer, *, final_frames: bool = True) -> AsyncIterator[bytes]:
        """Server-sent events: chunks as the engine commits tokens, then ``data: [DONE]``.

        An error after the stream has begun cannot change the status code any more, so it is
        sent as an ``{"error": ...}`` event (which the openai client raises as ``APIError``).
        """
        p = self.prepared
        opening = render.opening(p)
        if opening is not None:
            yield _sse(opening)
        final: _Final | None = None
        while True:
            message = await self._next(None)
            if isinstance(message, Produced):
                event = self._observe(message)
                if event.text or (p.logprobs and event.logprobs):
                    yield _sse(render.chunk(p, event.text, event.logprobs))
                if event.finish_reason is not None:
                    final = _Final(event.finish_reason, message.stats)
                    yield _sse(render.closing(p, final, self.service.method))
            elif isinstance(message, Ended):
                if message.outcome is Outcome.DONE and final is not None:
                    if p.include_usage and final_frames:
                        yield _sse(render.usage(p, final))
                    self.close("ok")
                else:
                    failure = self._failure(message)
                    self.close(_outcome_label(failure))
                    yield format_sse_event(data_str=json.dumps(failure.body()))
                if final_frames:
                    yield format_sse_event(data_str="[DONE]")
                return

    def close(self, outcome: str) -> None:
        """Withdraw the job (if still queued or decoding) and record metrics; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._getter is not None:
            self._getter.cancel()
        if not self._ended:
            self.service.worker.withdraw(self.job)
        m = self.service.metrics
        m.request(self.prepared.endpoint, outcome)
        m.queue_depth.set(len(self.service.worker.queue))
        stats = self._stats
        if stats is None:
            return
        m.prompt_tokens.inc(stats.prompt_tokens)
        m.completion_tokens.inc(stats.new_tokens)
        m.speculation(stats)
        if self._first_at is not None and self._last_at is not None and stats.new_tokens > 1:
            m.tpot.observe((self._last_at - self._first_at) / (stats.new_tokens - 1))


T = TypeVar("T")


async def _closing_on_failure(run: _Run, awaitable: Awaitable[T]) -> T:
    """Await a stage of ``run``; if it fails, close the run with the matching outcome label
    (the metrics count cancellations, API errors and crashes apart) and re-raise."""
    try:
        return await awaitable
    except _ClientGone:
        run.close("cancelled")
        raise
    except APIError as e:
        run.close(_outcome_label(e))
        raise
    except BaseException:
        run.close("error")
        raise


def _outcome_label(error: APIError) -> str:
    if error.code == "request_timeout":
        return "timeout"
    if error.status < 500:
        return "invalid"
    return "error"


def _sse(model: BaseModel) -> bytes:
    return format_sse_event(data_str=model.model_dump_json())


class _StreamResponse(EventSourceResponse):
    """An SSE response that runs ``on_close`` however it ends (also when the server cancels it
    because the client disconnected), so an abandoned request is withdrawn from the worker."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()  # a no-op when the stream already closed its run


# -- structured output and logprobs --------------------------------------------------------------
def _grammar(body: CompletionRequest | ChatCompletionRequest) -> Grammar | None:
    """The request's constraint from ``response_format`` or the ``grammar`` extra (not both)."""
    fmt, extra = body.response_format, body.grammar
    wanted = fmt is not None and fmt.type != "text"
    if wanted and extra is not None:
        raise APIError(
            400,
            "give either response_format or grammar, not both",
            param="grammar",
            code="invalid_value",
        )
    try:
        if fmt is not None and fmt.type == "json_object":
            return Grammar.json_object()
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise APIError(
                    400,
                    "response_format json_schema needs a json_schema object with a schema",
                    param="response_format.json_schema",
                    code="missing_required_parameter",
                )
            return Grammar.json_schema(_schema_dict(fmt.json_schema.schema_))
        if extra is None:
            return None
        if extra.type == "json_schema":
            value = extra.value
            return Grammar.json_schema(value if isinstance(value, (str, dict)) else {})
        if not isinstance(extra.value, str):
            raise APIError(
                400, f"a {extra.type} grammar is text", param="grammar.value", code="invalid_type"
            )
        return Grammar.regex(extra.value) if extra.type == "regex" else Grammar.ebnf(extra.value)
    except InvalidRequestError as e:
        param = "grammar" if extra is not None else "response_format"
        raise errors.from_engine_error(e, {"grammar": param}) from None


def _schema_dict(schema: dict[str, Any] | bool) -> dict[str, Any]:
    return schema if isinstance(schema, dict) else ({} if schema else {"not": {}})


# OpenAI's floor for a log-probability it will not print as -inf (JSON has no infinities)
_LOGPROB_FLOOR = -9999.0

# GPT-2's reversible map from bytes to printable characters (byte-level BPE token strings)
_BYTE_OF_CHAR: dict[str, int] = {}
_n = 0
for _b in range(256):
    if 33 <= _b <= 126 or 161 <= _b <= 172 or 174 <= _b <= 255:
        _BYTE_OF_CHAR[chr(_b)] = _b
    else:
        _BYTE_OF_CHAR[chr(256 + _n)] = _b
        _n += 1


class _TokenStrings:
    """Token id -> (text, UTF-8 bytes) for logprobs, cached; byte-level BPE pieces are mapped
    back to their bytes, other tokenizers' pieces decoded."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        piece = self._tok.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece and all(ch in _BYTE_OF_CHAR for ch in piece):
            raw = bytes(_BYTE_OF_CHAR[ch] for ch in piece)
        else:
            raw = self._tok.decode([token_id]).encode("utf-8")
        out = (raw.decode("utf-8", errors="replace"), list(raw))
        self._cache[token_id] = out
        return out


def _lp(x: float) -> float:
    return x if math.isfinite(x) else _LOGPROB_FLOOR


def _chat_logprobs(
    strings: _TokenStrings, items: tuple[TokenLogprob, ...] | None
) -> ChatLogprobs | None:
    if items is None:
        return None
    content = []
    for item in items:
        text, raw = strings(item.token_id)
        top = []
        for tid, value in item.top:
            t_text, t_raw = strings(tid)
            top.append(TopLogprob(token=t_text, logprob=_lp(value), bytes=t_raw))
        content.append(
            ChatTokenLogprob(token=text, logprob=_lp(item.logprob), bytes=raw, top_logprobs=top)
        )
    return ChatLogprobs(content=content)


def _completion_logprobs(
    strings: _TokenStrings, items: tuple[TokenLogprob, ...] | None, offset: int = 0
) -> CompletionLogprobs | None:
    if items is None:
        return None
    out = CompletionLogprobs(top_logprobs=[])
    for item in items:
        text, _ = strings(item.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(_lp(item.logprob))
        assert out.top_logprobs is not None
        out.top_logprobs.append({strings(t)[0]: _lp(v) for t, v in item.top})
        out.text_offset.append(offset)
        offset += len(text)
    return out


# -- renderers ------------------------------------------------------------------------------------
def _speculation(method: str, final: _Final) -> Speculation:
    return Speculation.of(method, final.stats)


class _CompletionRenderer:
    def __init__(self, strings: _TokenStrings) -> None:
        self.strings = strings
        self._offsets: dict[str, int] = {}  # streamed choices: text offset so far, by id/index

    def whole(self, p: _Prepared, text: str, final: _Final, method: str) -> dict[str, Any]:
        logprobs = _completion_logprobs(self.strings, final.logprobs) if p.logprobs else None
        return CompletionResponse(
            id=p.id,
            created=p.created,
            model=p.model,
            choices=[
                CompletionChoice(
                    index=p.index, text=text, finish_reason=final.finish_reason, logprobs=logprobs
                )
            ],
            usage=Usage.of(final.stats),
            speculation=_speculation(method, final),
        ).model_dump(mode="json")

    def opening(self, p: _Prepared) -> BaseModel | None:
        return None

    def chunk(
        self, p: _Prepared, text: str, logprobs: tuple[TokenLogprob, ...] | None
    ) -> BaseModel:
        rendered = None
        if p.logprobs:
            offset = self._offsets.get(f"{p.id}/{p.index}", 0)
            rendered = _completion_logprobs(self.strings, logprobs, offset)
            self._offsets[f"{p.id}/{p.index}"] = offset + sum(
                len(t) for t in (rendered.tokens if rendered else [])
            )
        return CompletionResponse(
            id=p.id,
            created=p.created,
            model=p.model,
            choices=[
                CompletionChoice(index=p.index, text=text, finish_reason=None, logprobs=rendered)
            ],
        )

    def closing(self, p: _Prepared, final: _Final, method: str) -> BaseModel:
        self._offsets.pop(f"{p.id}/{p.index}", None)
        return CompletionResponse(
            id=p.id,
            created=p.created,
            model=p.model,
            choices=[CompletionChoice(index=p.index, text="", finish_reason=final.finish_reason)],
            speculation=_speculation(method, final),
        )

    def usage(self, p: _Prepared, final: _Final) -> BaseModel:
        return CompletionResponse(
            id=p.id,
            created=p.created,
            model=p.model,
            choices=[],
            usage=Usage.of(final.stats),
        )


class _ChatRenderer:
    def __init__(self, strings: _TokenStrings) -> None:
        self.strings = strings

    def whole(self, p: _Prepared, text: str, final: _Final, method: str) -> dict[str, Any]:
        logprobs = _chat_logprobs(self.strings, final.logprobs) if p.logprobs else None
        return ChatCompletionResponse(
            id=p.id,
            created=p.created,
            model=p.model,
            choices=[
                ChatChoice(
                    index=p.index,
                    message=AssistantMessage(content=text),
                    finish_reason=final.finish_reason,
                    logprobs=logprobs,
                )
            ],
            usage=Usage.of(final.stats),
            speculation=_speculation(method, final),
        ).model_dump(mode="json")

    def opening(self, p: _Prepared) -> BaseModel | None:
        return self._chunk(p, Delta(role="assistant", content=""))

    def chunk(
        self, p: _Prepared, text: str, logprobs: tuple[TokenLogprob, ...] | None
    ) -> BaseModel:
        rendered = _chat_logprobs(self.strings, logprobs) if p.logprobs else None
        return self._chunk(p, Delta(content=text), rendered)

    def closing(self, p: _Prepared, final: _Final, method: str) -> BaseModel:
        return ChatCompletionChunk(
            id=p.id,
            created=p.created,
            model=p.model,
            choices=[
                ChatChunkChoice(index=p.index, delta=Delta(), finish_reason=final.finish_reason)
            ],
            speculation=_speculation(method, final),
        )

    def usage(self, p: _Prepared, final: _Final) -> BaseModel:
        return ChatCompletionChunk(
            id=p.id,
            created=p.created,
            model=p.model,
            choices=[],
            usage=Usage.of(final.stats),
        )

    def _chunk(
        self, p: _Prepared, delta: Delta, logprobs: ChatLogprobs | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=p.id,
            created=p.created,
            model=p.model,
            choices=[ChatChunkChoice(index=p.index, delta=delta, logprobs=logprobs)],
        )


# -- the application ------------------------------------------------------------------------------
def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """Build the OpenAI-compatible app around ``engine``; the worker thread runs while the app's
    lifespan does (uvicorn starts and stops it)."""
    service = _Service(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(service.worker.stop)

    app = FastAPI(
        title="specdec",
        summary="OpenAI-compatible speculative decoding server",
        lifespan=lifespan,
        max_body_size=config.max_body_bytes,
        strict_content_type=False,
    )
    app.state.service = service
    _install_error_handlers(app, service)

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = service.worker.alive
        body = {
            "status": "ok" if alive else "unavailable",
            "model": config.model_name,
            "method": service.method,
            "speculator": config.speculator or service.method,
            "context_length": service.context_length,
            "queue_depth": len(service.worker.queue),
            "queue_capacity": config.max_queue,
            "busy": service.worker.busy,
            "max_batch": service.worker.max_batch if isinstance(service.worker, BatchWorker) else 1,
            "requests_done": service.worker.jobs_done,
        }
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        service.metrics.queue_depth.set(len(service.worker.queue))
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)

    def card() -> ModelCard:
        return ModelCard(
            id=config.model_name,
            created=service.started,
            context_length=service.context_length,
            speculation_method=service.method,
            speculator=config.speculator or service.method,
        )

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        if model_id != config.model_name:
            raise APIError(
                404,
                f"the model {model_id!r} does not exist",
                param="model",
                code="model_not_found",
            )
        return card()

    strings = _TokenStrings(service.tokenizer)
    completion_renderer, chat_renderer = _CompletionRenderer(strings), _ChatRenderer(strings)

    async def generate(
        body: CompletionRequest | ChatCompletionRequest, request: Request, render: _Renderer
    ) -> Response:
        endpoint = CHAT if isinstance(body, ChatCompletionRequest) else COMPLETIONS
        try:
            prepared = service.prepare(body)
        except APIError:
            service.metrics.request(endpoint, "invalid")
            raise
        return await service.respond(prepared, request, render)

    @app.post(COMPLETIONS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await generate(body, request, completion_renderer)

    @app.post(CHAT)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await generate(body, request, chat_renderer)

    return app


def _install_error_handlers(app: FastAPI, service: _Service) -> None:
    """Every error leaves as OpenAI-style JSON with a 4xx/5xx status; none stops the server."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = list(exc.errors())
        first = problems[0] if problems else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        kind = str(first.get("type", ""))
        if kind == "json_invalid":
            message, code, param = "the request body is not valid JSON", "invalid_json", None
        elif kind == "missing":
            param = ".".join(loc) or None
            message, code = f"missing required parameter {param!r}", "missing_required_parameter"
        elif not loc:
            message = "the request body must be a JSON object (Content-Type: application/json)"
            code, param = "invalid_json", None
        else:
            param = ".".join(loc)
            message = f"invalid value for {param!r}: {first.get('msg', 'invalid')}"
            code = "invalid_type"
        if request.url.path in (COMPLETIONS, CHAT):
            service.metrics.request(request.url.path, "invalid")
        err = APIError(400, message, param=param, code=code)
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(exc.status_code, str(exc.detail), type=kind)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(errors.internal().body(), status_code=500)
