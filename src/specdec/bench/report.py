"""report.md (Spec-Bench-style tables per task group and overall) and PNG plots."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specdec.bench.errors import PLOTS_INSTALL, PlotsUnavailableError
from specdec.bench.stats import (
    NEAR_TIE_MARGIN,
    MethodSummary,
    Record,
    Spread,
    methods_in,
    per_prompt_tau,
    ratio_interval,
    summarize,
)
from specdec.bench.workloads import TASK_GROUPS

OVERALL = "overall"


def groups_in(records: Sequence[Record]) -> list[str]:
    seen = list(dict.fromkeys(r["group"] for r in records))
    return [g for g in TASK_GROUPS if g in seen] + [g for g in seen if g not in TASK_GROUPS]


def summaries_by_group(records: Sequence[Record]) -> dict[str, list[MethodSummary]]:
    """Per task group, then ``overall`` (all prompts), in report order."""
    out: dict[str, list[MethodSummary]] = {}
    for g in groups_in(records):
        out[g] = summarize([r for r in records if r["group"] == g])
    out[OVERALL] = summarize(records)
    return out


def _spread(s: Spread | None, fmt: str = "{:.2f}", suffix: str = "") -> str:
    if s is None:
        return "–"
    main = fmt.format(s.median) + suffix
    if math.isclose(s.lo, s.hi):
        return main
    return f"{main} ({fmt.format(s.lo)}–{fmt.format(s.hi)})"


def _opt(x: float | None, fmt: str) -> str:
    return "–" if x is None else fmt.format(x)


def identity_cell(m: MethodSummary) -> str:
    i = m.identity
    if m.method == "none":
        return "reference"
    if i.compared == 0:
        return "–"
    if i.differing == 0:
        return f"{i.compared}/{i.compared}"
    note = f", first diff at {min(i.first_diffs)}"
    if i.near_ties == i.differing:
        note += ", fp near-tie"
    return f"**{i.compared - i.differing}/{i.compared}**{note}"


HEADER = (
    "| Method | tokens/s | speedup vs `none` | speedup vs `hf` | τ | drafting | identical |\n"
    "|---|---:|---:|---:|---:|---:|---|"
)


PEER_HEADER = (
    "| Method | tokens/s | speedup vs `none` | speedup vs `hf` | speedup vs `llamacpp` | τ "
    "| drafting | identical |\n|---|---:|---:|---:|---:|---:|---:|---|"
)


def table(summaries: Sequence[MethodSummary]) -> str:
    """The report's table; a column against llama.cpp where the run timed it."""
    peer = any(m.speedup_vs_llamacpp for m in summaries)
    rows = [PEER_HEADER if peer else HEADER]
    for m in summaries:
        vs_peer = f"| {_spread(m.speedup_vs_llamacpp, suffix='×')} " if peer else ""
        rows.append(
            f"| `{m.method}` | {_spread(m.tokens_per_s)} "
            f"| {_spread(m.speedup_vs_none, suffix='×')} "
            f"| {_spread(m.speedup_vs_hf, suffix='×')} {vs_peer}"
            f"| {_opt(m.mean_accepted, '{:.2f}')} "
            f"| {_opt(None if m.draft_fraction is None else 100 * m.draft_fraction, '{:.0f}%')} "
            f"| {identity_cell(m)} |"
        )
    return "\n".join(rows)


def fastest(summaries: Sequence[MethodSummary]) -> MethodSummary | None:
    ranked = [m for m in summaries if m.speedup_vs_none is not None]
    return max(ranked, key=lambda m: m.speedup_vs_none.median) if ranked else None  # type: ignore[union-attr]


def losers(summaries: Sequence[MethodSummary], reference: str = "none") -> list[MethodSummary]:
    return [
        m
        for m in summaries
        if m.method != reference and m.speedup_vs_none is not None and m.speedup_vs_none.median < 1
    ]


