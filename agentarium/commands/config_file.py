"""Config files: a command's settings from a YAML file, its flags and KEY=VALUE overrides.

Precedence, lowest first::

    the dataclass defaults  <  --config FILE  <  flags  <  KEY=VALUE overrides

Keys are the fields of the command's config dataclasses, flat and spelled as in Python
(``max_staleness``). Each flag's ``dest`` is its key, so ``--max-staleness 2``,
``max_staleness: 2`` in the file and ``max_staleness=2`` on the command line set the same
thing; a few keys have no flag (``ConfigKeys.flagless``, each with its reason) and a few
flags no key (``ConfigKeys.keyless``: the connection, which a config file must never hold).
Values are checked against the field's type: PyYAML reads ``3e-4`` as a string (YAML 1.1
wants a dot), so a number written as a string is converted, and anything else that does not
fit is refused with the key named. Unknown keys are refused with close matches suggested.

A command calls ``add_config_arguments`` after adding its flags, then ``resolve(args, keys)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from schemas import settings

from .common import add_metrics_flags, add_nats_flags

SOURCES = ("file", "flag", "override")  # what can set a key, lowest precedence first


class ConfigError(ValueError):
    """A config file, flag or override the command cannot use; the message says what to fix."""


class Unset:
    """A flag's default until ``resolve``: tells a flag left out from one given its default
    value, so a config file's value is not overwritten by a default nobody typed."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __str__(self) -> str:  # what %(default)s shows in --help
        return str(self.value)

    def __repr__(self) -> str:
        return f"Unset({self.value!r})"


@dataclass(frozen=True, kw_only=True)
class ConfigKeys:
    """The keys a command's config file may hold, with their types and defaults."""

    command: str
    types: Mapping[str, Any]
    defaults: Mapping[str, Any]  # keys absent here and from factories are required
    factories: Mapping[str, Callable[[], Any]]
    flagless: Mapping[str, str]  # key -> why it has no flag
    keyless: Mapping[str, str]  # flag dest -> why it has no key

    @classmethod
    def of(
        cls,
        command: str,
        *classes: type,
        flagless: Mapping[str, str] | None = None,
        keyless: Mapping[str, str] | None = None,
    ) -> ConfigKeys:
        """The settings of ``classes`` (config dataclasses, sections flattened), in
        declaration order; a key's reason for having no flag comes from its ``setting()``."""
        kinds: dict[str, Any] = {}
        defaults: dict[str, Any] = {}
        factories: dict[str, Callable[[], Any]] = {}
        reasons: dict[str, str] = {}
        for klass in classes:
            for key in settings.keys(klass) if _declares(klass) else _plain_keys(klass):
                assert key.name not in kinds, f"{key.name} is a key of two config classes"
                kinds[key.name] = typing.get_type_hints(key.owner)[key.path[-1]]
                if key.field.default is not dataclasses.MISSING:
                    defaults[key.name] = key.field.default
                elif key.field.default_factory is not dataclasses.MISSING:
                    factories[key.name] = key.field.default_factory
                if key.meta.flagless is not None:
                    reasons[key.name] = key.meta.flagless
        return cls(
            command=command,
            types=kinds,
            defaults=defaults,
            factories=factories,
            flagless={**reasons, **(flagless or {})},
            keyless=dict(keyless or {}),
        )


def _declares(klass: type) -> bool:
    return any(settings.META in f.metadata for f in dataclasses.fields(klass))


def _plain_keys(klass: type) -> list[settings.Key]:
    """TRANSITION: the fields of a config class not yet declared with ``setting()``."""
    return [
        settings.Key(f.name, (f.name,), f, settings.Meta(help=""), klass)
        for f in dataclasses.fields(klass)
    ]


def connection_flags(reason: str | None = None) -> dict[str, str]:
    """The NATS connection flags as key-less flags, for ``ConfigKeys.keyless``."""
    reason = reason or (
        "the connection comes from AGENTARIUM_NATS_* or these flags, so a config file never "
        "holds a credential and the same file runs against any broker"
    )
    parser = argparse.ArgumentParser(add_help=False)
    add_nats_flags(parser)
    return {action.dest: reason for action in parser._actions}


def metrics_flags() -> dict[str, str]:
    """The metrics-server flags as key-less flags, for ``ConfigKeys.keyless``."""
    reason = (
        "where this process serves /metrics and probes belongs to its deployment (the "
        "manifest's ports), not to the run's settings"
    )
    parser = argparse.ArgumentParser(add_help=False)
    add_metrics_flags(parser)
    return {action.dest: reason for action in parser._actions}


