"""Pieces shared by the CLI commands: model options, error reporting, engine construction."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand, TyperOption

from specdec.errors import SpecDecError

if TYPE_CHECKING:
    from specdec.training.data import SelfDistilledData

err_console = Console(stderr=True)

ModelOpt = Annotated[
    Path | None,
    typer.Option(
        "--model",
        help="Local Hugging Face model directory, or a model pack alias (qwen2.5-coder-1.5b, "
        "qwen2.5-coder-0.5b; default: the bundled SmolLM2-135M-Instruct).",
    ),
]
DeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        help="cpu | cuda | cuda:N | auto (CUDA when present), each with its fastest "
        "exact numerics.",
    ),
]
ChatTemplateOpt = Annotated[
    Path | None,
    typer.Option(
        "--chat-template",
        help="Chat template file (.jinja, or a JSON file with a chat_template field) for a model "
        "that has none (many GGUF files).",
    ),
]
GgufOpt = Annotated[Path | None, typer.Option("--gguf", help="GGUF file to load as the target.")]
SPECULATOR_HELP = (
    "Speculator spec: NAME or NAME:KEY=VALUE,... (e.g. prompt-lookup, draft:layers:8, "
    "medusa:DIR,tree=calibrated:32, auto:arms=suffix+prompt-lookup). "
    "`--speculator help` or `specdec speculators` lists every speculator with its options."
)


def registered_speculators() -> str:
    """Every registered speculator with its options, read from the registry when called, so
    that a speculator registered after the CLI was imported (a plugin) is listed too."""
    import specdec.speculators  # noqa: F401  (registers the built-in speculators)
    from specdec.speculators.spec import registry_help

    return registry_help()


def speculator_help() -> str:
    """The full ``--speculator`` help (``\\b`` keeps the list's line breaks in click)."""
    return f"{SPECULATOR_HELP}\n\n\b\n{escape(registered_speculators())}"


def _speculator_callback(value: str) -> str:
    """``--speculator help`` prints the list of speculators and exits."""
    if value.strip() in ("help", "list"):
        typer.echo(registered_speculators())
        raise typer.Exit(0)
    return value


SpeculatorOpt = Annotated[
    str,
    typer.Option(
        "--speculator",
        "-s",
        metavar="SPEC",
        help=SPECULATOR_HELP,
        callback=_speculator_callback,
    ),
]
TypicalOpt = Annotated[
    bool,
    typer.Option(
        "--typical",
        help="Typical acceptance for sampled requests: faster, but LOSSY (output no longer "
        "follows the target's distribution exactly). Greedy is unaffected.",
    ),
]
KOpt = Annotated[
    int | None,
    typer.Option(
        "--num-draft-tokens",
        "-k",
        help="Most tokens drafted per step (default: 5 for the adaptive budget; a "
        "self-stopping draft chain up to 16).",
    ),
]
DtypeOpt = Annotated[
    str,
    typer.Option(
        "--dtype",
        help="auto (default: a GGUF file or pack on the CPU runs its own quantised blocks, "
        "kquant; anything else float32) | float32 (exact fp32, oneDNN fast path) "
        "| float32-stock | fp16-weights | bfloat16 "
        "| float64 | int8-dynamic | int8 | int4 | int4-g128 | int4-ort | kquant (CPU low-bit "
        "weights: docs/lowbit.md; int4-ort needs the ort extra; kquant runs a GGUF's "
        "own blocks) | gguf (the target's GGUF file run by "
        "llama.cpp on the CPU; needs the llamacpp extra).",
    ),
]

AdaptiveOpt = Annotated[
    bool,
    typer.Option(
        "--adaptive/--fixed",
        help="Adaptive: draft per step the length (<= K) that maximises measured tokens/s, "
        "nothing when drafting does not pay. Fixed: always draft K.",
    ),
]

PrecisionOpt = Annotated[
    str,
    typer.Option(
        "--precision",
        help="auto (bf16 matmuls where the hardware has them: AMX/AVX512-BF16 CPUs, Ampere+ "
        "GPUs) | bf16-mixed | fp32.",
    ),
]
ResumeOpt = Annotated[
    bool, typer.Option("--resume", help="Continue from the last checkpoint in --out.")
]
ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        "--threads",
        help="CPU threads (default: one per core that is not busy; the process is pinned to "
        "those cores; SPECDEC_PIN_THREADS=0 leaves cores and threads to torch).",
    ),
]
# shared by the trainers
DataOpt = Annotated[
    Path, typer.Option("--data", help="Self-distilled data from `specdec data generate`.")
]
DataDirsOpt = Annotated[
    list[Path],
    typer.Option(
        "--data",
        help="Self-distilled data from `specdec data generate`; repeat it (or comma-separate) "
        "to train on several directories of one prompt source, e.g. first and later turns.",
    ),
]
MaxStepsOpt = Annotated[
    int | None, typer.Option("--max-steps", help="Stop after N optimiser steps (smoke runs).")
]
BatchOpt = Annotated[int, typer.Option("--batch", help="Token positions per step.")]
CategoriesOpt = Annotated[
    str | None,
    typer.Option(
        "--categories",
        help="Train only on records whose prompt has one of these comma-separated categories "
        "(the prompt file's `category` field, e.g. chat,roleplay).",
    ),
]
ExcludeCategoriesOpt = Annotated[
    str | None,
    typer.Option(
        "--exclude-categories",
        help="Leave out records of these comma-separated categories (e.g. translation,code).",
    ),
]


