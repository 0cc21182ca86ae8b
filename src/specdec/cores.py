"""Which cores the process computes on, and with how many threads.

Why: a decode step is a chain of short parallel regions, each ending at a barrier where every
thread waits for the slowest. With another process busy on one of the cores, the thread that
shares that core runs only when the scheduler gives it a slice, and every barrier waits for
it: two-thread decoding then fell to a fraction of one thread's speed. So by default the
engine measures how busy each core it may run on is, leaves the busy ones out, runs one
thread per remaining core, pins the process to those cores (its threads then cannot drift
onto a busy one), and says what it chose. ``--threads N`` (or ``OMP_NUM_THREADS``) fixes the
count; the least busy cores are still the ones pinned. ``SPECDEC_PIN_THREADS=0`` leaves the
process's cores and torch's thread count as they are.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

BUSY = 0.5  # a core busy more than this share of the sample is left out
SAMPLE_S = 0.2
PIN_ENV = "SPECDEC_PIN_THREADS"


@dataclass(frozen=True)
class ThreadPlan:
    """The cores to pin to and the thread count, with the load that decided them."""

    cores: tuple[int, ...]
    threads: int
    load: Mapping[int, float] = field(default_factory=dict)  # core -> busy share at start
    requested: int | None = None

    @property
    def left_out(self) -> tuple[int, ...]:
        """Allowed cores not used because they were busy."""
        return tuple(c for c in sorted(self.load) if c not in self.cores)

    def describe(self) -> str:
        """One line for the user: what was chosen and why.

        >>> ThreadPlan((1,), 1, {0: 0.97, 1: 0.02}).describe()
        'threads: 1 on core 1 (core 0 is busy, 97%: left out)'
        """
        where = "core" if len(self.cores) == 1 else "cores"
        line = f"threads: {self.threads} on {where} {','.join(map(str, self.cores))}"
        busy = [c for c in self.left_out if self.load.get(c, 0.0) >= BUSY]
        if busy:
            shares = ", ".join(f"{self.load[c]:.0%}" for c in busy)
            verb = "is" if len(busy) == 1 else "are"
            line += f" (core {','.join(map(str, busy))} {verb} busy, {shares}: left out)"
        return line


def core_load(cores: Sequence[int], seconds: float = SAMPLE_S) -> dict[int, float]:
    """The busy share of each of ``cores`` over ``seconds``, from ``/proc/stat`` (empty where
    it cannot be read: then every core counts as idle)."""
    first = _cpu_times()
    if not first:
        return {}
    time.sleep(seconds)
    second = _cpu_times()
    load = {}
    for core in cores:
        a, b = first.get(core), second.get(core)
        if a is None or b is None:
            continue
        total = sum(b) - sum(a)
        idle = (b[3] + b[4]) - (a[3] + a[4])  # idle and iowait
        load[core] = 0.0 if total <= 0 else max(0.0, min(1.0, 1.0 - idle / total))
    return load


def _cpu_times() -> dict[int, list[int]]:
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return {}
    times = {}
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit():
            values = [int(v) for v in rest.split()]
            if len(values) >= 5:
                times[int(name[3:])] = values
    return times


def allowed_cores() -> list[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def plan_threads(
    requested: int | None = None,
    load: Mapping[int, float] | None = None,
    allowed: Sequence[int] | None = None,
) -> ThreadPlan:
    """One thread per core that is not busy (at least one: the least busy core), or
    ``requested`` threads on the least busy cores.

    >>> plan_threads(load={0: 0.98, 1: 0.03}, allowed=[0, 1]).cores
    (1,)
    >>> plan_threads(load={0: 0.1, 1: 0.0}, allowed=[0, 1]).threads
    2
    >>> plan_threads(requested=1, load={0: 0.0, 1: 0.9}, allowed=[0, 1]).cores
    (0,)
    """
    cores = list(allowed) if allowed is not None else allowed_cores()
    load = dict(load) if load is not None else core_load(cores)
    by_idleness = sorted(cores, key=lambda c: (load.get(c, 0.0), c))
    if requested is not None:
        n = max(1, requested)
        chosen = by_idleness[: min(n, len(by_idleness))]
        return ThreadPlan(tuple(sorted(chosen)), n, load, requested)
    free = [c for c in by_idleness if load.get(c, 0.0) < BUSY] or by_idleness[:1]
    return ThreadPlan(tuple(sorted(free)), len(free), load)


def requested_threads(threads: int | None) -> int | None:
    """``threads`` if given, else ``OMP_NUM_THREADS`` where the user set it."""
    if threads is not None:
        return threads
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else None


def pinning_enabled() -> bool:
    return os.environ.get(PIN_ENV, "1") not in ("0", "false", "no")


def apply_thread_plan(threads: int | None = None) -> ThreadPlan | None:
    """Choose and apply a :class:`ThreadPlan` (``None`` when pinning is switched off, after
    setting ``threads`` if given, as before)."""
    import torch

    if not pinning_enabled():
        if threads is not None:
            torch.set_num_threads(max(1, threads))
        return None
    plan = plan_threads(requested_threads(threads))
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, plan.cores)
        except OSError:
            pass  # not allowed here: the thread count still follows the load
    torch.set_num_threads(plan.threads)
    return plan