def pass_table(records: Sequence[Record]) -> list[str]:
    """τ and speedup per repeat ("pass"): with a speculator that learns across requests (the
    suffix cache), a second pass over the same prompts shows what it learned from the first.
    Empty for single-pass runs."""
    passes = sorted({int(r["repeat"]) for r in records})
    if len(passes) < 2:
        return []
    per_pass = {
        p: {m.method: m for m in summarize([r for r in records if int(r["repeat"]) == p])}
        for p in passes
    }
    head = "| Method | " + " | ".join(f"pass {p + 1}: τ / speedup" for p in passes) + " |"
    rows = [head, "|---|" + "---:|" * len(passes)]
    for method in methods_in(records):
        cells = []
        for p in passes:
            m = per_pass[p].get(method)
            tau = _opt(m.mean_accepted if m else None, "{:.2f}")
            sp = _spread(m.speedup_vs_none if m else None, suffix="×")
            cells.append(f"{tau} / {sp}")
        rows.append(f"| `{method}` | " + " | ".join(cells) + " |")
    out = ["## By pass over the prompt set", "", *rows, ""]
    for p in passes:
        out += [f"### Pass {p + 1}: speedup vs `none` / τ by task group", ""]
        out += group_grid([r for r in records if int(r["repeat"]) == p]) + [""]
    return out


def group_grid(records: Sequence[Record]) -> list[str]:
    """One row per method, one column per task group and overall: "speedup / τ"."""
    by_group = summaries_by_group(records)
    groups = list(by_group)
    rows = ["| Method | " + " | ".join(groups) + " |", "|---|" + "---:|" * len(groups)]
    for method in methods_in(records):
        cells = []
        for g in groups:
            m = next((x for x in by_group[g] if x.method == method), None)
            sp = _spread(m.speedup_vs_none if m else None, suffix="×")
            cells.append(f"{sp} / {_opt(m.mean_accepted if m else None, '{:.2f}')}")
        rows.append(f"| `{method}` | " + " | ".join(cells) + " |")
    return rows


def identity_details(records: Sequence[Record]) -> list[str]:
    lines = []
    for r in records:
        if r.get("identical") is False:
            margin = r.get("diff_margin")
            toks = r.get("diff_tokens") or {}
            verdict = (
                "a near-tie (fp reassociation can flip it; not a losslessness bug)"
                if margin is not None and margin < NEAR_TIE_MARGIN
                else "NOT a near-tie: investigate"
            )
            lines.append(
                f"- `{r['method']}` on question {r['question_id']} ({r['group']}), repeat "
                f"{r['repeat']}: first difference at output position {r['first_diff']} "
                f"(plain decoding: {toks.get('reference')}, method: {toks.get('method')}); "
                f"target top-2 logit margin there {_opt(margin, '{:.2e}')} "
                f"(top-1 {toks.get('top1')}, top-2 {toks.get('top2')}) → {verdict}"
            )
    return lines


def choice_table(records: Sequence[Record]) -> list[str]:
    """For methods that choose a speculator per step (``auto``): the share of steps each
    speculator drafted (``none``: plain steps), per task group."""
    rows = []
    for method in methods_in(records):
        recs = [r for r in records if r["method"] == method and r.get("choices")]
        if not recs:
            continue
        for g in [*groups_in(recs), OVERALL]:
            total: dict[str, int] = {}
            for r in recs:
                if g == OVERALL or r["group"] == g:
                    for arm, n in r["choices"].items():
                        total[arm] = total.get(arm, 0) + n
            steps = sum(total.values()) or 1
            shares = ", ".join(
                f"{arm} {n / steps:.0%}" for arm, n in sorted(total.items(), key=lambda x: -x[1])
            )
            rows.append(f"| `{method}` | {g} | {shares} |")
    if not rows:
        return []
    head = [
        "## Speculator chosen per step",
        "",
        "| Method | group | share of steps |",
        "|---|---|---|",
    ]
    return [*head, *rows, ""]


