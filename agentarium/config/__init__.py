"""A command's settings from its dataclasses: flags derived from the fields (``flags``), and
the values from defaults, a ``--config`` YAML file, flags and ``KEY=VALUE`` overrides
(``files``). The commands (``agentarium/commands/``) use it; it knows no command."""

from .files import (
    SOURCES,
    ConfigError,
    ConfigKeys,
    Resolved,
    Unset,
    add_config_arguments,
    parse_override,
    read_config_file,
    resolve,
    unknown_key,
)
from .flags import Append, add_settings, flag_values

__all__ = [
    "SOURCES",
    "Append",
    "ConfigError",
    "ConfigKeys",
    "Resolved",
    "Unset",
    "add_config_arguments",
    "add_settings",
    "flag_values",
    "parse_override",
    "read_config_file",
    "resolve",
    "unknown_key",
]
