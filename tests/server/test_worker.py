"""The worker and its queue, in-process with the real tiny engine: FIFO order, the bound,
withdrawal of a queued job, cancellation mid-decode, and a deadline that passes in the queue."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from specdec import GenerationConfig, SpeculativeEngine
from specdec.server.worker import (
    Ended,
    EngineWorker,
    Job,
    Outcome,
    Produced,
    QueueFullError,
    Started,
)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> SpeculativeEngine:
    return SpeculativeEngine.from_pretrained(tiny_model_dir, speculator="prompt-lookup")


async def _drain(job: Job) -> list[object]:
    out: list[object] = []
    while not out or not isinstance(out[-1], Ended):
        out.append(await job.messages.get())
    return out


def test_fifo_bound_withdraw_cancel_and_queue_timeout(engine: SpeculativeEngine) -> None:
    ids = engine.encode("ROMEO: But soft, what light", chat=False)
    long_cfg = GenerationConfig(max_new_tokens=300, ignore_eos=True)
    short_cfg = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    expected = engine.generate(
        "ROMEO: But soft, what light", chat=False, max_new_tokens=12, ignore_eos=True
    ).token_ids

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        worker = EngineWorker(engine.stream_ids, max_queue=3)
        worker.start()
        try:
            head = Job(ids, long_cfg, timeout=60, loop=loop)
            worker.submit(head)
            assert isinstance(await head.messages.get(), Started)  # head is decoding now
            b = Job(ids, short_cfg, timeout=60, loop=loop)
            gone = Job(ids, short_cfg, timeout=60, loop=loop)
            late = Job(ids, short_cfg, timeout=0.01, loop=loop)  # will expire while waiting
            for job in (b, gone, late):
                worker.submit(job)
            with pytest.raises(QueueFullError):
                worker.submit(Job(ids, short_cfg, timeout=60, loop=loop))
            worker.withdraw(gone)  # leaves the queue at once, freeing its slot
            assert len(worker.queue) == 2
            c = Job(ids, short_cfg, timeout=60, loop=loop)
            worker.submit(c)
            # head: cancel after a few steps; it must stop at the next step
            steps = 0
            while steps < 3:
                steps += isinstance(await head.messages.get(), Produced)
            worker.withdraw(head)
            head_rest = await _drain(head)
            assert head_rest[-1] == Ended(Outcome.CANCELLED)
            # stopped at the next step: far from its 300 tokens (a few steps may be in flight)
            assert sum(isinstance(m, Produced) for m in head_rest) < 50
            b_msgs, late_msgs, c_msgs = await _drain(b), await _drain(late), await _drain(c)
            assert late_msgs == [Ended(Outcome.TIMEOUT)]  # never started
            for msgs in (b_msgs, c_msgs):
                assert isinstance(msgs[0], Started) and msgs[-1] == Ended(Outcome.DONE)
                tokens = [t for m in msgs if isinstance(m, Produced) for t in m.event.token_ids]
                assert tokens == list(expected)
            started_b, started_c = b_msgs[0], c_msgs[0]
            assert isinstance(started_b, Started) and isinstance(started_c, Started)
            assert started_b.at < started_c.at  # first come, first served
            assert gone.messages.empty()  # withdrawn before it ran: the engine never saw it
        finally:
            await asyncio.to_thread(worker.stop)
        assert not worker.alive

    asyncio.run(scenario())


def test_engine_errors_reach_the_job_and_the_worker_survives(engine: SpeculativeEngine):
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        worker = EngineWorker(engine.stream_ids, max_queue=2)
        worker.start()
        try:
            too_long = Job([5] * 600, GenerationConfig(max_new_tokens=4), timeout=60, loop=loop)
            worker.submit(too_long)
            (ended,) = await _drain(too_long)
            assert isinstance(ended, Ended) and ended.outcome is Outcome.FAILED
            assert getattr(ended.error, "param", None) == "prompt"
            ok = Job([5, 6, 7], GenerationConfig(max_new_tokens=3), timeout=60, loop=loop)
            worker.submit(ok)
            assert (await _drain(ok))[-1] == Ended(Outcome.DONE)
        finally:
            await asyncio.to_thread(worker.stop)

    asyncio.run(scenario())