def auto_vs_best(
    by_group: Mapping[str, Sequence[MethodSummary]], records: Sequence[Record] = ()
) -> list[str]:
    """For each ``auto`` method: its speedup in every task group next to the fastest single
    method's (``auto`` variants, ``none`` and Hugging Face baselines excluded), and, from the
    per-prompt records, auto ÷ best with a 95% interval over the group's prompts."""
    autos = [m.method for m in by_group.get(OVERALL, []) if m.method.split(":")[0] == "auto"]
    if not autos:
        return []
    out = [
        "## `auto` against the best single method",
        "",
        "Ratio: `auto` ÷ the group's fastest single method, the geometric mean of per-prompt "
        'tokens/s ratios with a 95% t-interval over the group\'s prompts ("within noise": the '
        "interval contains 1). The fastest single method is picked after the fact, so it is "
        "favoured by its own noise.",
        "",
        "| group | best single method | its speedup | "
        + " | ".join(f"`{a}`" for a in autos)
        + " |",
        "|---|---|---:|" + "---:|" * len(autos),
    ]
    for g, sums in by_group.items():
        single = [
            m
            for m in sums
            if m.method.split(":")[0] not in ("auto", "none") and not m.method.startswith("hf")
        ]
        best = fastest(single)
        recs = records if g == OVERALL else [r for r in records if r["group"] == g]
        cells = []
        for a in autos:
            m = next((x for x in sums if x.method == a), None)
            ratio = ""
            iv = ratio_interval(recs, a, best.method) if best and recs else None
            if iv is not None and iv.n >= 2:
                ratio = f" ({iv.ratio:.2f} of best, {iv.lo:.2f}–{iv.hi:.2f}: {iv.verdict})"
            elif m and m.speedup_vs_none and best and best.speedup_vs_none:
                ratio = f" ({m.speedup_vs_none.median / best.speedup_vs_none.median:.2f} of best)"
            cells.append(_spread(m.speedup_vs_none if m else None, suffix="×") + ratio)
        name = f"`{best.method}`" if best else "–"
        speed = _spread(best.speedup_vs_none if best else None, suffix="×")
        out.append(f"| {g} | {name} | {speed} | " + " | ".join(cells) + " |")
    return [*out, ""]


def render_markdown(
    records: Sequence[Record],
    meta: Mapping[str, Any],
    plots: Sequence[str] = (),
) -> str:
    """The whole report; ``meta`` holds the command, settings and data set facts."""
    by_group = summaries_by_group(records)
    env = records[0]["env"] if records else {}
    methods = methods_in(records)
    n_prompts = {
        g: len({r["line"] for r in records if r["group"] == g}) for g in groups_in(records)
    }
    out = ["# specdec bench", ""]
    if meta.get("command"):
        out += ["Command:", "", "```", str(meta["command"]), "```", ""]
    out += [
        f"- Data set: `{meta.get('dataset', '?')}`; prompts per task group: "
        + ", ".join(f"{g} {n}" for g, n in n_prompts.items()),
        f"- Methods: {', '.join(f'`{m}`' for m in methods)}; "
        f"{_k_text(meta.get('num_draft_tokens'))}; greedy; "
        f"max new tokens {meta.get('max_new_tokens')}; "
        f"repeats {meta.get('repeats')}; methods interleaved per prompt after a warm-up",
        f"- Environment: {env.get('cpu')} ({env.get('cpu_count')} CPUs), torch threads "
        f"{env.get('threads')}, torch {env.get('torch')}, transformers {env.get('transformers')}, "
        f"dtype {env.get('dtype')} ({env.get('numerics')}), model `{env.get('model')}`",
    ]
    if env.get("cost_calibration") is not None:
        out.append(
            "- Verification cost: "
            + (
                "calibrated on this machine (`specdec calibrate cost`)"
                if env["cost_calibration"]
                else "generic prior (no `specdec calibrate cost` for this model here)"
            )
        )
    if meta.get("bad_lines"):
        out.append(f"- Skipped malformed data set lines: {meta['bad_lines']}")
    loads = [r["load_avg_1m"] for r in records if r.get("load_avg_1m") is not None]
    if loads:
        out.append(
            f"- Machine load (1-min load average when each run ended): median "
            f"{sorted(loads)[len(loads) // 2]:.1f}, max {max(loads):.1f} on "
            f"{env.get('cpu_count')} CPUs"
        )
    if meta.get("partial"):
        out.append(f"- **Partial run**: {meta['partial']}")
    if meta.get("note"):
        out.append(f"- {meta['note']}")
    out += [
        "",
        "tokens/s: total new tokens / total seconds (prefill included). Speedups: per-prompt "
        "tokens/s ratios against the same prompt's `none` (our plain decoding) or `hf` "
        "(`model.generate` greedy), then their geometric mean. Values are medians over repeats "
        "with (min–max) when repeats differ. τ: tokens committed per target forward. drafting: "
        "share of time spent proposing drafts. identical: prompts whose greedy output equals "
        "plain decoding's token for token.",
        "",
        "## Overall",
        "",
        table(by_group[OVERALL]),
        "",
    ]
    best_lines, lose_lines = [], []
    for g, sums in by_group.items():
        best = fastest(sums)
        if best is not None:
            best_lines.append(
                f"- {g}: `{best.method}` ({_spread(best.speedup_vs_none, suffix='×')} vs `none`)"
            )
        for m in losers(sums):
            lose_lines.append(
                f"- {g}: `{m.method}` {_spread(m.speedup_vs_none, suffix='×')} vs `none`"
            )
    out += ["## Fastest method per task group", "", *best_lines, ""]
    out += auto_vs_best(by_group, records)
    out += ["## Where a method is slower than plain decoding", ""]
    out += (lose_lines or ["- nowhere"]) + [""]
    for g, sums in by_group.items():
        if g == OVERALL:
            continue
        out += [f"## {g}", "", table(sums), ""]
    acc_rows = [m for m in by_group[OVERALL] if m.acceptance_by_position]
    if acc_rows:
        k = max(len(m.acceptance_by_position) for m in acc_rows)
        out += [
            "## Acceptance rate by draft position (overall)",
            "",
            "| Method | " + " | ".join(str(i + 1) for i in range(k)) + " |",
            "|---|" + "---:|" * k,
        ]
        for m in acc_rows:
            cells = [f"{a:.2f}" for a in m.acceptance_by_position]
            cells += ["–"] * (k - len(cells))
            out.append(f"| `{m.method}` | " + " | ".join(cells) + " |")
        out.append("")
    out += pass_table(records)
    out += choice_table(records)
    details = identity_details(records)
    out += ["## Identity with plain greedy decoding", ""]
    out += details or ["Every method produced exactly plain decoding's tokens on every prompt."]
    out.append("")
    if plots:
        out += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(out)


