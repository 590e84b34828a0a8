"""Bytes on the wire: msgpack or JSON, each message naming its own in ``Content-Type``.

Agentarium writes msgpack by default (token arrays packed as int32, logprobs as float32) and
JSON where a reader in another language asks for it (``Encoding``); every message it publishes
carries a ``Content-Type`` header built by ``Encoding.headers``, the one place headers get it.
Readers accept both: by the header, or, without one (a message from outside), JSON when the
payload's first non-blank byte is ``{``; msgpack maps never start with that byte (0x7b is a
positive fixint, not a map), so the sniffing is unambiguous.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import orjson

from .errors import DecodeError, SchemaError
from .fields import WireMessage

M = TypeVar("M", bound=WireMessage)

JSON_CONTENT_TYPE = "application/json"
MSGPACK_CONTENT_TYPE = "application/msgpack"
CONTENT_TYPE = "Content-Type"


@dataclass(frozen=True)
class Encoding:
    """One way a message travels: how it becomes bytes, and the header that says so."""

    name: str
    content_type: str

    def encode(self, message: WireMessage) -> bytes:
        return encode(message) if self is MSGPACK else encode_json(message)

    def headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The headers of a message in this encoding: ``Content-Type``, then ``extra``."""
        return {CONTENT_TYPE: self.content_type, **(extra or {})}


MSGPACK = Encoding("msgpack", MSGPACK_CONTENT_TYPE)
JSON = Encoding("json", JSON_CONTENT_TYPE)
ENCODINGS = {e.name: e for e in (MSGPACK, JSON)}


def encoding(name: str) -> Encoding:
    """The encoding called ``name`` (``msgpack`` or ``json``)."""
    try:
        return ENCODINGS[name]
    except KeyError:
        raise ValueError(f"unknown encoding {name!r}: use one of {', '.join(ENCODINGS)}") from None


def encode(message: WireMessage) -> bytes:
    """msgpack bytes, with token arrays packed as int32 and logprobs as float32."""
    return msgpack.packb(message.to_wire(binary=True), use_bin_type=True)


def encode_json(message: WireMessage) -> bytes:
    """JSON bytes (UTF-8, compact), token arrays and logprobs as plain lists. A non-finite
    number (a -inf logprob, a NaN metric), which JSON cannot write, is written as null."""
    return orjson.dumps(message.to_wire(binary=False), option=orjson.OPT_SERIALIZE_NUMPY)


def is_json(payload: bytes, content_type: str | None = None) -> bool:
    if content_type:
        return content_type.split(";")[0].strip().lower() == JSON_CONTENT_TYPE
    first = payload[:1]
    if first.isspace():  # only then copy: a msgpack payload starts with its map's byte
        first = payload.lstrip()[:1]
    return first == b"{"


def loads(payload: bytes, content_type: str | None = None) -> dict[str, Any]:
    """Parse bytes into a dict, raising DecodeError (with the raw bytes) on garbage."""
    kind = "JSON" if is_json(payload, content_type) else "msgpack"
    try:
        if kind == "JSON":
            data = json.loads(payload)
        else:
            data = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (RecursionError, msgpack.StackError) as exc:
        raise DecodeError(
            f"payload is not valid {kind}: nested too deeply", raw=bytes(payload)
        ) from exc
    # TypeError: msgpack holding a map keyed by a list or a map (unhashable in Python)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
        detail = str(exc) or type(exc).__name__
        raise DecodeError(f"payload is not valid {kind}: {detail}", raw=bytes(payload)) from exc
    if not isinstance(data, dict):
        raise DecodeError(
            f"payload must be an object/map, got {type(data).__name__}", raw=bytes(payload)
        )
    return data


def decode(
    cls: type[M], payload: bytes, content_type: str | None = None, *, strict: bool = False
) -> M:
    """Decode one message of type ``cls``; SchemaError names the bad field."""
    data = loads(payload, content_type)
    try:
        return cls.from_wire(data, strict=strict)
    except SchemaError:
        raise
    except Exception as exc:  # a reader bug must still surface as a bad message, not a crash
        raise SchemaError(f"{cls.__name__.lower()}: {exc}") from exc
