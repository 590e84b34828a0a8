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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agentarium.schemas import settings

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
            for key in settings.keys(klass):
                assert key.name not in kinds, f"{key.name} is a key of two config classes"
                kinds[key.name] = settings.type_hints(key.owner)[key.path[-1]]
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
    # commands.common.Parser collects KEY=VALUE tokens placed between flags into this list too.
    parser.overrides_dest = "overrides"  # type: ignore[attr-defined]
    parser.set_defaults(config_flags=flags)


@dataclass(frozen=True)
class Resolved:
    """A command's settings after every source was applied."""

    values: dict[str, Any]
    sources: dict[str, str]  # key -> "file" | "flag" | "override", for keys not at a default
    file: str | None

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
            f"{flags[key][0]} (or {key}: VALUE in --config, or {key}=VALUE)"
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
        key = seconds_key(str(key), keys)
        if key in out:
            raise ConfigError(f"{path}: {key} is set twice (as {key} and {key[:-2]})")
        if key not in keys.types:
            nested = " (keys are flat: max_staleness: 2, not sections)" * isinstance(value, dict)
            raise unknown_key(key, keys, f"{path}", aliases, extra=nested)
        out[key] = _coerce_at(f"{path}: {key}", key, value, keys)
    return out


def seconds_key(key: str, keys: ConfigKeys) -> str:
    """A duration's key as its flag spells it (``ack_wait`` for ``ack_wait_s``, since the flag
    is ``--ack-wait``), or ``key`` as it is."""
    if key not in keys.types and f"{key}_s" in keys.types:
        return f"{key}_s"
    return key


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
    key = seconds_key(key, keys)
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
        return settings.coerce(value, keys.types[key])
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {key} must be {exc}, got {value!r}") from None