def data_dirs(values: list[Path]) -> list[Path]:
    """The ``--data`` directories, comma-separated lists split (the option also repeats)."""
    return [Path(p) for v in values for p in str(v).split(",") if p.strip()]


def select_categories(
    dataset: SelfDistilledData, include: str | None, exclude: str | None
) -> SelfDistilledData:
    """``dataset`` restricted by the ``--categories`` / ``--exclude-categories`` options."""

    def names(text: str | None) -> list[str]:
        return [x.strip() for x in (text or "").split(",") if x.strip()]

    return dataset.select(names(include), names(exclude))


T = TypeVar("T")


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn specdec's typed errors into one line on stderr and exit code 2, no traceback.

    SIGTERM (``kill``, a scheduler's stop, a timeout) stops a command as Ctrl-C does, through
    its ``finally`` blocks: a long extraction or training then saves what it has and resumes
    later. A job started with ``&`` from a script cannot take Ctrl-C at all (the shell ignores
    SIGINT for it), so SIGTERM is how such a job is stopped."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    except SpecDecError as e:
        # escaped: a message quoting a spec ("[a,b:key=value]") is not rich markup
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Terminated)
        err_console.print("stopped (SIGTERM)" if terminated else "interrupted")
        raise typer.Exit(143 if terminated else 130) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so cleanup runs as for Ctrl-C."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def say_thread_plan(threads: int | None) -> None:
    """Pin the process to the cores that are not busy and size torch's threads to them
    (:mod:`specdec.cores`), and say what was chosen."""
    from specdec.cores import apply_thread_plan

    plan = apply_thread_plan(threads)
    if plan is not None:
        err_console.print(plan.describe(), highlight=False)


def load_target(
    model: Path | None,
    gguf: Path | None,
    dtype: str,
    threads: int | None = None,
    device: str = "cpu",
    *,
    pin: bool = True,
) -> Any:
    """Load the target alone (training, data generation), announcing a one-time conversion;
    the threads are planned first (:func:`say_thread_plan`) unless ``pin`` is false (nothing
    is computed: an export reads the weights only)."""
    from specdec.target import load_model

    if pin:
        say_thread_plan(threads)
    announce_conversion(model, gguf)
    loaded = load_model(model, gguf=gguf, dtype=dtype, device=device)
    if pin:
        say_numerics(loaded)
    return loaded


def announce_conversion(model: Path | None, gguf: Path | None) -> None:
    from transformers.utils import logging as hf_logging

    from specdec.target import loading

    hf_logging.set_verbosity_error()
    converting = False
    if model is None:
        gguf_path = gguf if gguf is not None else loading.default_gguf_path()
        if gguf_path.is_file() and not loading.is_converted(gguf_path):
            converting = True
            err_console.print(
                f"Converting {gguf_path.name} to safetensors once (about 30 s); cached under "
                f"{loading.cache_root()}"
            )
    # transformers' own bar shows the one-time conversion; the per-load bar is noise
    if converting:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()


def load_engine(
    model: Path | None,
    gguf: Path | None,
    speculator: str,
    num_draft_tokens: int | None,
    dtype: str,
    adaptive: bool = True,
    typical: bool = False,
    threads: int | None = None,
    *,
    device: str = "cpu",
    chat_template: Path | None = None,
) -> Any:
    """Build the engine from the engine options generate and serve share, telling the user
    about the one-time GGUF conversion. The spec is parsed first, so a bad one fails before
    the model loads."""
    from specdec.engine import SpeculativeEngine  # imports (registers) the speculators
    from specdec.speculators.spec import parse_spec

    options = parse_spec(speculator)
    say_thread_plan(threads)
    announce_conversion(model, gguf)
    engine = SpeculativeEngine.from_pretrained(
        model,
        gguf=gguf,
        speculator=options,
        num_draft_tokens=num_draft_tokens,
        dtype=dtype,
        adaptive=adaptive,
        typical_acceptance=typical,
        device=device,
        chat_template=chat_template,
    )
    say_numerics(engine.loaded)
    return engine


def say_numerics(loaded: Any) -> None:
    """One line on what the target runs in where ``--dtype auto`` chose for a GGUF file (its
    own blocks, or why not and what that costs), or another dtype was asked for: every speedup
    and every "identical" is measured in those numerics."""
    note = loaded.numerics_note
    if loaded.dtype_name == "float32" and note is None:
        return
    line = f"numerics: {loaded.dtype_name} ({loaded.numerics})"
    err_console.print(line if note is None else f"{line}, {note}", highlight=False)


class SpecHelpCommand(TyperCommand):
    """A command whose options' help texts are computed when ``--help`` is shown
    (``lazy_help``: option name -> text), not when the module is imported: the speculator
    list then includes speculators registered after the CLI was imported."""

    lazy_help: ClassVar[dict[str, Callable[[], str]]] = {"speculator": speculator_help}

    def format_help(self, ctx: Any, formatter: Any) -> None:
        for param in self.params:
            make = self.lazy_help.get(param.name or "")
            if make is not None and isinstance(param, TyperOption):
                param.help = make()
        super().format_help(ctx, formatter)


def speculators() -> None:
    """List every registered speculator with its options (what --speculator accepts)."""
    typer.echo(registered_speculators())


def run_guarded(fn: Callable[[], T]) -> T:
    with user_errors():
        return fn()


def is_tty() -> bool:
    return sys.stdout.isatty()
