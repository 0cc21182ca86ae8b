"""``specdec bench``: every method on the same prompts, interleaved, with a Spec-Bench report."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from specdec.bench.errors import PLOTS_INSTALL
from specdec.bench.workloads import SPEC_BENCH_QUESTIONS as DEFAULT_DATASET
from specdec.cli.common import (
    DeviceOpt,
    DtypeOpt,
    GgufOpt,
    KOpt,
    ModelOpt,
    SpecHelpCommand,
    err_console,
    load_target,
    registered_speculators,
    user_errors,
)

DEFAULT_METHODS = "none,prompt-lookup,draft:layers:8,hf,hf-prompt-lookup,hf-assisted:layers:8"
QUICK_TOKENS = 32
QUICK_METHODS = "none,prompt-lookup,draft:layers:8"  # our engine's: identity is what CI checks
EXIT_IDENTITY = 1  # --quick: a lossless method's output differed from plain decoding
EXIT_BAD_LINES = 3  # the run finished, but malformed data set lines were skipped
# Warm-up prompt, outside every data set: a speculator that learns across requests must not
# have seen a benchmark answer before the first recorded run.
WARMUP_PROMPT = "Name three colours."


METHODS_HELP = (
    "Comma-separated specs, each a speculator (as --speculator takes it: NAME or "
    "NAME:KEY=VALUE,...) or a Hugging Face baseline (hf, hf-prompt-lookup, "
    "hf-assisted:draft=DIR|layers:N); the report names each as written. Default: "
    f"{DEFAULT_METHODS} ({QUICK_METHODS} with --quick)."
)


def _methods_help() -> str:
    """``--methods`` help with the baselines and every registered speculator, computed when
    shown (see :class:`SpecHelpCommand`)."""
    from specdec.bench.methods import methods_help

    listed = escape(f"{methods_help()}\n{registered_speculators()}")
    return f"{METHODS_HELP}\n\n\b\n{listed}"


class BenchCommand(SpecHelpCommand):
    """``specdec bench``, whose ``--methods`` help lists what is registered when it is shown."""

    lazy_help = {"methods": _methods_help}


def _split(value: str | None) -> list[str] | None:
    if value is None:
        return None
    items = [v.strip() for v in value.split(",") if v.strip()]
    return items or None


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def _read_results(path: Path) -> list[dict[str, Any]]:
    from specdec.bench.errors import DatasetError

    if not path.is_file():
        raise DatasetError(f"results file {str(path)!r} does not exist")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    return rows


def _print_overall(console: Console, records: list[dict[str, Any]]) -> None:
    from specdec.bench.report import OVERALL, identity_cell, summaries_by_group

    sums = summaries_by_group(records)[OVERALL]
    table = Table(title="overall")
    peer = any(m.speedup_vs_llamacpp for m in sums)
    columns = ("method", "tokens/s", "vs none", "vs hf", *(("vs llama.cpp",) if peer else ()))
    for col in (*columns, "τ", "drafting", "identical"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for m in sums:
        vs_peer = m.speedup_vs_llamacpp
        table.add_row(
            escape(m.method),  # a spec's brackets are not rich markup
            f"{m.tokens_per_s.median:.2f}" if m.tokens_per_s else "–",
            f"{m.speedup_vs_none.median:.2f}×" if m.speedup_vs_none else "–",
            f"{m.speedup_vs_hf.median:.2f}×" if m.speedup_vs_hf else "–",
            *((f"{vs_peer.median:.2f}×" if vs_peer else "–",) if peer else ()),
            f"{m.mean_accepted:.2f}" if m.mean_accepted is not None else "–",
            f"{100 * m.draft_fraction:.0f}%" if m.draft_fraction is not None else "–",
            identity_cell(m).replace("**", ""),
        )
    console.print(table)


def bench(
    dataset: Annotated[
        Path | None,
        typer.Option(
            help="Spec-Bench / MT-bench question.jsonl (default: Spec-Bench's 480 questions, "
            "shipped with specdec)."
        ),
    ] = None,
    methods: Annotated[
        str | None,
        typer.Option(metavar="SPEC,SPEC,...", help=METHODS_HELP),
    ] = None,
    categories: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated task groups (mt_bench, translation, summarization, "
            "qa, math_reasoning, rag) or raw categories (default: all)."
        ),
    ] = None,
    per_category: Annotated[
        int | None, typer.Option("--per-category", help="Questions per category (default: all).")
    ] = None,
    max_new_tokens: Annotated[int | None, typer.Option("--max-new-tokens", "-n")] = None,
    repeats: Annotated[int, typer.Option(help="Passes over all prompts.")] = 1,
    out: Annotated[Path, typer.Option("--out", help="Output directory.")] = Path("bench-results"),
    model: ModelOpt = None,
    gguf: GgufOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    num_draft_tokens: KOpt = None,
    threads: Annotated[
        int | None,
        typer.Option(help="CPU threads (default: one per core that is not busy; 1 with --quick)."),
    ] = None,
    quick: Annotated[
        bool,
        typer.Option(
            "--quick",
            help=f"CI mode: 1 prompt per task group, {QUICK_TOKENS} new tokens; exits "
            f"{EXIT_IDENTITY} if a method's greedy output differs from plain decoding.",
        ),
    ] = False,
    plots: Annotated[
        bool,
        typer.Option(
            "--plots/--no-plots", help=f"Write PNG plots (needs {escape(PLOTS_INSTALL)})."
        ),
    ] = True,
    from_results: Annotated[
        Path | None,
        typer.Option(
            "--from-results",
            help="Only rebuild report.md and plots in --out from an existing results.jsonl.",
        ),
    ] = None,
) -> None:
    """Benchmark speculative decoding against plain decoding and Hugging Face generate.

    Exit codes: 0 ok; 1 (--quick) an output differed from plain decoding; 2 bad input;
    3 finished, but malformed data set lines were skipped.
    """
    console = Console(stderr=True)
    argv = sys.argv[sys.argv.index("bench") :] if "bench" in sys.argv else ["bench", "..."]
    command = "specdec " + " ".join(shlex.quote(a) for a in argv)
    with user_errors():
        from specdec.bench import report

        asked, plots = plots, _plots_possible(plots)
        if from_results is not None:
            from specdec.bench.stats import complete_prompts

            rows = _read_results(from_results)
            records = complete_prompts(rows)
            meta_path = from_results.parent / "meta.json"
            meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
            if len(records) < len(rows):
                meta["partial"] = (
                    f"left out {len(rows) - len(records)} result row(s) of a prompt that not "
                    "every method ran (an interrupted run)"
                )
            path = report.write_report(records, out, meta, plots)
            console.print(f"wrote {path}{_no_plots_note(asked, plots)}", highlight=False)
            return
        _run(
            console,
            command,
            dataset,
            methods,
            categories,
            per_category,
            max_new_tokens,
            repeats,
            out,
            model,
            gguf,
            dtype,
            num_draft_tokens,
            threads,
            quick,
            plots,
            _no_plots_note(asked, plots),
            device=device,
        )


def _plots_possible(plots: bool) -> bool:
    """``plots``, unless matplotlib is missing: then say so now, before a long run, and write
    the report without plots rather than fail after the run."""
    from specdec.bench.report import plots_available

    if plots and not plots_available():
        err_console.print(
            f"[yellow]warning:[/] matplotlib is not installed, so the report will have no plots "
            f"({escape(PLOTS_INSTALL)} to get them; --no-plots silences this)",
            highlight=False,
        )
        return False
    return plots


def _no_plots_note(asked: bool, plots: bool) -> str:
    """What the last line adds when plots were asked for but could not be drawn (rich markup
    escaped: ``[bench]`` is not a style)."""
    return f" (no plots: {escape(PLOTS_INSTALL)})" if asked and not plots else ""


def _run(
    console: Console,
    command: str,
    dataset: Path | None,
    methods: str | None,
    categories: str | None,
    per_category: int | None,
    max_new_tokens: int | None,
    repeats: int,
    out: Path,
    model: Path | None,
    gguf: Path | None,
    dtype: str,
    num_draft_tokens: int | None,
    threads: int | None,
    quick: bool,
    plots: bool,
    plots_note: str = "",
    *,
    device: str = "cpu",
) -> None:
    from specdec.bench import harness, report, stats
    from specdec.bench.errors import DatasetError
    from specdec.bench.methods import build_runners, parse_methods
    from specdec.bench.workloads import Question, load_questions, select
    from specdec.errors import InvalidRequestError

    # Everything a user can get wrong is checked before the model loads.
    if methods is None:
        methods = QUICK_METHODS if quick else DEFAULT_METHODS
    specs = parse_methods(methods)
    if dataset is None:
        if not DEFAULT_DATASET.is_file():
            raise DatasetError(
                f"no --dataset given and the default {DEFAULT_DATASET} does not exist"
            )
        dataset = DEFAULT_DATASET
    data = load_questions(dataset)
    for bad in data.bad_lines:
        err_console.print(
            f"[yellow]warning:[/] {dataset}:{bad.line}: skipped ({bad.reason})", highlight=False
        )
    if quick and per_category is None:
        per_category = 1
    if max_new_tokens is None:
        max_new_tokens = QUICK_TOKENS if quick else 128
    questions = select(data, _split(categories), per_category)
    config = harness.BenchConfig(
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        num_draft_tokens=num_draft_tokens,
        warmup_tokens=4 if quick else 8,
    )
    if threads is None and quick:
        threads = 1  # no speed is asserted; one thread degrades gracefully on a busy CI box
    if threads is not None and threads < 1:
        raise InvalidRequestError(f"--threads must be >= 1, got {threads}", "threads")

    loaded = load_target(model, gguf, dtype, threads, device=device)
    runners = build_runners(loaded, specs, num_draft_tokens)
    prompt_ids = harness.encode_questions(loaded, questions, config.chat)
    env = harness.environment(loaded)
    meta = {
        "command": command,
        "dataset": str(dataset),
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "num_draft_tokens": num_draft_tokens,
        "bad_lines": [f"line {b.line}: {b.reason}" for b in data.bad_lines],
        "note": "`hf-assisted` drafts a constant K tokens per step (HF's confidence cut-off "
        "off), like our `draft`; `hf-prompt-lookup` uses prompt_lookup_num_tokens=K.",
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    results_path = out / "results.jsonl"
    total = harness.total_runs(len(runners), len(questions), config)
    console.print(
        f"{len(questions)} prompts × {len(runners)} methods × {repeats} repeats, "
        f"{max_new_tokens} new tokens; writing {out}/",
        highlight=False,
    )
    with (
        results_path.open("w", encoding="utf-8") as sink,
        Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
        ) as progress,
    ):
        task = progress.add_task("warm-up", total=total)

        def on_run(phase: str, rec: dict[str, Any] | None) -> None:
            if rec is not None:
                sink.write(json.dumps(rec) + "\n")
                sink.flush()
                desc = (
                    f"{rec['group']} q{rec['question_id']} {escape(rec['method'])}: "
                    f"{rec['tokens_per_s']:.1f} tok/s"
                )
            else:
                desc = "warm-up"
            progress.update(task, advance=1, description=desc)
            if not console.is_terminal:  # a log file gets one line per run instead of a bar
                t = progress.tasks[0]
                eta = f"{t.time_remaining:.0f} s" if t.time_remaining is not None else "?"
                console.print(
                    f"[{t.completed:.0f}/{total}] {desc} | elapsed {t.elapsed or 0:.0f} s, "
                    f"ETA {eta}",
                    highlight=False,
                )

        warmup = Question("warmup", "warmup", "warmup", WARMUP_PROMPT, 0)
        warmup_ids = harness.encode_questions(loaded, [warmup], config.chat)[0]
        records = harness.run_benchmark(
            loaded,
            runners,
            questions,
            prompt_ids,
            config,
            env=env,
            on_run=on_run,
            warmup_ids=warmup_ids,
        )
    path = report.write_report(records, out, meta, plots)
    _print_overall(Console(), records)
    console.print(f"wrote {results_path} and {path}{plots_note}", highlight=False)
    unexplained = {s.method: s.identity for s in stats.summarize(records) if s.identity.unexplained}
    if unexplained:
        names = ", ".join(f"{escape(m)} ({i.unexplained} prompts)" for m, i in unexplained.items())
        err_console.print(f"[bold red]identity:[/] output differs from plain decoding: {names}")
        if quick:
            raise typer.Exit(EXIT_IDENTITY)
    if data.bad_lines:
        err_console.print(
            f"[yellow]warning:[/] {len(data.bad_lines)} malformed line(s) in {dataset} were "
            f"skipped (first: line {data.bad_lines[0].line})"
        )
        raise typer.Exit(EXIT_BAD_LINES)
