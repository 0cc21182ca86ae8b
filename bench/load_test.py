"""Load generator for ``specdec serve``: throughput and latency at several concurrency levels.

Run a server first (loopback only), e.g. ``specdec serve --speculator prompt-lookup --port 8000``,
then::

    python bench/load_test.py --url http://127.0.0.1:8000 --concurrency 1,4,16 \
        --requests 8 --max-tokens 64

Every level sends ``--requests`` streaming chat requests (greedy, ``ignore_eos`` so each makes
exactly ``--max-tokens`` tokens) from ``concurrency`` client threads and reports:

* throughput: generated tokens per second of wall time, all clients together;
* TTFT: request sent -> first content chunk (queueing included: the server decodes one request
  at a time, so waiting grows with concurrency);
* ITL: gaps between consecutive content chunks of a stream, pooled over requests. One chunk is
  one engine step; with speculation a step can carry several tokens, so chunks are fewer;
* TPOT: per request, (last chunk - first chunk) / (tokens - 1), i.e. decode time per token;
* τ: mean tokens committed per target forward pass, from the response's ``speculation`` field.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

import httpx

PASSAGE = (
    "The quick brown fox jumps over the lazy dog near the riverbank every morning. "
    "Speculative decoding lets a cheap drafter propose several tokens that the large model "
    "then verifies in a single forward pass, keeping the output exactly the same."
)
PROMPTS = [
    f"Repeat this text exactly, word for word:\n\n{PASSAGE}",
    "Write a short Python function that returns the n-th Fibonacci number, with a docstring.",
    f"Rewrite the following text in the past tense:\n\n{PASSAGE}",
    "List the planets of the solar system in order from the sun, one per line.",
    "Explain in three sentences why the sky is blue.",
    f"Summarize this in one sentence:\n\n{PASSAGE}",
    "Give me a recipe for pancakes with a list of ingredients and steps.",
    "Write the numbers from one to twenty as English words, separated by commas.",
]


@dataclass
class RequestResult:
    ok: bool
    tokens: int = 0
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tpot: float | None = None
    tau: float | None = None
    error: str | None = None


@dataclass
class LevelReport:
    concurrency: int
    requests: int
    failed: int
    tokens: int
    wall_s: float
    throughput_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_ms: float
    itl_p99_ms: float
    tpot_p50_ms: float
    tau_mean: float


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def one_request(
    client: httpx.Client, model: str, prompt: str, max_tokens: int, ignore_eos: bool
) -> RequestResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    sent = time.perf_counter()
    arrivals: list[float] = []
    tokens, tau = 0, None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return RequestResult(False, error=f"HTTP {r.status_code}: {r.read().decode()[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return RequestResult(False, error=chunk["error"]["message"])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
            if chunk.get("speculation"):
                tau = chunk["speculation"]["mean_accepted"]
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if not arrivals:
        return RequestResult(False, error="no content received")
    gaps = [b - a for a, b in zip(arrivals[:-1], arrivals[1:], strict=True)]
    tpot = (arrivals[-1] - arrivals[0]) / (tokens - 1) if tokens > 1 else None
    return RequestResult(True, tokens, arrivals[0] - sent, gaps, tpot, tau)


def run_level(
    url: str, model: str, concurrency: int, requests: int, max_tokens: int, ignore_eos: bool
) -> LevelReport:
    local = threading.local()

    def task(i: int) -> RequestResult:
        if not hasattr(local, "client"):
            local.client = httpx.Client(base_url=url, timeout=600.0)
        try:
            return one_request(
                local.client, model, PROMPTS[i % len(PROMPTS)], max_tokens, ignore_eos
            )
        except httpx.HTTPError as e:
            return RequestResult(False, error=f"{type(e).__name__}: {e}")

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(task, range(requests)))
    wall = time.perf_counter() - start
    good = [r for r in results if r.ok]
    for r in results:
        if not r.ok:
            print(f"request failed: {r.error}", file=sys.stderr)
    tokens = sum(r.tokens for r in good)
    gaps = [g for r in good for g in r.gaps]
    ttfts = [r.ttft for r in good]
    tpots = [r.tpot for r in good if r.tpot is not None]
    taus = [r.tau for r in good if r.tau is not None]
    return LevelReport(
        concurrency=concurrency,
        requests=requests,
        failed=len(results) - len(good),
        tokens=tokens,
        wall_s=round(wall, 3),
        throughput_tok_s=round(tokens / wall, 2) if wall > 0 else 0.0,
        ttft_p50_s=round(percentile(ttfts, 50), 3),
        ttft_p99_s=round(percentile(ttfts, 99), 3),
        itl_p50_ms=round(1000 * percentile(gaps, 50), 2),
        itl_p99_ms=round(1000 * percentile(gaps, 99), 2),
        tpot_p50_ms=round(1000 * percentile(tpots, 50), 2),
        tau_mean=round(statistics.fmean(taus), 3) if taus else 0.0,
    )


def markdown(reports: list[LevelReport], label: str) -> str:
    head = (
        "| method | clients | requests | tokens | wall s | tok/s (all) | TTFT p50 s | "
        "TTFT p99 s | ITL p50 ms | ITL p99 ms | TPOT p50 ms | τ |"
    )
    rows = [head, "|" + "---|" * 12]
    for r in reports:
        rows.append(
            f"| {label} | {r.concurrency} | {r.requests - r.failed}/{r.requests} | {r.tokens} | "
            f"{r.wall_s} | {r.throughput_tok_s} | {r.ttft_p50_s} | {r.ttft_p99_s} | "
            f"{r.itl_p50_ms} | {r.itl_p99_ms} | {r.tpot_p50_ms} | {r.tau_mean} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts")
    ap.add_argument("--requests", type=int, default=8, help="requests per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    ap.add_argument("--warmup", type=int, default=1, help="untimed requests before measuring")
    ap.add_argument("--json", dest="json_out", help="also write the reports to this file")
    args = ap.parse_args(argv)
    host = urlparse(args.url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        ap.error("this load generator only targets a server on the loopback interface")
    if args.requests < 1 or args.max_tokens < 1:
        ap.error("--requests and --max-tokens must be >= 1")
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    with httpx.Client(base_url=args.url, timeout=30) as http:
        info = http.get("/v1/models").json()["data"][0]
    # the full spec (options included) where the server reports it, else the speculator's name
    model, method = info["id"], info.get("speculator", info.get("speculation_method", "?"))
    ignore_eos = not args.no_ignore_eos
    if args.warmup:
        run_level(args.url, model, 1, args.warmup, 8, ignore_eos)
    reports = []
    for c in levels:
        reports.append(run_level(args.url, model, c, args.requests, args.max_tokens, ignore_eos))
        print(f"done: {c} clients", file=sys.stderr)
    print(markdown(reports, method))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "model": model,
                    "method": method,
                    "max_tokens": args.max_tokens,
                    "levels": [asdict(r) for r in reports],
                },
                f,
                indent=2,
            )
    return 0 if all(r.failed == 0 for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
