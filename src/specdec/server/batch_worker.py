"""The engine thread for continuous batching: jobs join the running batch between steps.

Same contract towards the asyncio side as :class:`~specdec.server.worker.EngineWorker` (submit,
withdraw, retry_after, the :class:`Job` message protocol), but the thread drives a
:class:`~specdec.batch.BatchScheduler` instead of one request's generator: every loop it moves
waiting jobs into free batch slots, cancels the sequences whose clients left or whose deadline
passed (their rows are freed at the next step), runs one step and posts each sequence's event.

Fairness: jobs enter the batch in arrival order, and inside the batch every sequence advances
every step, so no request starves; the queue in front stays bounded (429 + Retry-After).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from specdec.batch import BatchScheduler, BatchSequence, StepReport
from specdec.batch.scheduler import DEFAULT_CHUNK, DEFAULT_SLOWDOWN
from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.server.worker import (
    Ended,
    Job,
    JobQueue,
    Outcome,
    Produced,
    Started,
    Worker,
)

log = logging.getLogger(__name__)


class BatchJobQueue(JobQueue):
    """A :class:`JobQueue` whose bound counts only jobs that must wait: while batch slots are
    free (``free_slots()``), a job offered is about to be taken and uses none of ``capacity``."""

    def __init__(self, capacity: int, free_slots: Callable[[], int]) -> None:
        super().__init__(capacity)
        self._free = free_slots

    def _room(self) -> int:
        return self.capacity + self._free()

    def take(self, block: bool) -> Job | None:
        """The oldest job; waits for one when ``block`` (``None`` once closed or, without
        ``block``, when none waits)."""
        with self._cond:
            while block and not self._items and not self._closed:
                self._cond.wait()
            if self._closed or not self._items:
                return None
            return self._items.popleft()


class BatchWorker(Worker):
    """Runs jobs as sequences of one continuous batch, on one thread (see the module doc)."""

    thread_name = "specdec-batch"

    def __init__(
        self,
        engine: SpeculativeEngine,
        *,
        max_batch: int,
        max_queue: int,
        chunk: int = DEFAULT_CHUNK,
        slowdown: float = DEFAULT_SLOWDOWN,
    ) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.scheduler = BatchScheduler(engine, max_batch=max_batch, chunk=chunk, slowdown=slowdown)
        self._jobs: dict[int, tuple[Job, BatchSequence]] = {}
        self._in_batch = 0  # read by the queue's bound from the event loop's thread
        self._queue = BatchJobQueue(max_queue, lambda: max(0, self.max_batch - self._in_batch))
        super().__init__(self._queue)
        self._stopping = False
        # called with each decode step's report (batch size, chosen draft length)
        self.on_step: Callable[[StepReport], None] | None = None

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new work, end the waiting jobs, cancel the batch's, and join the thread."""
        self._stopping = True
        self._close(timeout)

    @property
    def busy(self) -> bool:
        return self._in_batch > 0

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: the waiting jobs share ``max_batch`` slots."""
        waiting = len(self.queue) + 1
        rounds = math.ceil(waiting / max(1, self.max_batch))
        return max(1, min(600, math.ceil(rounds * self._mean_job_seconds)))

    # -- the worker thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            if not self._admit():
                return
            self._reap()
            if self.scheduler.idle:
                continue
            try:
                events = self.scheduler.step()
            except Exception as e:  # never let a failed step kill the only worker
                log.exception("batch step failed")
                self._fail_all(e)
                continue
            now = time.perf_counter()
            report = self.scheduler.last
            if report is not None and report.batch_size and self.on_step is not None:
                self.on_step(report)
            for seq, event in events:
                entry = self._jobs.get(seq.id)
                if entry is None:
                    continue
                job = entry[0]
                job.post(Produced(event, event.stats, now))
                if event.finish_reason is not None:
                    self._finish(seq, Ended(Outcome.DONE))
        for _job, seq in list(self._jobs.values()):
            self._finish(seq, Ended(Outcome.CANCELLED))

    def _admit(self) -> bool:
        """Move waiting jobs into free slots (blocking while nothing at all is to be done);
        ``False`` once the queue is closed."""
        while len(self._jobs) < self.max_batch:
            job = self._queue.take(block=self.scheduler.idle and not self._jobs)
            if job is None:
                return not self.queue.closed
            if job.cancelled:
                job.post(Ended(Outcome.CANCELLED))
                continue
            if job.expired:
                job.post(Ended(Outcome.TIMEOUT))
                continue
            try:
                seq = self.scheduler.add(job.prompt_ids, job.config, **job.options)
            except SpecDecError as e:  # a request the engine refused: the client's error
                job.post(Ended(Outcome.FAILED, e))
                continue
            except Exception as e:
                log.exception("request refused")
                job.post(Ended(Outcome.FAILED, e))
                continue
            self._jobs[seq.id] = (job, seq)
            self._in_batch = len(self._jobs)
            job.post(Started(time.perf_counter()))
        return True

    def _reap(self) -> None:
        """Cancel sequences whose client left or whose deadline passed."""
        for job, seq in list(self._jobs.values()):
            if job.cancelled or job.expired:
                self.scheduler.cancel(seq)
                self._finish(seq, Ended(Outcome.CANCELLED if job.cancelled else Outcome.TIMEOUT))

    def _finish(self, seq: BatchSequence, ended: Ended) -> None:
        entry = self._jobs.pop(seq.id, None)
        self._in_batch = len(self._jobs)
        if entry is None:
            return
        job = entry[0]
        self.jobs_done += 1
        elapsed = time.perf_counter() - job.submitted
        self._mean_job_seconds = 0.8 * self._mean_job_seconds + 0.2 * elapsed
        job.post(ended)

    def _fail_all(self, error: BaseException) -> None:
        for _job, seq in list(self._jobs.values()):
            self._finish(seq, Ended(Outcome.FAILED, error))
        self.scheduler = BatchScheduler(
            self.engine, max_batch=self.max_batch, chunk=self.scheduler.chunk
        )
