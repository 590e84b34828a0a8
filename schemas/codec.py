"""Bytes on the wire: msgpack by default, JSON accepted from outside.

JSON is recognised by ``Content-Type: application/json`` or a payload whose first
non-blank byte is ``{``; msgpack maps never start with that byte (0x7b is a positive
fixint, not a map), so the sniffing is unambiguous.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import msgpack

from .errors import DecodeError, SchemaError
from .fields import WireMessage

M = TypeVar("M", bound=WireMessage)

JSON_CONTENT_TYPE = "application/json"
MSGPACK_CONTENT_TYPE = "application/msgpack"


def encode(message: WireMessage) -> bytes:
    """msgpack bytes, with token arrays packed as int32 and logprobs as float32."""
    return msgpack.packb(message.to_wire(binary=True), use_bin_type=True)


def encode_json(message: WireMessage) -> bytes:
    return json.dumps(message.to_wire(binary=False), separators=(",", ":")).encode()


def is_json(payload: bytes, content_type: str | None = None) -> bool:
    if content_type:
        return content_type.split(";")[0].strip().lower() == JSON_CONTENT_TYPE
    return payload.lstrip()[:1] == b"{"


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
