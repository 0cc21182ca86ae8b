"""``specdec generate``: one request, optionally compared with plain decoding."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from specdec.cli.common import (
    AdaptiveOpt,
    ChatTemplateOpt,
    DeviceOpt,
    DtypeOpt,
    GgufOpt,
    KOpt,
    ModelOpt,
    SpeculatorOpt,
    ThreadsOpt,
    TypicalOpt,
    err_console,
    load_engine,
    user_errors,
)
from specdec.errors import InvalidRequestError
from specdec.grammar import Grammar
from specdec.request import default_chat


def _grammar(json_schema: Path | None, regex: str | None, grammar: Path | None) -> Grammar | None:
    """The one constraint the options name (none, or exactly one of them)."""
    given = [
        name
        for name, v in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar))
        if v is not None
    ]
    if len(given) > 1:
        raise InvalidRequestError(f"give one of {', '.join(given)}, not several", param="grammar")
    if regex is not None:
        return Grammar.regex(regex)
    path = json_schema or grammar
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise InvalidRequestError(f"cannot read {path}: {e.strerror}", param="grammar") from None
    return Grammar.json_schema(text) if json_schema is not None else Grammar.ebnf(text)


def _summary(title: str, stats: dict[str, Any]) -> str:
    acc = ", ".join(f"{a:.2f}" for a in stats["acceptance_by_position"]) or "-"
    chosen = stats.get("choices")
    picks = (
        " | steps per speculator " + ", ".join(f"{k} {v}" for k, v in chosen.items())
        if chosen
        else ""
    )
    return (
        f"{title}: {stats['new_tokens']} tokens in {stats['seconds']:.2f} s = "
        f"{stats['tokens_per_s']:.2f} tok/s | τ (mean accepted) {stats['mean_accepted']:.2f} | "
        f"target forwards {stats['target_forwards']} | acceptance by position [{acc}] | "
        f"draft {stats['draft_seconds']:.2f} s, verify {stats['verify_seconds']:.2f} s{picks}"
    )


def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt text.")],
    model: ModelOpt = None,
    gguf: GgufOpt = None,
    speculator: SpeculatorOpt = "prompt-lookup",
    num_draft_tokens: KOpt = None,
    adaptive: AdaptiveOpt = True,
    typical: TypicalOpt = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0 = off.")] = 0,
    seed: Annotated[int | None, typer.Option(help="Seed for reproducible sampling.")] = None,
    stop: Annotated[
        list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")
    ] = None,
    chat: Annotated[
        bool | None,
        typer.Option(
            "--chat/--no-chat",
            help="Apply the model's chat template (default: when the model has one).",
            show_default=False,
        ),
    ] = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    chat_template: ChatTemplateOpt = None,
    threads: ThreadsOpt = None,
    compare: Annotated[
        bool, typer.Option("--compare", help="Also decode without speculation and compare.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    json_schema: Annotated[
        Path | None,
        typer.Option(
            "--json-schema", help="Constrain the output to JSON valid for this schema file."
        ),
    ] = None,
    regex: Annotated[
        str | None, typer.Option("--regex", help="Constrain the output to match this regex.")
    ] = None,
    grammar_file: Annotated[
        Path | None,
        typer.Option("--grammar", help="Constrain the output to this EBNF (Lark or GBNF) file."),
    ] = None,
) -> None:
    """Generate text with speculative decoding (optionally constrained by a grammar)."""
    with user_errors():
        grammar = _grammar(json_schema, regex, grammar_file)
        engine = load_engine(
            model,
            gguf,
            speculator,
            num_draft_tokens,
            dtype,
            adaptive,
            typical,
            threads,
            device=device,
            chat_template=chat_template,
        )
        mode = default_chat(engine.tokenizer, chat)
        if mode.note and not as_json:
            err_console.print(f"note: {mode.note}", highlight=False)
        use_chat = mode.chat
        kwargs: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=tuple(stop or ()),
            chat=use_chat,
            grammar=grammar,
        )
        # Validate and encode before anything is timed, so errors come first and fast.
        engine.encode(prompt, use_chat)
        baseline = None
        peer = None
        if compare:
            # Warm-up, so that first-call allocation costs hit neither measured run.
            engine.generate(prompt, **{**kwargs, "max_new_tokens": 2}, speculate=False)
            baseline = engine.generate(prompt, **kwargs, speculate=False)
            peer = _llamacpp_plain(engine, engine.encode(prompt, use_chat), max_new_tokens)
        if as_json:
            result = engine.generate(prompt, **kwargs)
        else:
            result = _stream_to_stdout(engine, prompt, kwargs, show_text=True)
    out: dict[str, Any] = result.to_dict()
    if baseline is not None:
        out["baseline"] = baseline.stats.to_dict()
        out["speedup"] = (
            round(baseline.stats.seconds / result.stats.seconds, 4)
            if result.stats.seconds
            else None
        )
        out["identical"] = result.token_ids == baseline.token_ids if temperature == 0 else None
    if peer is not None:
        out["llamacpp_plain"] = {
            "new_tokens": len(peer.token_ids),
            "seconds": round(peer.seconds, 4),
            "tokens_per_s": round(peer.tokens_per_s, 2),
        }
        ours = result.stats.tokens_per_s
        out["vs_llamacpp"] = round(ours / peer.tokens_per_s, 4) if peer.tokens_per_s else None
    out["numerics"] = engine.loaded.numerics if engine.loaded else None
    if as_json:
        sys.stdout.write(json.dumps(out) + "\n")
        return
    console = Console()
    console.print()
    console.print(_summary(f"{result.method}", out["stats"]), highlight=False)
    if baseline is not None:
        console.print(_summary("plain decoding", out["baseline"]), highlight=False)
        table = Table(show_header=False, box=None)
        table.add_row("speedup", f"{out['speedup']:.2f}x")
        if out["identical"] is not None:
            table.add_row("identical to plain greedy", "yes" if out["identical"] else "NO")
        if peer is not None:
            table.add_row("llama.cpp plain, same file", f"{peer.tokens_per_s:.2f} tok/s")
            if out["vs_llamacpp"] is not None:
                table.add_row("vs llama.cpp plain", f"{out['vs_llamacpp']:.2f}x")
        console.print(table)


def _llamacpp_plain(engine: Any, prompt_ids: list[int], max_new_tokens: int) -> Any:
    """llama.cpp's plain greedy decoding of the target's GGUF file, timed here on the same
    threads (:func:`specdec.target.llamacpp.plain_greedy`): what the user would otherwise run.
    ``None``, with a note, where the target has no GGUF file or llama.cpp is not installed."""
    import torch

    from specdec.target import llamacpp

    source = Path(engine.loaded.source) if engine.loaded is not None else None
    if source is None or source.suffix.lower() != ".gguf" or not source.is_file():
        err_console.print("note: the target is no GGUF file: llama.cpp is not compared")
        return None
    if not llamacpp.available():
        err_console.print(f"note: llama.cpp is not compared: {llamacpp.INSTALL_HINT}")
        return None
    threads = torch.get_num_threads()
    stop = frozenset(engine.eos_token_ids)
    llamacpp.plain_greedy(source, prompt_ids, 2, stop, threads)  # warm-up, as for ours
    return llamacpp.plain_greedy(source, prompt_ids, max_new_tokens, stop, threads)


def _stream_to_stdout(engine: Any, prompt: str, kwargs: dict[str, Any], show_text: bool) -> Any:
    from specdec.events import GenerationResult

    token_ids: list[int] = []
    parts: list[str] = []
    finish, stats = "length", None
    for event in engine.stream(prompt, **kwargs):
        token_ids.extend(event.token_ids)
        parts.append(event.text)
        if show_text and event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        stats = event.stats
        finish = event.finish_reason or finish
    if show_text:
        sys.stdout.write("\n")
    if stats is None:
        err_console.print("no tokens generated")
        raise typer.Exit(1)
    return GenerationResult("".join(parts), token_ids, finish, engine.method, stats)
