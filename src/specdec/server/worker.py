"""The one thread that owns the engine, and the bounded FIFO queue in front of it.

The engine keeps per-request state (KV cache, speculator history) and is not thread-safe, so
exactly one thread ever touches it; requests are decoded one at a time in arrival order. The
asyncio side talks to the worker only through :class:`Job` objects: it submits a job, reads the
job's event channel, and may cancel it. The worker checks for cancellation and the deadline
between engine steps and closes the engine's generator, so an abandoned request costs at most
one more step.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from specdec.config import GenerationConfig
from specdec.errors import SpecDecError
from specdec.events import TokenEvent
from specdec.metrics import RequestStats

log = logging.getLogger(__name__)

# the engine's stream_ids; a job's ``options`` (grammar, logprobs) go as keyword arguments
StreamFn = Callable[..., Iterator[TokenEvent]]


class QueueFullError(SpecDecError):
    """The bounded queue holds ``capacity`` waiting requests already."""


class ShuttingDownError(SpecDecError):
    """The worker is stopping and accepts no more requests."""


class Outcome(str, enum.Enum):
    """How a job ended, as the worker saw it."""

    DONE = "done"  # the engine reported a finish reason
    CANCELLED = "cancelled"  # the client went away
    TIMEOUT = "timeout"  # the deadline passed (in the queue or while decoding)
    FAILED = "failed"  # the engine raised


@dataclass(frozen=True)
class Started:
    """The worker took the job off the queue and the engine accepted it."""

    at: float  # time.perf_counter()


@dataclass(frozen=True)
class Produced:
    """One engine step's output, stamped when the worker produced it.

    ``stats`` is the snapshot the engine took after this step.
    """

    event: TokenEvent
    stats: RequestStats
    at: float


@dataclass(frozen=True)
class Ended:
    """Always the last message of a job."""

    outcome: Outcome
    error: BaseException | None = None


Message = Started | Produced | Ended


class Job:
    """One request's trip through the worker: input, cancel flag, deadline, event channel.

    Messages are handed to the submitting event loop with ``call_soon_threadsafe``, so the
    asyncio side reads them from an ordinary ``asyncio.Queue`` without blocking the loop.
    """

    def __init__(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig,
        *,
        timeout: float,
        loop: asyncio.AbstractEventLoop,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.prompt_ids = list(prompt_ids)
        self.config = config
        # keyword arguments of the engine's stream_ids beyond the config: grammar, logprobs
        self.options = dict(options or {})
        self.submitted = time.perf_counter()
        self.deadline = time.monotonic() + timeout
        self.messages: asyncio.Queue[Message] = asyncio.Queue()
        self._loop = loop
        self._cancelled = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def cancel(self) -> None:
        self._cancelled.set()

    def post(self, message: Message) -> None:
        """Hand a message to the event loop (called from the worker thread)."""
        try:
            self._loop.call_soon_threadsafe(self.messages.put_nowait, message)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class JobQueue:
    """FIFO of waiting jobs with a hard bound; cancelled jobs leave at once, not when reached.

    ``capacity`` counts jobs that must *wait*: a job offered while the consumer has no job in
    service (between :meth:`task_done` and the next :meth:`get`) does not use a slot, so
    ``capacity=0`` means "decode one request, refuse the others while it runs".
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._in_service = 0  # 0 or 1: there is one consumer

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, job: Job) -> int:
        """Append ``job``; return how many jobs wait ahead of it."""
        with self._cond:
            if self._closed:
                raise ShuttingDownError("the server is shutting down")
            if len(self._items) >= self._room():
                raise QueueFullError(f"{len(self._items)} requests are already waiting")
            self._items.append(job)
            self._cond.notify()
            return len(self._items) - 1

    def _room(self) -> int:
        """How many jobs may be in the queue now (called with the lock held)."""
        return self.capacity + (1 - self._in_service)

    def get(self) -> Job | None:
        """Block for the oldest job; ``None`` once the queue is closed."""
        with self._cond:
            while not self._items and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            self._in_service = 1
            return self._items.popleft()

    def task_done(self) -> None:
        """The job from :meth:`get` is finished: the consumer is free for the next one."""
        with self._cond:
            self._in_service = 0

    def remove(self, job: Job) -> bool:
        with self._cond:
            try:
                self._items.remove(job)
            except ValueError:
                return False
            return True

    def close(self) -> list[Job]:
        """Refuse new jobs, wake the worker, and return the jobs that were still waiting."""
        with self._cond:
            self._closed = True
            left = list(self._items)
            self._items.clear()
            self._cond.notify_all()
            return left


