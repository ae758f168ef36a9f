"""One list per setting: a settings dataclass's fields, documented once, and what is built
from them.

A component's settings are the fields of one frozen dataclass (``RouterConfig``,
``ConnectorConfig``). Each field carries its documentation and its check in
``field(metadata=setting(...))``; the command-line flags, their ``KVTURN_*`` variables, the
config-file keys, the help texts, the validation and the docs' settings tables are all built
from those fields, so that adding a setting is one edit (the idea of vLLM's engine arguments,
which it builds from its config classes). ``tests/server/test_settings.py`` checks that every
field has its flag, variable, key and docs row.

Renamed settings keep their old names as ``aliases``: still read from flags, variables and
files, with a :class:`DeprecatedSettingWarning` naming the new one.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import types
import typing
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any, TextIO

SETTING = "kvturn.setting"
"""The metadata key of a field's :class:`Setting`."""

Check = Callable[[str, Any], Any]
"""Validates one value, given the setting's name for the message; returns it (possibly
normalized) or raises the component's own error."""


class DeprecatedSettingWarning(FutureWarning):
    """A setting was given by its former name; it still works, the message names the new one.
    (A FutureWarning: Python shows those to users by default.)"""


@dataclass(frozen=True)
class Setting:
    """What a settings field says about itself besides its name, type and default."""

    doc: str
    """One text for ``--help`` and the docs' table: what the setting does, plain words."""
    check: Check | None = None
    unit: str = ""
    """Shown after the default (``s``, ``tokens``, ``bytes``)."""
    default_doc: str | None = None
    """The default in words, where the value says too little (``prefill-timeout + 10``)."""
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    flag: bool = True
    """False: never a flag (a secret: command lines show in ``ps``); a file key and a variable
    still are."""
    aliases: tuple[str, ...] = ()
    """Former names, still read (flag, variable, file key) with a deprecation warning."""


def setting(doc: str, *, check: Check | None = None, unit: str = "",
            default_doc: str | None = None, metavar: str | None = None,
            choices: Collection[str] = (), flag: bool = True,
            aliases: Collection[str] = ()) -> dict[str, Setting]:
    """The ``metadata`` of a settings field: ``x: float = field(default=X, metadata=setting(
    "what x does", check=...))``."""
    return {SETTING: Setting(doc, check, unit, default_doc, metavar, tuple(choices), flag,
                             tuple(aliases))}


def settings_of(cls: type) -> Iterator[tuple[Field[Any], Setting]]:
    """Every field of ``cls`` that is a setting, in declaration order."""
    for f in fields(cls):
        meta = f.metadata.get(SETTING)
        if isinstance(meta, Setting):
            yield f, meta


def check_all(instance: Any) -> None:
    """Run every field's check on ``instance`` (a frozen dataclass): store what it returns."""
    for f, meta in settings_of(type(instance)):
        if meta.check is not None:
            value = meta.check(f.name, getattr(instance, f.name))
            if value is not getattr(instance, f.name):
                object.__setattr__(instance, f.name, value)


def flag_name(name: str) -> str:
    """``prefill_policy`` -> ``--prefill-policy``."""
    return "--" + name.replace("_", "-")


def env_name(prefix: str, name: str) -> str:
    """``KVTURN_`` and ``prefill_policy`` -> ``KVTURN_PREFILL_POLICY``."""
    return prefix + name.upper()


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def value_type(cls: type, name: str) -> Any:
    """The field's type without ``None`` (``float | None`` -> ``float``)."""
    hint = _hints(cls)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else str
    return hint


def is_list(kind: Any) -> bool:
    return typing.get_origin(kind) in (tuple, list)


