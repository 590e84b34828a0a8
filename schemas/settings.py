"""Settings: how a component declares what can be set, once, on its frozen config dataclass.

A setting is a dataclass field made by ``setting(...)``: its default, its help text, its
flag's spelling where the rule below does not give it, its choices and its bounds. Everything
else is derived from the field: the command-line flag, the ``--config`` file key (the field's
name), the help line, the check. ``agentarium/config/`` turns fields into
argparse flags; a component calls ``check_settings(self)`` in ``__post_init__``. Not a wire
contract, but it lives here because every component may import ``schemas`` and none may
import another.

The flag of a field is ``--`` and its name with ``-`` for ``_``, less a trailing ``_s`` (a
duration in seconds: ``ack_wait_s`` is ``--ack-wait SECONDS``). A field whose type is itself a
settings dataclass is a section: its settings are flattened into the parent's, each named
with the section's ``prefix`` (``fleet: FleetConfig = section(prefix="fleet_")`` gives
``fleet_outage_limit_s`` and ``--fleet-outage-limit``), so files stay flat.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

META = "agentarium.setting"

MISSING: Any = dataclasses.MISSING


class SettingError(ValueError):
    """A setting's value is outside what it accepts; the message names its flag."""


@dataclass(frozen=True, kw_only=True)
class Meta:
    """What ``setting()`` records beside the default."""

    help: str
    flag: str | None = None  # None: derived from the key (flag_for)
    metavar: str | None = None
    choices: Sequence[Any] | None = None
    ge: float | None = None  # the value must be >= this (None: no bound)
    gt: float | None = None  # the value must be > this
    le: float | None = None  # the value must be <= this
    flagless: str | None = None  # a key without a flag: why
    group: str | None = None  # the --help section
    parse: Callable[[str], Any] | None = None  # the flag's text -> value, when type() is wrong
    negate: bool = False  # a bool whose default is true: --no-<flag> (or flag=) turns it off
    env: str | None = None  # an environment variable that sets it when the flag is absent


@dataclass(frozen=True, kw_only=True)
class SectionMeta:
    """A field holding another settings dataclass, its keys named with ``prefix``."""

    prefix: str = ""
    # parent key -> the section's field, for a setting the parent calls otherwise
    # (``retry_delay_s`` for the delivery policy's ``base_delay_s``)
    rename: tuple[tuple[str, str], ...] = ()


def setting(
    default: Any = MISSING,
    *,
    help: str = "",
    factory: Callable[[], Any] | None = None,
    flag: str | None = None,
    metavar: str | None = None,
    choices: Sequence[Any] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    flagless: str | None = None,
    group: str | None = None,
    parse: Callable[[str], Any] | None = None,
    negate: bool = False,
    env: str | None = None,
) -> Any:
    """A settings field. ``help`` is the flag's help (the default is appended to it);
    ``flagless`` says why a key has no flag; ``ge``/``gt``/``le`` and ``choices`` are checked
    by ``check_settings``."""
    if not help and flagless is None:
        raise TypeError("a setting with a flag needs its help text (or flagless=why)")
    meta = Meta(
        help=help,
        flag=flag,
        metavar=metavar,
        choices=tuple(choices) if choices is not None else None,
        ge=ge,
        gt=gt,
        le=le,
        flagless=flagless,
        group=group,
        parse=parse,
        negate=negate,
        env=env,
    )
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={META: meta})
    return dataclasses.field(default=default, metadata={META: meta})


def section(klass: type, *, prefix: str = "", rename: dict[str, str] | None = None) -> Any:
    """A field holding the settings dataclass ``klass`` (its defaults), flattened into the
    parent's keys with ``prefix``."""
    meta = SectionMeta(prefix=prefix, rename=tuple((rename or {}).items()))
    return dataclasses.field(default_factory=klass, metadata={META: meta})


