"""Flags derived from settings: each ``schemas.setting`` field becomes an argparse flag.

The name (``schemas.settings.flag_for``, or the setting's ``flag``), the type from the
annotation (``bool`` a switch, ``tuple[X, ...]`` a repeatable flag, ``X | None`` an X),
choices, metavar, the help with its default or environment variable, and the ``--help``
section (``group``). The dest is the key, so ``files.resolve`` reads flags, files and
overrides alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from agentarium.schemas import settings


def add_settings(parser: Any, *classes: type, prefix: str = "") -> None:
    """A flag for every setting of ``classes`` that has one, derived from its field: the
    name (``schemas.settings.flag_for``, or the setting's ``flag``), the type from the
    annotation (``bool`` a switch, ``tuple[X, ...]`` a repeatable flag, ``X | None`` an X),
    choices, metavar, the help with the default, and the ``--help`` section (``group``).
    The dest is the key, so ``resolve`` reads flags, files and overrides alike."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for klass in classes:
        for key in settings.keys(klass, prefix):
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
    if key.meta.negate and not key.meta.flag:  # a spelled flag is the switch itself (--eval)
        return ["--no-" + flag[2:]]
    return [flag]


def _flag_options(key: settings.Key) -> dict[str, Any]:
    meta, f = key.meta, key.field
    kind = _base(settings.type_hints(key.owner)[key.path[-1]])
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
    if meta.env:  # the variable applies where the flag is absent: no default here
        options["default"] = None
        help_text += f" (env {meta.env})"
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


def flag_values(args: argparse.Namespace, klass: type) -> dict[str, Any]:
    """The flat values of ``klass``'s flagged settings, read from ``args`` (a command without
    ``--config``: flags only; ``settings.build(klass, values)`` makes the instance)."""
    values = {key.name: getattr(args, key.name) for key in settings.keys(klass) if key.flag}
    # a flag left out of a field with a default factory reads None: the factory decides
    factories = {
        k.name for k in settings.keys(klass) if k.field.default_factory is not dataclasses.MISSING
    }
    values = {k: v for k, v in values.items() if not (v is None and k in factories)}
    # a repeated flag collects a list (Append); the field holds a tuple
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