def default_text(f: Field[Any], meta: Setting) -> str | None:
    """The default as a reader wants it (``480 s``, ``on``, ``kv-aware``); None: none to show."""
    if meta.default_doc is not None:
        return meta.default_doc
    if f.default is MISSING or f.default is None:
        return None
    value = f.default
    if isinstance(value, bool):
        text = "on" if value else "off"
    elif isinstance(value, float) and value.is_integer():
        # 480 s, but a unitless fraction keeps its point: 1.0
        text = f"{value:.0f}" if meta.unit else repr(value)
    elif isinstance(value, float):
        text = f"{value:g}"
    else:
        text = str(value)
    return f"{text} {meta.unit}" if meta.unit else text


def help_text(f: Field[Any], meta: Setting) -> str:
    """``--help``'s line: the doc, the default, former names."""
    text = meta.doc
    default = default_text(f, meta)
    if default is not None:
        text += f" (default: {default})"
    if meta.aliases:
        text += f" (formerly {', '.join(flag_name(a) for a in meta.aliases)}, still read)"
    return text


def field_help(cls: type, name: str) -> str:
    """``--help``'s line for the setting ``name`` of ``cls``, for a command that sets it on
    another component's behalf (``kvturn up`` sets connector keys)."""
    for f, meta in settings_of(cls):
        if f.name == name:
            return help_text(f, meta)
    raise KeyError(f"{cls.__name__} has no setting {name!r}")


class _Deprecated(argparse.Action):
    """A former flag: warns, then stores as the new one (its own ``type`` already applied)."""

    def __init__(self, *args: Any, new: str, **kwargs: Any) -> None:
        self.new = new
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        new = self.new
        if option_string is not None and option_string.startswith("--no-"):
            new, values = "--no-" + new.removeprefix("--"), False
        elif self.nargs == 0:
            values = True
        deprecated(f"{option_string} is deprecated, use {new} (the same setting)")
        setattr(namespace, self.dest, values)


def deprecated(message: str) -> None:
    warnings.warn(message, DeprecatedSettingWarning, stacklevel=3)


@contextlib.contextmanager
def plain_warnings(prog: str) -> Iterator[None]:
    """Within: a former setting name is reported as one line, ``<prog>: warning: ...``, as a
    command line's user wants it (not Python's file:line form)."""
    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: TextIO | None = None, line: str | None = None) -> None:
            if issubclass(category, DeprecatedSettingWarning):
                sys.stderr.write(f"{prog}: warning: {message}\n")
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def add_alias(parser: argparse.ArgumentParser | Any, old: str, new: str, dest: str,
              type_: Any = None, *, switch: bool = False) -> None:
    """``old`` (a former flag, hidden from ``--help``) sets ``dest`` as ``new`` does."""
    if switch:
        parser.add_argument(old, "--no-" + old.removeprefix("--"), dest=dest, nargs=0,
                            action=_Deprecated, new=new, help=argparse.SUPPRESS)
    else:
        parser.add_argument(old, dest=dest, type=type_, action=_Deprecated, new=new,
                            help=argparse.SUPPRESS, default=argparse.SUPPRESS)


def add_setting_args(parser: argparse.ArgumentParser | Any, cls: type) -> None:
    """A flag per setting of ``cls`` (those with ``flag``), each defaulting to None so that a
    file or a variable can supply the value; ``bool`` settings get ``--x/--no-x``, lists are
    repeatable, choices are checked."""
    for f, meta in settings_of(cls):
        if not meta.flag:
            continue
        kind = value_type(cls, f.name)
        option = flag_name(f.name)
        kwargs: dict[str, Any] = {"default": None, "help": help_text(f, meta)}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif is_list(kind):
            kwargs.update(action="append", metavar=meta.metavar or "VALUE")
        elif meta.choices:
            kwargs["choices"] = meta.choices
        else:
            kwargs.update(type=kind, metavar=meta.metavar or _metavar(f.name, kind, meta))
        parser.add_argument(option, **kwargs)
        if meta.aliases and is_list(kind):
            raise TypeError(f"{f.name}: a list setting cannot have former names (yet)")
        for alias in meta.aliases:
            add_alias(parser, flag_name(alias), option, f.name,
                      None if kind is bool or is_list(kind) else kind, switch=kind is bool)