def add_config_arguments(parser: argparse.ArgumentParser, keys: ConfigKeys) -> None:
    """``--config FILE`` and ``KEY=VALUE`` overrides; call it after every other flag is added.
    Flags of keys stop being required (the file may set them: ``resolve`` says what is
    missing) and their defaults become ``Unset`` until ``resolve``."""
    flags: dict[str, list[str]] = {}
    for action in parser._actions:
        if action.dest in keys.types and action.option_strings:
            flags[action.dest] = list(action.option_strings)
            if action.default is not None:
                action.default = Unset(action.default)
            action.required = False
    flagless = ", ".join(keys.flagless)
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="settings from a YAML file of key: value lines; a flag's key is its name with _ "
        "for - (--max-staleness 2 is max_staleness: 2). Precedence: defaults < this file < "
        "flags < KEY=VALUE overrides" + (f". Keys without a flag: {flagless}" if flagless else ""),
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides, applied last, e.g. lr=3e-4 (values read as YAML: null, true, "
        "[0.9, 0.95])",
    )
    # common.Parser collects KEY=VALUE tokens placed between flags into this list too.
    parser.overrides_dest = "overrides"  # type: ignore[attr-defined]
    parser.set_defaults(config_flags=flags)


@dataclass(frozen=True)
class Resolved:
    """A command's settings after every source was applied."""

    values: dict[str, Any]
    sources: dict[str, str]  # key -> "file" | "flag" | "override", for keys not at a default
    file: str | None

    def pick(self, klass: type) -> dict[str, Any]:
        """TRANSITION: the values of a not yet declared ``klass``'s fields."""
        return {f.name: self.values[f.name] for f in dataclasses.fields(klass)}

    def build(self, klass: type, **runtime: Any) -> Any:
        """``klass`` (a settings dataclass) from these values; ``runtime``: its fields that
        are not settings."""
        return settings.build(klass, self.values, **runtime)

    def describe(self) -> dict[str, Any]:
        """Where the settings came from, for the command's config log event."""
        return {"config_file": self.file, "set_by": dict(self.sources)}


def resolve(args: argparse.Namespace, keys: ConfigKeys) -> Resolved:
    """Defaults, then the --config file, then flags given, then KEY=VALUE overrides."""
    flags: Mapping[str, list[str]] = getattr(args, "config_flags", None) or {}
    aliases = {
        option.lstrip("-").replace("-", "_"): key
        for key, options in flags.items()
        for option in options
    }
    values = dict(keys.defaults)
    sources: dict[str, str] = {}
    path = getattr(args, "config", None)
    if path:
        for key, value in read_config_file(path, keys, aliases).items():
            values[key], sources[key] = value, "file"
    for key in keys.types:
        given = getattr(args, key, None)
        if given is not None and not isinstance(given, Unset):
            where = f"{flags.get(key, ['--' + key])[0]} {given!r}"
            values[key], sources[key] = _coerce_at(where, key, given, keys), "flag"
    for text in getattr(args, "overrides", None) or ():
        key, value = parse_override(text, keys, aliases)
        values[key], sources[key] = value, "override"
    for key, factory in keys.factories.items():
        if key not in values:
            values[key] = factory()
    missing = [key for key in keys.types if key not in values]
    if missing:
        asks = [
            f"{key} ({flags[key][0]} VALUE, {key}: VALUE in --config, or {key}=VALUE)"
            if key in flags
            else f"{key} ({key}: VALUE in --config, or {key}=VALUE)"
            for key in missing
        ]
        raise ConfigError(f"agentarium {keys.command} needs {'; '.join(asks)}")
    return Resolved(values=values, sources=sources, file=str(path) if path else None)


