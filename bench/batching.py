"""Continuous batching under load: real ``specdec serve`` processes, real streaming clients.

For each server configuration (speculation on and off, both with ``--max-batch``), runs the
load generator of ``bench/load_test.py`` at each concurrency level, reads the batch-size and
draft-length histograms from ``/metrics`` before and after every level, and checks every
response: greedy requests for the same prompt must return the same text at every concurrency
("mixed" counts those that do not) and make exactly the tokens they asked for ("truncated"):
``--max-tokens`` each, or with ``--lengths`` one drawn per request (equal lengths keep a plain
server's batch in lockstep, every sequence finishing on the same step; real traffic does not,
and a speculating server never does, since each sequence advances at its own acceptance). Then
a soak: ``--soak`` requests from 16 clients, a third of them hung up mid-stream at a random
chunk, with the server's RSS sampled throughout.

Throughput is reported twice. ``tok/s (all)`` is the level's tokens over its whole wall time,
drain included: the clients' last requests end at different times, and while the last few run
the batch is not the level's size (a speculating batch desynchronises, so its drain is longer
than a lockstep plain batch's). ``tok/s (busy)`` is the server's own token counter
(``specdec_decoded_tokens_total``) read when the clients start and again the moment the first
client runs out of requests: throughput while all the level's clients have a request in
flight, which is what a server under steady load of that size delivers. Writes
``report.md``, ``report.json`` and ``throughput.png`` into ``--out``. Usage::

    .venv/bin/python bench/batching.py --out bench-out/batching --threads 1 \\
        --concurrency 1,4,16,32 --repeats 3 --soak 500
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from rich.console import Console

sys.path.insert(0, str(Path(__file__).parent))
from load_test import PROMPTS, percentile  # noqa: E402

console = Console(stderr=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def decoded_tokens(url: str) -> float:
    """The server's count of tokens handed out so far (it moves every step)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("specdec_decoded_tokens_total "):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"{url} exports no specdec_decoded_tokens_total (an older server?)")


class ServerProcess:
    def __init__(self, args: list[str], log: Path, threads: int, cpus: str | None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "specdec.cli.main", "serve", "--port", str(self.port)]
        cmd += ["--threads", str(threads), "--log-level", "warning", *args]
        if cpus:
            cmd = ["taskset", "-c", cpus, *cmd]
        self.log = log.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited; see {log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.5)
        self.ps = psutil.Process(self.proc.pid)
        info = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]
        self.model = info["id"]

    def rss(self) -> int:
        return int(self.ps.memory_info().rss)

    def metrics(self) -> dict[str, dict[str, float]]:
        """Cumulative bucket counts of the batch histograms."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, dict[str, float]] = {"batch": {}, "draft": {}}
        for line in text.splitlines():
            for name, key in (
                ("specdec_batch_size_bucket", "batch"),
                ("specdec_batch_draft_length_bucket", "draft"),
            ):
                if line.startswith(name):
                    le = line.split('le="')[1].split('"')[0]
                    out[key][le] = float(line.rsplit(" ", 1)[1])
        return out

    def decoded_tokens(self) -> float:
        return decoded_tokens(self.url)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@dataclass
class Result:
    ok: bool
    prompt: int
    text: str = ""
    tokens: int = 0
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    hung_up: bool = False
    error: str | None = None
    wanted: int = 0  # the request's max_tokens


def stream_one(
    client: httpx.Client, model: str, prompt: int, max_tokens: int, hang_up_at: int | None
) -> Result:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPTS[prompt]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    sent = time.perf_counter()
    arrivals: list[float] = []
    parts: list[str] = []
    tokens = 0
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return Result(False, prompt, error=f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return Result(False, prompt, error=chunk["error"]["message"])
            for c in chunk.get("choices") or ():
                if c["delta"].get("content"):
                    arrivals.append(time.perf_counter())
                    parts.append(c["delta"]["content"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if hang_up_at is not None and len(arrivals) >= hang_up_at:
                return Result(True, prompt, "".join(parts), hung_up=True, wanted=max_tokens)
    gaps = [b - a for a, b in zip(arrivals[:-1], arrivals[1:], strict=False)]
    ttft = arrivals[0] - sent if arrivals else 0.0
    return Result(True, prompt, "".join(parts), tokens, ttft, gaps, wanted=max_tokens)


@dataclass
class Busy:
    """The window in which every client had a request in flight, by the server's counter."""

    seconds: float = 0.0
    tokens: float = 0.0