def _metavar(name: str, kind: Any, meta: Setting) -> str:
    if meta.unit == "s":
        return "SECONDS"
    if kind in (int, float):
        return "N"
    return name.rsplit("_", 1)[-1].upper()


def env_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _env_reader(kind: Any, meta: Setting) -> Callable[[str], Any]:
    """How a variable's text is read: as its flag reads it."""
    if kind is bool:
        return env_bool
    if is_list(kind):
        return lambda text: tuple(text.split())
    if meta.choices:
        def choice(text: str) -> str:
            if text not in meta.choices:
                raise ValueError(f"invalid choice: {text!r} (choose from "
                                 f"{', '.join(meta.choices)})")
            return text
        return choice
    reader: Callable[[str], Any] = kind
    return reader


def settings_from_env(cls: type, environ: Mapping[str, str], prefix: str, *,
                      error: Callable[[str], Exception], skip: Collection[str] = (),
                      only: Collection[str] | None = None) -> dict[str, Any]:
    """The settings of ``cls`` given as ``<prefix><NAME>`` variables (empty ones count as
    unset, former names warn), read as their flags read them; ``error(message)`` naming the
    variable when one cannot be. Settings in ``skip`` are not read at all; with ``only``, just
    those are."""
    values: dict[str, Any] = {}
    for f, meta in settings_of(cls):
        if f.name in skip or (only is not None and f.name not in only):
            continue
        kind = value_type(cls, f.name)
        for name in (f.name, *meta.aliases):
            text = environ.get(env_name(prefix, name), "")
            if text.strip():
                break
        else:
            continue
        variable = env_name(prefix, name)
        if name != f.name:
            deprecated(f"{variable} is deprecated, use {env_name(prefix, f.name)} (the same "
                       "setting)")
        reader = _env_reader(kind, meta)
        try:
            values[f.name] = reader(text.strip())
        except ValueError as exc:
            detail = (f"invalid {kind.__name__} value: {text!r}" if kind in (int, float)
                      else str(exc))
            raise error(f"{variable} (as {flag_name(f.name)}): {detail}") from exc
    return values


def rename_aliases(cls: type, values: Mapping[str, Any], *, where: str,
                   error: Callable[[str], Exception]) -> dict[str, Any]:
    """``values`` (file keys, dashes read as underscores) with former names renamed, each with
    a warning; both names at once is an error."""
    out = {k.replace("-", "_"): v for k, v in values.items()}
    for f, meta in settings_of(cls):
        for alias in meta.aliases:
            if alias not in out:
                continue
            if f.name in out:
                raise error(f"{where}: {alias} is the former name of {f.name}; give one")
            deprecated(f"{where}: {alias} is deprecated, use {f.name} (the same setting)")
            out[f.name] = out.pop(alias)
    return out


def markdown_table(cls: type, *, key: str = "setting", env_prefix: str | None = None,
                   flags: bool = True) -> str:
    """The docs' settings table of ``cls``, one row per setting: its key (and flag and
    variable), its default and its doc. Generated; the docs hold a copy, checked by a test."""
    head = [key, "flag, variable"] if flags else [key]
    lines = ["| " + " | ".join([*head, "default", "meaning"]) + " |",
             "|" + "---|" * (len(head) + 2)]
    for f, meta in settings_of(cls):
        cells = [f"`{f.name}`"]
        if flags:
            names = [f"`{flag_name(f.name)}`"] if meta.flag else []
            if env_prefix is not None:
                names.append(f"`{env_name(env_prefix, f.name)}`")
            cells.append(", ".join(names) or "-")
        doc = meta.doc
        if meta.aliases:
            doc += f" (formerly {', '.join(f'`{a}`' for a in meta.aliases)}, still read)"
        default = default_text(f, meta) or ("required" if f.default is MISSING
                                            and f.default_factory is MISSING else "unset")
        cells += [default, doc.replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