def read_config_file(
    path: str | Path, keys: ConfigKeys, aliases: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """A YAML mapping of known keys, each value checked against its type."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read --config {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or exc
        raise ConfigError(f"{where}: not valid YAML ({problem})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: a config file is a mapping of key: value lines, got a {type(data).__name__}"
        )
    out = {}
    for key, value in data.items():
        key = str(key)
        if key not in keys.types:
            nested = " (keys are flat: max_staleness: 2, not sections)" * isinstance(value, dict)
            raise unknown_key(key, keys, f"{path}", aliases, extra=nested)
        out[key] = _coerce_at(f"{path}: {key}", key, value, keys)
    return out


def parse_override(
    text: str, keys: ConfigKeys, aliases: Mapping[str, str] | None = None
) -> tuple[str, Any]:
    """``key=value``; the value is read as YAML (``null``, ``true``, ``[0.9, 0.95]``)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(
            f"override {text!r}: write KEY=VALUE, e.g. max_staleness=2 (keys as in --config)"
        )
    if key not in keys.types:
        raise unknown_key(key, keys, f"override {text!r}", aliases)
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # e.g. a URL with a colon and a space: the text as written
    return key, _coerce_at(f"override {text!r}", key, value, keys)


def unknown_key(
    key: str,
    keys: ConfigKeys,
    where: str,
    aliases: Mapping[str, str] | None = None,
    *,
    extra: str = "",
) -> ConfigError:
    """An error naming the closest keys (difflib), or the key of a flag spelled as a key."""
    normal = key.lstrip("-").replace("-", "_")
    message = f"{where}: unknown {keys.command} key {key!r}{extra}"
    flag_key = (aliases or {}).get(normal)
    if normal in keys.types:
        return ConfigError(f"{message}; did you mean {normal}?")
    if flag_key is not None:
        return ConfigError(f"{message}; the flag --{normal.replace('_', '-')} sets key {flag_key}")
    # verl's dotted names (actor_rollout_ref.actor.optim.lr) end in the key they mean
    close = difflib.get_close_matches(normal.rsplit(".", 1)[-1], list(keys.types), n=3, cutoff=0.6)
    if close:
        return ConfigError(f"{message}; did you mean {' or '.join(close)}?")
    return ConfigError(
        f"{message}; `agentarium {keys.command} --help` lists the flags: a flag's key is its "
        "name with _ for -"
    )


def _coerce_at(where: str, key: str, value: Any, keys: ConfigKeys) -> Any:
    try:
        return coerce(value, keys.types[key])
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {key} must be {exc}, got {value!r}") from None


def coerce(value: Any, kind: Any) -> Any:
    """``value`` as ``kind`` (bool, int, float, str, Path, X | None, tuple[X, ...], Any); raises
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


def add_settings(parser: argparse.ArgumentParser, *classes: type) -> None:
    """A flag for every setting of ``classes`` that has one, derived from its field: the
    name (``schemas.settings.flag_for``, or the setting's ``flag``), the type from the
    annotation (``bool`` a switch, ``tuple[X, ...]`` a repeatable flag, ``X | None`` an X),
    choices, metavar, the help with the default, and the ``--help`` section (``group``).
    The dest is the key, so ``resolve`` reads flags, files and overrides alike."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for klass in classes:
        for key in settings.keys(klass):
            if key.flag is None:
                continue
            meta = key.meta
            target: Any = parser
            if meta.group:
                if meta.group not in groups:
                    groups[meta.group] = parser.add_argument_group(meta.group)
                target = groups[meta.group]
            target.add_argument(*_flag_names(key), **_flag_options(key))


def _flag_names(key: settings.Key) -> list[str]:
    flag = key.flag
    assert flag is not None
    if key.meta.negate:
        return ["--no-" + flag[2:]]
    return [flag]


def _flag_options(key: settings.Key) -> dict[str, Any]:
    meta, f = key.meta, key.field
    kind = _base(typing.get_type_hints(key.owner)[key.path[-1]])
    default = f.default if f.default is not dataclasses.MISSING else None
    options: dict[str, Any] = {"dest": key.name, "default": default}
    if key.required:
        options["required"] = True
    help_text = meta.help
    if kind is bool:
        options["action"] = "store_false" if meta.negate else "store_true"
        options["default"] = default if isinstance(default, bool) else False
        options["help"] = help_text
        return options
    if meta.metavar:
        options["metavar"] = meta.metavar
    elif key.name.endswith("_s") and kind is float:
        options["metavar"] = "SECONDS"
    elif kind is int:
        options["metavar"] = "N"
    if meta.choices is not None:
        options["choices"] = list(meta.choices)
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        options["action"] = Append
        options["type"] = meta.parse or _base(args[0])
        options["default"] = default if default is not None else ()
    elif origin is tuple:
        options["nargs"] = len(args)
        options["type"] = meta.parse or _base(args[0])
    else:
        options["type"] = meta.parse or (kind if kind in (int, float, str) else str)
    shown = options["default"]
    if shown not in (None, (), "") and "default" not in help_text:
        help_text += " (default %(default)s)"
    options["help"] = help_text
    return options


def _base(kind: Any) -> Any:
    """``X | None`` -> ``X``."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(inner) == 1:
            return inner[0]
    return kind


class Append(argparse.Action):
    """``append`` whose default is not a list (a tuple, wrapped in ``Unset`` until
    ``resolve``): the first use starts a fresh list instead of adding to the default."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[no-untyped-def]
        current = getattr(namespace, self.dest, None)
        items = list(current) if isinstance(current, list) else []
        setattr(namespace, self.dest, [*items, values])