class Worker:
    """What every engine thread shares: the bounded queue in front of it, the thread, and the
    asyncio side's calls (submit, withdraw). Subclasses run ``_loop`` on the thread.

    By default :meth:`start` gives the loop a thread of its own. ``specdec serve`` instead keeps
    the loop on the process's main thread (:meth:`keep_on_caller`, then :meth:`run_here`) and
    moves the HTTP server to a thread: libgomp gives every thread that opens a parallel region
    its own pool of workers, and once a process holds more pool workers than cores (the model
    load already made one pool on the main thread) it stops letting them spin between regions,
    so each of the hundreds of parallel regions in a decode step pays a wake-up from sleep.
    """

    thread_name = "specdec-engine"

    def __init__(self, queue: JobQueue) -> None:
        self.queue = queue
        self._thread: threading.Thread | None = None
        self._on_caller = False
        self._done = threading.Event()
        self._mean_job_seconds = 1.0  # running estimate, for Retry-After
        self.jobs_done = 0

    def _loop(self) -> None:
        raise NotImplementedError

    def _run_loop(self) -> None:
        try:
            self._loop()
        finally:
            self._done.set()

    # -- lifecycle ------------------------------------------------------------------------------
    def keep_on_caller(self) -> None:
        """The calling thread will run the loop (:meth:`run_here`); :meth:`start` spawns none."""
        self._on_caller = True
        self._thread = threading.current_thread()

    def run_here(self) -> None:
        """Run the loop on the calling thread until the worker is stopped."""
        if not self._on_caller or self._thread is not threading.current_thread():
            raise RuntimeError(
                "run_here() must be called on the thread that called keep_on_caller()"
            )
        self._run_loop()

    def start(self) -> None:
        if self._on_caller:
            return
        self._thread = threading.Thread(target=self._run_loop, name=self.thread_name, daemon=True)
        self._thread.start()

    def _close(self, timeout: float) -> None:
        """Refuse new work, end the waiting jobs and wait for the loop to return."""
        for job in self.queue.close():
            job.post(Ended(Outcome.CANCELLED))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._done.wait(timeout)

    @property
    def loop_thread(self) -> threading.Thread | None:
        """The thread that runs (or will run) the loop."""
        return self._thread

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._done.is_set()

    # -- the asyncio side -----------------------------------------------------------------------
    def submit(self, job: Job) -> int:
        """Queue ``job``; raise :class:`QueueFullError` or :class:`ShuttingDownError`."""
        return self.queue.put(job)

    def withdraw(self, job: Job) -> None:
        """The client is gone or gave up: drop the job from the queue or stop it mid-decode."""
        job.cancel()
        self.queue.remove(job)


class EngineWorker(Worker):
    """Runs jobs one after another on a dedicated thread that alone calls the engine.

    ``stream`` is the engine's ``stream_ids``: it validates eagerly and returns a generator of
    :class:`TokenEvent`; the worker closes that generator when a job ends early.
    """

    def __init__(self, stream: StreamFn, *, max_queue: int) -> None:
        super().__init__(JobQueue(max_queue))
        self._stream = stream
        self._current: Job | None = None

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new work, end the waiting and running jobs, and join the thread."""
        current = self._current
        if current is not None:
            current.cancel()
        self._close(timeout)

    @property
    def busy(self) -> bool:
        return self._current is not None

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: waiting jobs times the mean job duration."""
        waiting = len(self.queue) + (1 if self.busy else 0)
        return max(1, min(600, math.ceil(waiting * self._mean_job_seconds)))

    # -- the worker thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            self._current = job
            t0 = time.perf_counter()
            try:
                ended = Ended(self._run(job))
            except SpecDecError as e:  # a request the engine refused: the client's error
                ended = Ended(Outcome.FAILED, e)
            except Exception as e:  # never let one request kill the only worker
                log.exception("request failed")
                ended = Ended(Outcome.FAILED, e)
            self._current = None
            self.jobs_done += 1
            elapsed = time.perf_counter() - t0
            self._mean_job_seconds = 0.8 * self._mean_job_seconds + 0.2 * elapsed
            # Free the slot before telling the client, so a client that sends its next request
            # as soon as this one ends is never refused for a job that is already over.
            self.queue.task_done()
            job.post(ended)

    def _run(self, job: Job) -> Outcome:
        if job.cancelled:
            return Outcome.CANCELLED
        if job.expired:
            return Outcome.TIMEOUT
        # raises eagerly on a bad request
        events = self._stream(job.prompt_ids, job.config, **job.options)
        try:
            job.post(Started(time.perf_counter()))
            for event in events:
                job.post(Produced(event, event.stats, time.perf_counter()))
                if event.finish_reason is not None:
                    return Outcome.DONE
                if job.cancelled:
                    return Outcome.CANCELLED
                if job.expired:
                    return Outcome.TIMEOUT
            return Outcome.DONE
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()  # frees the request's state now, not at garbage collection
