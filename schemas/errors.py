"""Errors raised while encoding or decoding wire messages.

SchemaError          a message does not match its contract (names the field)
└── DecodeError      the bytes are not msgpack/JSON at all (keeps the raw bytes)
"""

from __future__ import annotations


class SchemaError(ValueError):
    """A message breaks its wire contract; ``field`` names the offending field."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class DecodeError(SchemaError):
    """The payload could not be parsed as msgpack or JSON."""

    def __init__(self, message: str, *, raw: bytes) -> None:
        super().__init__(message)
        self.raw = raw
