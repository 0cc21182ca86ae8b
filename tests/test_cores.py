"""Thread planning (:mod:`specdec.cores`): busy cores are left out, the count follows the free
cores or the user's request, and the CLI says what it chose."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from specdec.cores import BUSY, ThreadPlan, allowed_cores, core_load, plan_threads


def test_a_busy_core_is_left_out_and_the_count_follows_the_free_cores():
    plan = plan_threads(load={0: 0.99, 1: 0.01, 2: 0.2, 3: 0.7}, allowed=[0, 1, 2, 3])
    assert plan.cores == (1, 2) and plan.threads == 2
    assert plan.left_out == (0, 3)
    assert "core 0,3 are busy, 99%, 70%: left out" in plan.describe()


def test_every_core_busy_still_runs_one_thread_on_the_least_busy():
    plan = plan_threads(load={0: 0.9, 1: 0.8}, allowed=[0, 1])
    assert plan.cores == (1,) and plan.threads == 1


def test_a_requested_count_takes_the_least_busy_cores():
    plan = plan_threads(requested=1, load={0: 0.95, 1: 0.0}, allowed=[0, 1])
    assert plan.cores == (1,) and plan.threads == 1
    # more threads than cores: the user's count stands, on every core
    plan = plan_threads(requested=4, load={0: 0.0, 1: 0.0}, allowed=[0, 1])
    assert plan.threads == 4 and plan.cores == (0, 1)


def test_an_unreadable_load_counts_every_core_as_idle():
    plan = plan_threads(load={}, allowed=[0, 1, 2])
    assert plan.cores == (0, 1, 2) and plan.threads == 3
    assert plan.describe() == "threads: 3 on cores 0,1,2"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux affinity")
def test_a_real_busy_loop_is_seen_and_left_out():
    cores = allowed_cores()
    if len(cores) < 2 or not os.path.exists("/proc/stat"):
        pytest.skip("needs two cores and /proc/stat")
    busy_core = cores[0]
    spinner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os; os.sched_setaffinity(0, {{{busy_core}}})\nwhile True: pass",
        ]
    )
    try:
        time.sleep(0.3)
        load = core_load(cores, seconds=0.5)
        assert load[busy_core] >= BUSY, load
        if any(load[c] < BUSY for c in cores if c != busy_core):  # another core is free
            assert busy_core not in plan_threads(load=load, allowed=cores).cores
    finally:
        spinner.kill()
        spinner.wait()


@pytest.mark.slow(threads=1)  # a CLI process: seconds of imports
def test_the_cli_says_what_it_chose(tiny_model_dir):
    env = {**os.environ, "SPECDEC_PIN_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "specdec.cli.main", "generate", "--model", str(tiny_model_dir)]
        + ["--speculator", "none", "-n", "4", "--threads", "1", "hello"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "threads: 1 on core " in run.stderr


def test_describe_names_one_core():
    assert ThreadPlan((1,), 1, {0: 0.0, 1: 0.0}).describe() == "threads: 1 on core 1"
