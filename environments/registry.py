"""Environment classes by name: the built-ins (``sql``, ``shell``) or ``module:Class``.

Built-ins are registered by module path and imported only when asked for, so a build without
one of them (or without what it needs) fails with a message naming it, not at import time.
"""

from __future__ import annotations

import importlib
from typing import Any

from agentarium.schemas import SchemaError, check_name

from .base import Environment

BUILTIN = {
    "sql": "agentarium.environments.sql:SqlEnvironment",
    "shell": "agentarium.environments.shell:ShellEnvironment",
}


class EnvironmentLoadError(ValueError):
    """An environment name or ``module:Class`` that cannot be served; the message says why."""


def load_environment(spec: str) -> type[Environment]:
    """The class ``spec`` names: a built-in name or ``module.path:Class``."""
    path = BUILTIN.get(spec, spec)
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise EnvironmentLoadError(
            f"environment {spec!r}: name a built-in ({', '.join(sorted(BUILTIN))}) or write "
            "module.path:Class"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if spec in BUILTIN:
            raise EnvironmentLoadError(
                f"the built-in environment {spec!r} is not available in this installation "
                f"({module_name} cannot be imported: {exc})"
            ) from exc
        raise EnvironmentLoadError(f"cannot import module {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise EnvironmentLoadError(f"module {module_name!r} has no attribute {attr!r}")
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        raise EnvironmentLoadError(
            f"{path} is not an environment: subclass environments.Environment"
        )
    return obj


def service_name(spec: str, cls: type[Environment], name: str | None = None) -> str:
    """The name it is served as: ``name``, else the built-in's, else ``cls.name``, else the
    class name in lower case; checked as a subject token."""
    chosen = name or (spec if spec in BUILTIN else "") or cls.name or cls.__name__.lower()
    try:
        return check_name(chosen, "environment name")
    except SchemaError as exc:
        raise EnvironmentLoadError(f"{exc}: pass --name NAME") from None
