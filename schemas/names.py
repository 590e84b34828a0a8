"""Names that become NATS subject tokens or KV keys: agents, runs, job ids."""

from __future__ import annotations

import re

from .errors import SchemaError

_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")


def check_name(value: object, what: str) -> str:
    """Return ``value`` if it is a safe subject token, else raise SchemaError.

    A ``.``, ``*``, ``>`` or space would silently re-route messages, so only
    ``[A-Za-z0-9_-]`` (1 to 128 characters) is accepted.
    """
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise SchemaError(
            f"{what} {value!r} is not a valid name: use 1-128 characters from "
            "[A-Za-z0-9_-] (a '.', '*', '>' or space would re-route NATS subjects)",
            field=what,
        )
    return value