def flag_for(key: str) -> str:
    """``ack_wait_s`` -> ``--ack-wait``: the flag a key gets unless its setting names one."""
    name = key[:-2] if key.endswith("_s") else key
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Key:
    """One flat key of a settings class: where it lives (``path``, fields from the top) and
    what ``setting()`` said of it."""

    name: str
    path: tuple[str, ...]
    field: dataclasses.Field
    meta: Meta
    owner: type

    @property
    def flag(self) -> str | None:
        if self.meta.flagless is not None:
            return None
        return self.meta.flag or flag_for(self.name)

    @property
    def required(self) -> bool:
        return (
            self.field.default is dataclasses.MISSING
            and self.field.default_factory is dataclasses.MISSING
        )


def keys(klass: type, prefix: str = "", path: tuple[str, ...] = ()) -> Iterator[Key]:
    """Every setting of ``klass``, sections flattened, in declaration order. A field made
    without ``setting()`` or ``section()`` is not a setting (e.g. a runtime object)."""
    for f in dataclasses.fields(klass):
        meta = f.metadata.get(META)
        if isinstance(meta, SectionMeta):
            renamed = {inner: outer for outer, inner in meta.rename}
            for key in keys(_field_class(klass, f), prefix + meta.prefix, (*path, f.name)):
                if len(key.path) == len(path) + 2 and key.path[-1] in renamed:
                    key = dataclasses.replace(key, name=renamed[key.path[-1]])
                yield key
        elif isinstance(meta, Meta):
            yield Key(prefix + f.name, (*path, f.name), f, meta, klass)


def shared(klass: type, name: str) -> Any:
    """``klass``'s own declaration of the setting ``name`` (default, bounds, help, flag), as a
    field of another settings class: where two classes hold the same setting (eval's
    consumer is a consumer; the orchestrator's jobs are jobs) it has one default, not two."""
    found = [k for k in keys(klass) if k.name == name]
    if not found:
        raise TypeError(f"{klass.__name__} has no setting {name!r}")
    f = found[0].field
    return dataclasses.field(
        default=f.default, default_factory=f.default_factory, metadata=f.metadata
    )


@functools.cache
def type_hints(klass: type) -> types.MappingProxyType[str, Any]:
    """``typing.get_type_hints(klass)``, read-only and worked out once a class: it evaluates
    every annotation of the class's hierarchy anew on each call, and the command line's parser
    asks it once for each of its hundreds of flags (bench/cli_parser.py: a parser build's CPU
    with and without this cache)."""
    return types.MappingProxyType(typing.get_type_hints(klass))


def _field_class(klass: type, f: dataclasses.Field) -> type:
    hint = type_hints(klass)[f.name]
    if not dataclasses.is_dataclass(hint):
        raise TypeError(f"{klass.__name__}.{f.name}: a section's type must be a dataclass")
    return hint  # type: ignore[return-value]


def build(klass: type, values: dict[str, Any], **runtime: Any) -> Any:
    """``klass`` from flat ``values`` (key -> value; keys left out keep their defaults), its
    sections built first; ``runtime``: fields that are not settings (objects, callables)."""
    paths = {k.path: values[k.name] for k in keys(klass) if k.name in values}
    try:
        return _from_paths(klass, paths, runtime)
    except ValueError as exc:  # a check in a class's own __post_init__, or the wire's
        named = _with_flags(str(exc), klass)
        if named == str(exc):
            raise
        exc.args = (named, *exc.args[1:])  # the same error (type, field), in the user's words
        raise


def _with_flags(message: str, klass: type) -> str:
    """``message`` with the keys it names (``group_size``, ``deadline_s``,
    ``sampling.temperature``; a plain word such as ``port`` only where the message starts
    with it) replaced by their flags."""
    names: dict[str, str] = {}
    for key in keys(klass):
        if key.flag is None:
            continue
        for name in (".".join(key.path), key.name, key.path[-1]):
            names.setdefault(name, key.flag)
    for name in sorted(names, key=len, reverse=True):
        flag = names[name]
        if "_" in name or "." in name:
            message = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", flag, message)
        elif message.startswith(f"{name} "):
            message = flag + message[len(name) :]
    return message