def plots_available() -> bool:
    """Whether matplotlib (the ``bench`` extra) imports, so that a caller can say so before a
    long run instead of failing after it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plots(records: Sequence[Record], out_dir: Path) -> list[Path]:
    """Grouped speedup bars, τ distribution, acceptance by position; returns the files."""
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailableError(
            f"plots need matplotlib, which is not installed: {PLOTS_INSTALL}, or pass --no-plots"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_group = summaries_by_group(records)
    methods = [m for m in methods_in(records) if m != "none"]
    files: list[Path] = []

    groups = list(by_group)
    fig_width = min(14.0, 2.0 + 0.35 * len(groups) * max(1, len(methods)))
    fig, ax = plt.subplots(figsize=(fig_width, 4.5))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        vals, errs_lo, errs_hi = [], [], []
        for g in groups:
            s = next((x.speedup_vs_none for x in by_group[g] if x.method == m), None)
            vals.append(s.median if s else 0.0)
            errs_lo.append(s.median - s.lo if s else 0.0)
            errs_hi.append(s.hi - s.median if s else 0.0)
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, vals, width, label=m, yerr=[errs_lo, errs_hi], capsize=2)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups, rotation=20)
    ax.set_ylabel("speedup vs plain decoding (geo. mean)")
    ax.set_title("Speedup per task group")
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(out_dir / "speedup.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    spec_methods = [m for m in methods if per_prompt_tau(records, m)]
    if spec_methods:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.boxplot([per_prompt_tau(records, m) for m in spec_methods])
        ax.set_xticks(range(1, len(spec_methods) + 1), spec_methods)
        ax.set_ylabel("τ (tokens per target forward), per prompt")
        ax.set_title("Mean accepted length distribution")
        fig.tight_layout()
        files.append(out_dir / "tau.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(6, 4))
        for m in spec_methods:
            acc = next(x.acceptance_by_position for x in by_group[OVERALL] if x.method == m)
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=m)
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1)
        ax.set_title("Acceptance by draft position (overall)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        files.append(out_dir / "acceptance.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return files


def write_report(
    records: Sequence[Record], out_dir: Path, meta: Mapping[str, Any], plots: bool = True
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = write_plots(records, out_dir) if plots and records else []
    path = out_dir / "report.md"
    path.write_text(render_markdown(records, meta, [str(f) for f in files]), encoding="utf-8")
    return path


def _k_text(k: object) -> str:
    """What bounded each step's draft: K when given, else the engine's defaults."""
    from specdec.decode.step import DEFAULT_NUM_DRAFT_TOKENS
    from specdec.speculators.draft_model import DEFAULT_CHAIN_DEPTH

    if k is None:
        return (
            f"drafts of up to {DEFAULT_NUM_DRAFT_TOKENS} tokens a step (a self-stopping chain: "
            f"up to {DEFAULT_CHAIN_DEPTH})"
        )
    return f"K = {k} draft tokens per step at most"
