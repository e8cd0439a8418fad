"""Dataclass fields that carry their command-line flag: the help, choices, aliases and default are
written once, on the field, and the argparse flags are generated from them.

    max_num_seqs: int = arg(128, "most requests in one step")

gives `--max-num-seqs N` (type from the annotation, default from the field). A bool that defaults
to False is a `--X` switch, one that defaults to True a `--no-X` switch. Options (all keywords):
choices (a sequence, or a function called when the parser is built, so that heavy tables load
late), aliases (["-tp"]), type (the argparse type when the annotation's is not right),
cli_default (the parser's default when it differs from the field's; a function is called when
the parser is built, e.g. to read an environment variable), from_cli (turns the parsed value
into the field's, e.g. GiB -> bytes), cli=False (no flag: set from Python only), flag (the
flag's name when it is not the field's, e.g. "--log-level"; a name without dashes is a
positional), nargs and metavar (argparse's).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Callable, Optional, Sequence, Union

_NO_DEFAULT = object()


def arg(
    default: Any,
    help: Optional[str] = None,
    *,
    choices: Union[Sequence, Callable, None] = None,
    aliases: Sequence[str] = (),
    type: Optional[Callable] = None,
    cli_default: Any = _NO_DEFAULT,
    from_cli: Optional[Callable] = None,
    cli: bool = True,
    flag: Optional[str] = None,
    nargs: Optional[str] = None,
    metavar: Optional[str] = None,
) -> Any:
    """A dataclass field with its flag's description in the metadata."""
    meta = {
        "help": help,
        "choices": choices,
        "aliases": tuple(aliases),
        "type": type,
        "cli_default": cli_default,
        "from_cli": from_cli,
        "cli": cli,
        "flag": flag,
        "nargs": nargs,
        "metavar": metavar,
    }
    return dataclasses.field(default=default, metadata=meta)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar_type(hint: Any) -> Optional[Callable]:
    """int / float / str from `int`, `Optional[int]`, ...; None for anything else (a str flag)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    hint = args[0] if typing.get_origin(hint) is Union and len(args) == 1 else hint
    return hint if hint in (int, float, str, bool) else None


def _help(meta: dict, default: Any) -> Optional[str]:
    text = meta["help"]
    if text is None or default is None or isinstance(default, bool) or "default" in text:
        return text
    return f"{text} (default {default})"


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, only: Optional[Sequence[str]] = None) -> None:
    """One flag per field of `cls` built with arg() (fields without its metadata are skipped);
    `only`: just these fields."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not meta.get("cli") or (only is not None and f.name not in only):
            continue
        default = f.default if meta["cli_default"] is _NO_DEFAULT else meta["cli_default"]
        from_env = callable(default)  # read now; never shown in --help (an API key)
        default = default() if from_env else default
        name = meta["flag"] or _flag(f.name)
        # A positional's name is its dest; argparse refuses a second one.
        where = {"dest": f.name} if name.startswith("-") else {}
        kind = _scalar_type(hints[f.name])
        if kind is bool and meta["type"] is None:
            on = not f.default
            flags = [name if on else "--no-" + f.name.replace("_", "-"), *meta["aliases"]]
            parser.add_argument(
                *flags, **where, action="store_true" if on else "store_false", default=default, help=meta["help"]
            )
            continue
        choices = meta["choices"]
        choices = choices() if callable(choices) else choices
        parser.add_argument(
            name,
            *meta["aliases"],
            **where,
            default=default,
            nargs=meta["nargs"],
            metavar=meta["metavar"],
            type=meta["type"] or (kind if kind not in (str, None) else None),
            choices=list(choices) if choices is not None else None,
            help=_help(meta, None if from_env else default),
        )


def positive_int(value: str) -> int:
    """An argparse type: an integer >= 1."""
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return n


def dataclass_from_args(cls: type, ns: argparse.Namespace, **overrides: Any) -> Any:
    """`cls` from a parsed namespace: each flag's value (the field's default where the parser had
    no such flag), passed through its from_cli; `overrides` win."""
    values = {}
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli") or not hasattr(ns, f.name):
            continue
        value = getattr(ns, f.name)
        convert = f.metadata["from_cli"]
        values[f.name] = convert(value) if convert is not None and value is not None else value
    values.update(overrides)
    return cls(**values)
