"""One way to name a speculator and its options: the spec grammar, parsed here and only here.

A *spec* is a registered name, optionally followed by ``:`` and comma-separated ``key=value``
options::

    prompt-lookup
    draft:model=/models/qwen-0.5b,k=6
    eagle:dir=heads/eagle3,tree=5x4x24
    medusa:heads                          # the first value may omit its key (the primary option)
    auto:arms=prompt-lookup+suffix        # lists: '+'-separated names ...
    auto:arms=[suffix,eagle:dir=heads]    # ... or bracketed specs with options of their own
    self:layers=[skip:2-4,7]              # brackets also quote a value that contains commas

Every speculator owns a frozen options dataclass (a subclass of :class:`SpeculatorOptions`)
registered with its factory; this module turns text into such an object, checking every key and
value against the dataclass's fields, and back (:func:`format_spec`). The library, the CLI
(``--speculator``), the server, the benchmark (``--methods``, a comma-separated list of specs)
and ``auto``'s arms all go through :func:`parse_spec`, so a new speculator with options is its
own module and nothing else.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, Union

from specdec.errors import ConfigError, UnknownSpeculatorError

if TYPE_CHECKING:
    from specdec.speculators.base import Speculator
    from specdec.target import LoadedModel


def option(default: Any = dataclasses.MISSING, *, help: str) -> Any:  # noqa: A002
    """A field of an options dataclass with the help text the CLI shows for it."""
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True, kw_only=True)
class SpeculatorOptions:
    """Base of every speculator's options: frozen, type-checked at construction.

    ``k`` is the most tokens the speculator drafts per step (chain length, or tree nodes for
    tree drafters); ``None`` uses the engine's ``num_draft_tokens``. Subclasses add their own
    fields with :func:`option` and validate ranges in ``__post_init__`` (calling this one).
    ``primary`` names the field a bare first value sets (``medusa:DIR``).
    """

    primary: ClassVar[str | None] = None
    k: int | None = option(None, help="most tokens drafted per step (default: the engine's K)")

    def __post_init__(self) -> None:
        name = _BY_OPTIONS.get(type(self), type(self).__name__)
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not _matches(value, hints[f.name]):
                raise ConfigError(
                    f"speculator {name!r}: option {f.name} must be {_describe(hints[f.name])}, "
                    f"got {value!r}"
                )
        if self.k is not None and self.k < 1:
            raise ConfigError(f"speculator {name!r}: option k must be >= 1, got {self.k}")


Factory = Callable[["LoadedModel", Any], "Speculator"]


@dataclass(frozen=True)
class Registration:
    """A registered speculator: its name, options type, factory and one-line summary.
    ``factory`` is ``None`` for a name the engine builds itself (``auto``: the controller over
    several speculators, see :mod:`specdec.speculators.auto`)."""

    name: str
    options: type[SpeculatorOptions]
    factory: Factory | None
    summary: str


_REGISTRY: dict[str, Registration] = {}
_BY_OPTIONS: dict[type[SpeculatorOptions], str] = {}


FactoryT = TypeVar("FactoryT", bound=Callable[..., Any])


def register(
    name: str, options: type[SpeculatorOptions] | None = None, *, summary: str = ""
) -> Callable[[FactoryT], FactoryT]:
    """Register ``factory(target, options) -> Speculator`` under ``name`` with its options type.

    Each options class belongs to one name: it is how an options object finds its factory. A
    speculator without options of its own gets an empty options class made for it (``k`` still
    applies). The factory's docstring's first line is the summary ``--help`` shows.
    """

    def deco(factory: FactoryT) -> FactoryT:
        register_options(name, options, factory, summary=summary or (factory.__doc__ or ""))
        return factory

    return deco


def register_options(
    name: str,
    options: type[SpeculatorOptions] | None,
    factory: Factory | None,
    *,
    summary: str = "",
) -> None:
    if options is None:
        title = "".join(p.capitalize() for p in name.replace("_", "-").split("-"))
        options = dataclasses.make_dataclass(
            f"{title}Options", [], bases=(SpeculatorOptions,), frozen=True, kw_only=True
        )
    if _BY_OPTIONS.get(options, name) != name:
        raise ConfigError(
            f"options class {options.__name__} is already registered for "
            f"{_BY_OPTIONS[options]!r}; give {name!r} its own options class"
        )
    _REGISTRY[name] = Registration(name, options, factory, summary.strip().split("\n")[0])
    _BY_OPTIONS[options] = name


def unregister(name: str) -> None:
    """Remove ``name`` (tests that register a speculator of their own clean up with this)."""
    reg = _REGISTRY.pop(name, None)
    if reg is not None and _BY_OPTIONS.get(reg.options) == name:
        del _BY_OPTIONS[reg.options]


def available() -> list[str]:
    return sorted(_REGISTRY)


def registration(name: str) -> Registration:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownSpeculatorError(
            f"unknown speculator {name!r}; available: {', '.join(available())}"
        ) from None


def registrations() -> list[Registration]:
    return [_REGISTRY[n] for n in available()]


def speculator_name(options: SpeculatorOptions) -> str:
    """The registered name an options object stands for."""
    name = _BY_OPTIONS.get(type(options))
    if name is None:
        raise UnknownSpeculatorError(
            f"{type(options).__name__} is not registered with any speculator; register it with "
            "@register(NAME, OPTIONS) or pass a spec string"
        )
    return name


def options_for(name: str, **values: Any) -> SpeculatorOptions:
    """``name``'s options object from Python values (``options_for("draft", model="d")``)."""
    return _build(registration(name), values)