def run_clients(
    server: ServerProcess,
    clients: int,
    requests: int,
    lengths: list[int],
    hang_up: float = 0.0,
    seed: int = 0,
    busy: Busy | None = None,
) -> tuple[list[Result], float]:
    """``lengths``: the max_tokens each request's is drawn from (seeded: both servers get the
    same plan). Each client sends its next request as soon as its last one ends; ``busy`` (if
    given) receives the all-clients-busy window (see the module doc)."""
    rng = random.Random(seed)
    draw = random.Random(seed + 1)
    plan = [
        (
            i % len(PROMPTS),
            rng.randrange(1, 6) if rng.random() < hang_up else None,
            draw.choice(lengths),
        )
        for i in range(requests)
    ]
    results: list[Result | None] = [None] * requests
    lock = threading.Lock()
    next_index = 0
    start_tokens = server.decoded_tokens() if busy is not None else 0.0

    def client() -> None:
        nonlocal next_index
        with httpx.Client(base_url=server.url, timeout=600.0) as http:
            while True:
                with lock:
                    i = next_index
                    next_index += 1
                if i >= requests:
                    # index ``requests`` is handed out once: to the first client left idle
                    if i == requests and busy is not None:
                        busy.seconds = time.perf_counter() - start
                        busy.tokens = server.decoded_tokens() - start_tokens
                    return
                prompt, hang, max_tokens = plan[i]
                try:
                    results[i] = stream_one(http, server.model, prompt, max_tokens, hang)
                except httpx.HTTPError as e:
                    results[i] = Result(False, prompt, error=f"{type(e).__name__}: {e}")

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(max(1, clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    missing = Result(False, -1, error="not run")
    return [r if r is not None else missing for r in results], wall


def histogram(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """Per-bucket counts (not cumulative) of what happened between two scrapes."""
    edges = sorted((k for k in after if k != "+Inf"), key=float) + ["+Inf"]
    out: dict[str, int] = {}
    prev = 0.0
    for e in edges:
        n = after.get(e, 0.0) - before.get(e, 0.0)
        out[e] = int(n - prev)
        prev = n
    return {k: v for k, v in out.items() if v}


def mean_of(hist: dict[str, int]) -> float:
    total = sum(hist.values())
    if not total:
        return 0.0
    return sum(float(k if k != "+Inf" else 64) * v for k, v in hist.items()) / total


def level(
    server: ServerProcess,
    clients: int,
    requests: int,
    lengths: list[int],
    refs: dict[tuple[int, int], str],
) -> dict[str, Any]:
    before = server.metrics()
    busy = Busy()
    results, wall = run_clients(server, clients, requests, lengths, busy=busy)
    after = server.metrics()
    good = [r for r in results if r.ok]
    for r in good:
        refs.setdefault((r.prompt, r.wanted), r.text)
    mixed = sum(1 for r in good if r.text != refs[r.prompt, r.wanted])
    truncated = sum(1 for r in good if r.tokens != r.wanted)
    gaps = [g for r in good for g in r.gaps]
    batch = histogram(before["batch"], after["batch"])
    draft = histogram(before["draft"], after["draft"])
    tokens = sum(r.tokens for r in good)
    return {
        "clients": clients,
        "requests": requests,
        "lost": len(results) - len(good),
        "mixed": mixed,
        "truncated": truncated,
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "tok_s": round(tokens / wall, 2),
        "busy_tok_s": round(busy.tokens / busy.seconds, 2) if busy.seconds else 0.0,
        "busy_s": round(busy.seconds, 2),
        "ttft_p50_s": round(percentile([r.ttft for r in good], 50), 3),
        "ttft_p99_s": round(percentile([r.ttft for r in good], 99), 3),
        "itl_p50_ms": round(1000 * percentile(gaps, 50), 1),
        "itl_p99_ms": round(1000 * percentile(gaps, 99), 1),
        "batch_hist": batch,
        "batch_mean": round(mean_of(batch), 2),
        "draft_hist": draft,
        "draft_mean": round(mean_of(draft), 2),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "_gaps": gaps,
        "_ttfts": [r.ttft for r in good],
    }


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One level's repeats as one row: counts and histograms summed, latencies pooled,
    throughput the median run's (``tok_s_runs`` keeps every run's)."""
    out: dict[str, Any] = {"clients": runs[0]["clients"]}
    for key in ("requests", "lost", "mixed", "truncated", "tokens"):
        out[key] = sum(r[key] for r in runs)
    out["wall_s"] = round(sum(r["wall_s"] for r in runs), 2)
    out["tok_s"] = round(statistics.median(r["tok_s"] for r in runs), 2)
    out["busy_tok_s"] = round(statistics.median(r["busy_tok_s"] for r in runs), 2)
    gaps = [g for r in runs for g in r["_gaps"]]
    ttfts = [t for r in runs for t in r["_ttfts"]]
    out["ttft_p50_s"] = round(percentile(ttfts, 50), 3)
    out["ttft_p99_s"] = round(percentile(ttfts, 99), 3)
    out["itl_p50_ms"] = round(1000 * percentile(gaps, 50), 1)
    out["itl_p99_ms"] = round(1000 * percentile(gaps, 99), 1)
    for key in ("batch", "draft"):
        hist: dict[str, int] = {}
        for r in runs:
            for k, v in r[f"{key}_hist"].items():
                hist[k] = hist.get(k, 0) + v
        out[f"{key}_hist"] = hist
        out[f"{key}_mean"] = round(mean_of(hist), 2)
    out["errors"] = sorted({e for r in runs for e in r["errors"]})[:3]
    out["tok_s_runs"] = [r["tok_s"] for r in runs]
    out["busy_tok_s_runs"] = [r["busy_tok_s"] for r in runs]
    return out


def soak(
    server: ServerProcess, requests: int, max_tokens: int, refs: dict[tuple[int, int], str]
) -> dict:
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(server.rss())
            time.sleep(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    start_rss = server.rss()
    sampler.start()
    results, wall = run_clients(server, 16, requests, [max_tokens], hang_up=1 / 3, seed=1)
    stop.set()
    sampler.join()
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/health", timeout=5).json()["busy"]:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    health = httpx.get(f"{server.url}/health", timeout=5).json()
    whole = [r for r in results if r.ok and not r.hung_up]
    for r in whole:
        refs.setdefault((r.prompt, r.wanted), r.text)
    mixed = sum(1 for r in whole if r.text != refs[r.prompt, r.wanted])
    return {
        "requests": requests,
        "hung_up": sum(1 for r in results if r.hung_up),
        "lost": sum(1 for r in results if not r.ok),
        "mixed": mixed,
        "truncated": sum(1 for r in whole if r.tokens != max_tokens),
        "wall_s": round(wall, 1),
        "rss_start_mb": round(start_rss / 2**20),
        "rss_peak_mb": round(max(samples or [start_rss]) / 2**20),
        "rss_end_mb": round(server.rss() / 2**20),
        "busy_after": health["busy"],
        "rss_series_mb": [round(s / 2**20) for s in samples],
    }


def plot(configs: list[dict[str, Any]], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.print("[yellow]matplotlib missing: no plot[/]")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for cfg in configs:
        xs = [lv["clients"] for lv in cfg["levels"]]
        axes[0].plot(xs, [lv["tok_s"] for lv in cfg["levels"]], marker="o", label=cfg["label"])
        axes[1].plot(xs, [lv["itl_p99_ms"] for lv in cfg["levels"]], marker="o", label=cfg["label"])
    for ax, title in zip(axes, ("aggregate tokens/s", "p99 inter-token latency (ms)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streaming clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)


def markdown(configs: list[dict[str, Any]], soaked: dict[str, Any] | None, cmd: str) -> str:
    lines = [f"`{cmd}`", ""]
    lines.append(
        "| server | clients | tok/s (all) | × 1 client | tok/s (busy) | TTFT p50 s | ITL p50 ms "
        "| ITL p99 ms | p99 × 1 client | mean batch | mean draft L | lost | mixed | truncated |"
    )
    lines.append("|" + "---|" * 14)
    for cfg in configs:
        base = cfg["levels"][0]
        for lv in cfg["levels"]:
            lines.append(
                f"| {cfg['label']} | {lv['clients']} | {lv['tok_s']} | "
                f"{lv['tok_s'] / base['tok_s']:.2f} | {lv.get('busy_tok_s', '-')} | "
                f"{lv['ttft_p50_s']} | {lv['itl_p50_ms']} | "
                f"{lv['itl_p99_ms']} | {lv['itl_p99_ms'] / base['itl_p99_ms']:.2f} | "
                f"{lv['batch_mean']} | {lv['draft_mean']} | {lv['lost']} | {lv['mixed']} | "
                f"{lv['truncated']} |"
            )
    if len(configs) == 2:
        lines += [
            "",
            "| clients | speculation ÷ plain, tok/s (all) | per repeat "
            "| speculation ÷ plain, tok/s (busy) | per repeat |",
            "|---|---|---|---|---|",
        ]
        for a, b in zip(configs[0]["levels"], configs[1]["levels"], strict=True):
            cells = []
            for key in ("tok_s_runs", "busy_tok_s_runs"):
                each = [x / y if y else 0.0 for x, y in zip(a[key], b[key], strict=True)]
                cells += [f"{statistics.median(each):.2f}", ", ".join(f"{r:.2f}" for r in each)]
            lines.append(f"| {a['clients']} | " + " | ".join(cells) + " |")
    if soaked:
        lines += ["", "Soak (16 clients, a third hung up mid-stream):", ""]
        keys = [k for k in soaked if k != "rss_series_mb"]
        lines.append("| " + " | ".join(keys) + " |")
        lines.append("|" + "---|" * len(keys))
        lines.append("| " + " | ".join(str(soaked[k]) for k in keys) + " |")
    for cfg in configs:
        lines += ["", f"Batch sizes per step, {cfg['label']}:", ""]
        for lv in cfg["levels"]:
            lines.append(f"- {lv['clients']} clients: {lv['batch_hist']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument(
        "--requests", type=int, default=0, help="per level (default --per-client x clients, >= 8)"
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--lengths",
        default="",
        help="comma-separated max_tokens to draw each request's from (seeded, the same plan "
        "for both servers); default: every request --max-tokens",
    )
    ap.add_argument(
        "--per-client", type=int, default=2, help="requests per client and level (at least 8)"
    )
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--speculator", default="prompt-lookup")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpus", default=None, help="taskset CPU list for the servers")
    ap.add_argument(
        "--repeats", type=int, default=1, help="runs per level and server, order alternating"
    )
    ap.add_argument("--soak", type=int, default=500, help="soak requests (0: none)")
    ap.add_argument("--model-args", default="", help="extra serve arguments (e.g. --model DIR)")
    args = ap.parse_args(argv)
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        ap.error(f"--concurrency takes comma-separated integers, got {args.concurrency!r}")
    if min(levels) < 1:
        ap.error("every --concurrency level must be at least 1 client")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ap.error(f"cannot create --out {args.out}: {e.strerror}; pick a writable directory")
    cmd = "python bench/batching.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.repeats < 1 or args.per_client < 1:
        ap.error("--repeats and --per-client must be at least 1")
    try:
        lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else [args.max_tokens]
    except ValueError:
        ap.error(f"--lengths takes comma-separated integers, got {args.lengths!r}")
    if min(lengths) < 1:
        ap.error("every --lengths value must be at least 1")
    refs: dict[tuple[int, int], str] = {}  # greedy text per (prompt, max_tokens), both servers
    soaked = None
    servers: dict[str, ServerProcess] = {}
    try:
        # both servers up at once and the levels interleaved (each level: speculation, then
        # plain), so a drift in the machine's load biases neither side of the comparison
        for label in (args.speculator, "none"):
            serve = ["--speculator", label, "--max-batch", str(args.max_batch)]
            serve += ["--max-queue", "256", *args.model_args.split()]
            console.print(f"starting server: {label}")
            servers[label] = ServerProcess(
                serve, args.out / f"server-{label}.log", args.threads, args.cpus
            )
            run_clients(servers[label], 1, 2, [8])  # warm-up
        rows: dict[str, list[dict[str, Any]]] = {label: [] for label in servers}
        for c in levels:
            n = args.requests or max(8, args.per_client * c)
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label in servers}
            for repeat in range(args.repeats):
                # alternate which server goes first, so an order effect cancels out
                order = list(servers) if repeat % 2 == 0 else list(servers)[::-1]
                for label in order:
                    runs[label].append(level(servers[label], c, n, lengths, refs))
                    console.print(f"{label}: {c} clients: {runs[label][-1]['tok_s']} tok/s")
            for label in servers:
                rows[label].append(merge(runs[label]))
        configs = [{"label": label, "levels": rows[label]} for label in servers]
        if args.soak:
            console.print(f"soak: {args.soak} requests")
            soaked = soak(servers[args.speculator], args.soak, args.max_tokens // 2, {})
    finally:
        for server in servers.values():
            server.stop()
    (args.out / "report.json").write_text(
        json.dumps({"command": cmd, "configs": configs, "soak": soaked}, indent=1)
    )
    (args.out / "report.md").write_text(markdown(configs, soaked, cmd))
    plot(configs, args.out)
    print(markdown(configs, soaked, cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