def _from_paths(
    klass: type, values: dict[tuple[str, ...], Any], runtime: dict[str, Any] | None = None
) -> Any:
    kwargs: dict[str, Any] = dict(runtime or {})
    for f in dataclasses.fields(klass):
        meta = f.metadata.get(META)
        if isinstance(meta, SectionMeta):
            inner = {p[1:]: v for p, v in values.items() if p[0] == f.name}
            try:
                kwargs[f.name] = _from_paths(_field_class(klass, f), inner)
            except ValueError as exc:
                exc.args = (_as_outer(str(exc), klass, f), *exc.args[1:])
                raise
        elif (f.name,) in values:
            kwargs[f.name] = values[(f.name,)]
    return klass(**kwargs)


def _as_outer(message: str, klass: type, section_field: dataclasses.Field) -> str:
    """A section's error in the words of the command around it: the section's own flags and
    keys (``--kill-grace``, ``base_delay_s``) become the flags the user has
    (``--program-kill-grace``, ``--retry-delay``)."""
    names: dict[str, str] = {}
    for key in keys(klass):
        if key.path[0] != section_field.name or key.flag is None:
            continue
        own = key.meta.flag or flag_for(key.path[-1])
        names[own] = names[key.path[-1]] = key.flag
    for own in sorted(names, key=len, reverse=True):
        # also a dotted name the section's own checks use (sampling.temperature)
        pattern = rf"(?<![\w.-])(?:[a-z_]+\.)?{re.escape(own)}(?![\w-])"
        message = re.sub(pattern, names[own], message)
    return message


def flatten(config: Any) -> dict[str, Any]:
    """The flat key -> value mapping of a settings instance (its config log event, the
    config.yaml a trainer writes)."""
    out = {}
    for key in keys(type(config)):
        value = config
        for name in key.path:
            value = getattr(value, name)
        out[key.name] = value
    return out


def check_settings(config: Any) -> None:
    """The bounds and choices ``setting()`` declared on ``config``'s own fields (sections
    check themselves), each failure naming the flag (or key) to fix."""
    for f in dataclasses.fields(config):
        meta = f.metadata.get(META)
        if not isinstance(meta, Meta):
            continue
        value = getattr(config, f.name)
        name = meta.flag or (f.name if meta.flagless is not None else flag_for(f.name))
        for item in value if isinstance(value, tuple) else (value,):
            _check_one(name, item, meta)


def _check_one(name: str, value: Any, meta: Meta) -> None:
    if value is None:
        return
    if meta.choices is not None and value not in meta.choices:
        raise SettingError(
            f"{name} must be one of {', '.join(map(str, meta.choices))}, got {value!r}"
        )
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if isinstance(value, float) and math.isnan(value):
        raise SettingError(f"{name} must be a number, got nan")
    if meta.ge is not None and value < meta.ge:
        raise SettingError(f"{name} must be >= {_num(meta.ge)}, got {_num(value)}")
    if meta.gt is not None and value <= meta.gt:
        raise SettingError(f"{name} must be > {_num(meta.gt)}, got {_num(value)}")
    if meta.le is not None and value > meta.le:
        raise SettingError(f"{name} must be <= {_num(meta.le)}, got {_num(value)}")


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else str(value)


def coerce(value: Any, kind: Any) -> Any:
    """``value`` as ``kind`` (bool, int, float, str, X | None, tuple[X, ...], Any); raises
    ValueError whose message is what ``kind`` accepts."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for option in inner:
            try:
                return coerce(value, option)
            except (TypeError, ValueError):
                continue
        raise ValueError(" or ".join(_describe(a) for a in args))
    if origin is tuple:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ValueError(_describe(kind))
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0]) for v in items)
        if len(items) != len(args):
            raise ValueError(_describe(kind))
        return tuple(coerce(v, a) for v, a in zip(items, args, strict=True))
    if kind is Any:
        return value
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # "3e-4": YAML 1.1 reads it as a string
            except ValueError:
                pass
    elif kind is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # run: 2024 is the run "2024"
    elif kind is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
    raise ValueError(_describe(kind))


def _describe(kind: Any) -> str:
    if kind is type(None):
        return "null"
    if typing.get_origin(kind) is tuple:
        args = typing.get_args(kind)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_describe(args[0])}"
        return f"a list of {len(args)} values ({', '.join(_describe(a) for a in args)})"
    names = {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        Path: "a path",
    }
    return names.get(kind, str(kind))