def _build(reg: Registration, values: dict[str, Any]) -> SpeculatorOptions:
    """``reg``'s options from checked keys: unknown and missing ones are named."""
    name = reg.name
    known = {f.name for f in dataclasses.fields(reg.options)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            f"speculator {name!r} has no option {unknown[0]!r}; its options: {_keys(reg)}"
        )
    missing = [
        f.name
        for f in dataclasses.fields(reg.options)
        if f.name not in values
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        f = next(f for f in dataclasses.fields(reg.options) if f.name == missing[0])
        raise ConfigError(
            f"speculator {name!r} needs {missing[0]}=... ({f.metadata.get('help', '')}); "
            f"write {name}:{missing[0]}=VALUE"
        )
    return reg.options(**values)


# -- text -> options ------------------------------------------------------------------------


def split_specs(text: str) -> list[str]:
    """Split a comma-separated list of specs: a comma followed by ``key=`` continues the spec
    before it; brackets nest.

    >>> split_specs("none,eagle:dir=d,tree=5x4x24,auto:arms=[suffix,draft:model=m,k=3],hf")
    ['none', 'eagle:dir=d,tree=5x4x24', 'auto:arms=[suffix,draft:model=m,k=3]', 'hf']
    """
    out: list[str] = []
    for part in _split_top(text, ","):
        part = part.strip()
        if not part:
            continue
        if out and _is_option(part):
            out[-1] += "," + part
        else:
            out.append(part)
    return out


def parse_spec(
    text: str | SpeculatorOptions, extra: Mapping[str, Registration] | None = None
) -> SpeculatorOptions:
    """The options object ``text`` names (an options object is returned as it is).

    ``extra`` names more options types, looked up before the registry, for callers that
    reuse the grammar for things that are not speculators (the benchmark's Hugging Face
    baselines); their names are listed when a name is unknown. Nested specs (``auto``'s arms)
    are always speculators.

    >>> parse_spec("prompt-lookup:max_ngram=4,k=6")
    PromptLookupOptions(k=6, max_ngram=4, min_ngram=2)
    >>> format_spec(parse_spec("eagle:heads/e3,tree=6x8x60"))
    'eagle:dir=heads/e3,tree=6x8x60'
    """
    if isinstance(text, SpeculatorOptions):
        return text
    if not isinstance(text, str) or not text.strip():
        raise ConfigError("a speculator spec must be a non-empty string such as prompt-lookup")
    name, colon, rest = text.strip().partition(":")
    reg = _lookup(name.strip(), extra)
    if colon and not rest.strip():
        raise ConfigError(f"spec {text!r} has ':' but no options; write {name} or {name}:KEY=VALUE")
    fields = {f.name: f for f in dataclasses.fields(reg.options)}
    hints = typing.get_type_hints(reg.options)
    values: dict[str, Any] = {}
    items = _split_top(rest, ",") if colon else []
    for i, item in enumerate(items):
        item = item.strip()
        if not item:
            raise ConfigError(f"spec {text!r} has an empty option (two commas in a row?)")
        if _is_option(item):
            key, _, raw = item.partition("=")
            key = key.strip()
        elif i == 0 and reg.options.primary is not None:
            key, raw = reg.options.primary, item
        else:
            hint = (
                f"{name}:{reg.options.primary}=VALUE"
                if reg.options.primary
                else f"{name}:KEY=VALUE"
            )
            raise ConfigError(
                f"spec {text!r}: {item!r} is not KEY=VALUE (write {hint}); options of "
                f"{name!r}: {_keys(reg)}"
            )
        if key not in fields:
            raise ConfigError(
                f"speculator {name!r} has no option {key!r}; its options: {_keys(reg)}"
            )
        if key in values:
            raise ConfigError(f"spec {text!r} sets {key} twice")
        values[key] = _convert(name, key, raw.strip(), hints[key])
    return _build(reg, values)


def _lookup(name: str, extra: Mapping[str, Registration] | None) -> Registration:
    if extra and name in extra:
        return extra[name]
    try:
        return registration(name)
    except UnknownSpeculatorError:
        if not extra:
            raise
        names = ", ".join(sorted([*available(), *extra]))
        raise UnknownSpeculatorError(f"unknown name {name!r}; available: {names}") from None


def format_spec(options: SpeculatorOptions) -> str:
    """The spec text of ``options``, only the fields that differ from their defaults."""
    name = speculator_name(options)
    parts = []
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if f.default is not dataclasses.MISSING and value == f.default:
            continue
        parts.append(f"{f.name}={_format_value(value)}")
    return name + (":" + ",".join(parts) if parts else "")


def _format_value(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ",".join(format_spec(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    return f"[{text}]" if "," in text else text


def _split_top(text: str, sep: str) -> list[str]:
    """Split at ``sep`` outside brackets."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"unbalanced ']' in {text!r}")
        elif c == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ConfigError(f"unbalanced '[' in {text!r}")
    parts.append(text[start:])
    return parts


def _is_option(item: str) -> bool:
    key, eq, _ = item.partition("=")
    return bool(eq) and key.strip().replace("_", "a").replace("-", "a").isalnum()


def _unbracket(raw: str) -> str:
    return raw[1:-1] if raw.startswith("[") and raw.endswith("]") else raw


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def _convert(name: str, key: str, raw: str, hint: Any) -> Any:
    """``raw`` as the field's type; a clear error naming the option otherwise."""
    base, optional = _strip_optional(hint)
    if optional and raw.lower() in ("none", ""):
        return None
    if raw == "":
        raise ConfigError(f"speculator {name!r}: option {key} is empty")
    if typing.get_origin(base) is tuple:  # a list of nested specs (auto's arms)
        inner = _unbracket(raw)
        items = split_specs(inner) if raw.startswith("[") else _split_top(inner, "+")
        return tuple(parse_spec(s.strip()) for s in items if s.strip())
    raw = _unbracket(raw)
    try:
        if base is bool:
            if raw.lower() in _TRUE:
                return True
            if raw.lower() in _FALSE:
                return False
            raise ValueError(raw)
        if base is int:
            return int(raw)
        if base is float:
            return float(raw)
    except ValueError:
        raise ConfigError(
            f"speculator {name!r}: option {key} must be {_describe(hint)}, got {raw!r}"
        ) from None
    return raw


def _strip_optional(hint: Any) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _matches(value: Any, hint: Any) -> bool:
    base, optional = _strip_optional(hint)
    if value is None:
        return optional
    if typing.get_origin(base) is tuple:
        return isinstance(value, tuple) and all(isinstance(v, SpeculatorOptions) for v in value)
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, base) if isinstance(base, type) else True


def _describe(hint: Any) -> str:
    base, optional = _strip_optional(hint)
    if typing.get_origin(base) is tuple:
        word = "a list of speculator specs (a+b or [a,b:key=value])"
    else:
        word = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
            base, str(base)
        )
    return word + (" or none" if optional else "")


def _keys(reg: Registration) -> str:
    return ", ".join(f.name for f in dataclasses.fields(reg.options))


# -- help -----------------------------------------------------------------------------------


def describe_options(reg: Registration) -> Iterator[tuple[str, str, str]]:
    """(key, type and default, help) for each option of ``reg``."""
    hints = typing.get_type_hints(reg.options)
    for f in dataclasses.fields(reg.options):
        if f.default is dataclasses.MISSING:  # options are frozen: no default factories
            default = "required"
        else:
            value = f.default
            default = f"default {_format_value(value) if value not in (None, ()) else 'none'}"
        yield f.name, f"{_describe(hints[f.name])}, {default}", str(f.metadata.get("help", ""))


def registry_help(width: int = 100) -> str:
    """Every registered speculator with its options, for ``--help`` texts (generated, so it
    cannot drift from the code)."""
    lines = ["SPEC is NAME or NAME:KEY=VALUE,KEY=VALUE. Speculators:"]
    for reg in registrations():
        primary = f" (NAME:VALUE sets {reg.options.primary})" if reg.options.primary else ""
        lines.append(f"  {reg.name}: {reg.summary}{primary}")
        for key, kind, text in describe_options(reg):
            if key == "k":
                continue
            lines.append(f"      {key} ({kind}): {text}")
    lines.append("  every speculator also takes k=N (most tokens drafted per step)")
    return "\n".join(lines)
