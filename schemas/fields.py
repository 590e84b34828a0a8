"""Field kinds shared by every wire message: validation, coercion and JSON Schema.

A message class lists its fields once, as dataclass fields carrying a ``Kind`` in their
metadata; decoding, encoding and the exported JSON Schema are all derived from it, so the
three cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import settings
from .errors import SchemaError
from .names import check_name

SCHEMA_VERSION = 1

# What msgpack can carry: integers of 64 bits, and (with the dead letter and trajectory that
# wrap a job's task a few levels deeper) far less than its 511 levels of nesting.
INT64_MIN, INT64_MAX, UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1
MAX_DEPTH = 64


@dataclass(frozen=True)
class Kind:
    """How one field travels: its JSON Schema and how to read/write it."""

    json_schema: dict[str, Any]
    read: Callable[[Any, str], Any]
    write: Callable[[Any, bool], Any] = lambda value, binary: value


def _fail(path: str, expected: str, value: Any) -> SchemaError:
    try:
        shown = repr(value)
    except (RecursionError, ValueError):  # nested too deeply; an int of > 4,300 digits
        shown = f"<{type(value).__name__}>"
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return SchemaError(f"{path}: expected {expected}, got {shown}", field=path)


def _read_str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise _fail(path, "a string", value)
    if not _utf8(value):
        raise _fail(path, "a string of Unicode characters (no lone surrogates)", value)
    return value


def _utf8(text: str) -> bool:
    """Whether the text can be written as UTF-8 again: JSON's "\\ud800" escape decodes to a
    lone surrogate that no encoder (msgpack's, or JSON's to UTF-8) can write."""
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _read_opt_str(value: Any, path: str) -> str | None:
    return None if value is None else _read_str(value, path)


def _read_int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if not (isinstance(value, float) and value.is_integer()):
            raise _fail(path, "an integer", value)
        value = int(value)
    if not INT64_MIN <= value <= INT64_MAX:
        raise _fail(path, "an integer that fits in 64 bits", value)
    return value


def _read_float(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(path, "a number", value)
    try:
        return float(value)
    except OverflowError:  # an integer beyond any double
        raise _fail(path, "a number that fits in a double", value) from None


def _read_json_float(value: Any, path: str) -> float:
    """A number where JSON's null stands for a non-finite one (NaN, an infinity), which JSON
    cannot write: read as NaN."""
    return math.nan if value is None else _read_float(value, path)


def _read_opt_float(value: Any, path: str) -> float | None:
    return None if value is None else _read_float(value, path)


def _read_bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(path, "true or false", value)
    return value


def _read_dict(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise _fail(path, "an object", value)
    return value


def _read_object(value: Any, path: str) -> dict:
    """A JSON object: string keys, JSON values, integers msgpack can carry, at most
    ``MAX_DEPTH`` levels deep. Anything else would be accepted here and then fail where the
    job is stored again (its trajectory, its dead letter) or shown as JSON."""
    stack: list[tuple[Any, int]] = [(_read_dict(value, path), 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list, tuple)) and depth > MAX_DEPTH:
            raise SchemaError(f"{path}: nested deeper than {MAX_DEPTH} levels", field=path)
        if isinstance(item, dict):
            for key in item:
                if not isinstance(key, str) or not _utf8(key):
                    raise _fail(f"{path} (an object key)", "a string of Unicode characters", key)
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        elif isinstance(item, int) and not isinstance(item, bool):
            if not INT64_MIN <= item <= UINT64_MAX:
                raise _fail(f"{path} (a number in it)", "an integer that fits in 64 bits", item)
            continue
        elif isinstance(item, str):
            if not _utf8(item):
                raise _fail(path, "strings of Unicode characters (no lone surrogates)", item)
            continue
        elif item is None or isinstance(item, (float, bool)):
            continue
        else:
            raise _fail(
                path, "JSON values only (null, booleans, numbers, strings, lists, objects)", item
            )
        stack.extend((child, depth + 1) for child in children)
    return value


def _read_metrics(value: Any, path: str) -> dict[str, float]:
    out = {}
    for key, item in _read_dict(value, path).items():
        out[_read_str(key, f"{path} key")] = _read_json_float(item, f"{path}.{key}")
    return out


def _read_name(value: Any, path: str) -> str:
    return check_name(value, path)


def _read_str_list(value: Any, path: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)):
        raise _fail(path, "a list of strings", value)
    return tuple(_read_str(item, f"{path}[{i}]") for i, item in enumerate(value))


def _packed(dtype: str, what: str) -> Callable[[Any, str], list]:
    def read(value: Any, path: str) -> list:
        if isinstance(value, (bytes, bytearray, memoryview)):
            if len(value) % 4:
                raise _fail(path, f"packed {what} (a multiple of 4 bytes)", bytes(value))
            return np.frombuffer(value, dtype=dtype).tolist()
        if not isinstance(value, (list, tuple)):
            raise _fail(path, f"a list of {what}", value)
        fast = _plain_numbers(value, integers=dtype.endswith("i4"))
        if fast is not None:
            return fast
        if dtype.endswith("i4"):
            return [_read_int(item, f"{path}[{i}]") for i, item in enumerate(value)]
        return [_read_json_float(item, f"{path}[{i}]") for i, item in enumerate(value)]

    return read


def _plain_numbers(value: list | tuple, *, integers: bool) -> list | None:
    """A JSON list of plain numbers read in one numpy pass (a long call's ids, read item by item,
    cost milliseconds), or None for anything else (bools, nulls, huge integers, strings),
    which the item-by-item reader reports by index."""
    if not value:
        return []
    types = set(map(type, value))  # exact types: a bool is an int to numpy and isinstance
    if not types <= ({int} if integers else {int, float}):
        return None
    try:
        arr = np.asarray(value, dtype=np.int64 if integers else np.float64)
    except OverflowError:  # an integer beyond 64 bits
        return None
    return arr.tolist()


def _packed_write(dtype: str) -> Callable[[Any, bool], Any]:
    # array.array packs a short list faster than numpy does (a rollout's calls are short);
    # numpy arrays (and anything else) go through numpy, which also casts.
    typecode = "i" if dtype.endswith("i4") else "f"
    native = array(typecode).itemsize == 4 and sys.byteorder == "little"

    def write(value: Any, binary: bool) -> Any:
        if not binary:
            return list(value)
        if native and type(value) is list:
            try:
                return array(typecode, value).tobytes()
            except (TypeError, OverflowError):
                pass  # numpy scalars, or ints numpy would wrap: numpy decides, as before
        return np.asarray(value, dtype=dtype).tobytes()

    return write


STR = Kind({"type": "string"}, _read_str)
OPT_STR = Kind({"type": ["string", "null"]}, _read_opt_str)
NAME = Kind({"type": "string", "pattern": "^[A-Za-z0-9_-]{1,128}$"}, _read_name)
INT = Kind({"type": "integer"}, _read_int)
FLOAT = Kind({"type": "number"}, _read_float)
OPT_FLOAT = Kind({"type": ["number", "null"]}, _read_opt_float)
BOOL = Kind({"type": "boolean"}, _read_bool)
OBJECT = Kind({"type": "object"}, _read_object)
METRICS = Kind(
    {
        "type": "object",
        "additionalProperties": {"type": ["number", "null"]},
        "description": "null in JSON: a non-finite number, which JSON cannot write",
    },
    _read_metrics,
)
STR_LIST = Kind(
    {"type": "array", "items": {"type": "string"}},
    _read_str_list,
    lambda value, binary: list(value),
)
TOKENS = Kind(
    {
        "type": "array",
        "items": {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1},
        "x-msgpack": {"type": "bin", "dtype": "int32", "byteorder": "little", "itemsize": 4},
        "description": "in JSON a list of integers; in msgpack one bin of packed "
        "little-endian int32, 4 bytes per token id",
    },
    _packed("<i4", "token ids"),
    _packed_write("<i4"),
)
LOGPROBS = Kind(
    {
        "type": "array",
        "items": {"type": ["number", "null"]},
        "x-msgpack": {"type": "bin", "dtype": "float32", "byteorder": "little", "itemsize": 4},
        "description": "in JSON a list of numbers (null for a non-finite one, which JSON "
        "cannot write); in msgpack one bin of packed little-endian IEEE 754 float32, 4 bytes "
        "per value",
    },
    _packed("<f4", "log probabilities"),
    _packed_write("<f4"),
)


def spec(
    kind: Kind,
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    factory: Any = None,
    setting: dict[str, Any] | None = None,
) -> Any:
    """Declare a wire field: its kind, default (absent = required) and documentation.
    ``setting``: the field is a setting too (``schemas.settings``; ``doc`` is its help unless
    it says otherwise), so a message can be a settings section (``Sampling`` in
    ``producers.JobOptions``): the options of ``setting()``, e.g. ``{"metavar": "T"}``."""
    meta: dict[str, Any] = {"kind": kind, "doc": doc}
    if setting is not None:
        declared = settings.setting(default, **{"help": doc, **setting})
        meta[settings.META] = declared.metadata[settings.META]
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def nested(
    cls: type[WireMessage], *, many: bool = False, default: Any = dataclasses.MISSING, doc: str
) -> Any:
    """A field holding another wire message (or a list of them)."""

    def read(value: Any, path: str) -> Any:
        if many:
            if not isinstance(value, (list, tuple)):
                raise _fail(path, "a list", value)
            return [
                cls.from_wire(_read_dict(v, f"{path}[{i}]"), _path=f"{path}[{i}]")
                for i, v in enumerate(value)
            ]
        return cls.from_wire(_read_dict(value, path), _path=path)

    def write(value: Any, binary: bool) -> Any:
        if many:
            return [v.to_wire(binary=binary) for v in value]
        return value.to_wire(binary=binary)

    ref = {"$ref": f"#/$defs/{cls.__name__}"}
    kind = Kind({"type": "array", "items": ref} if many else ref, read, write)
    kind.json_schema["x-nested"] = cls  # type: ignore[index]
    meta = {"kind": kind, "doc": doc}
    if many:
        return dataclasses.field(default_factory=list, metadata=meta)
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=meta)
    return dataclasses.field(default_factory=default, metadata=meta)


class WireMessage:
    """Mixin for frozen dataclasses whose fields were declared with ``spec``/``nested``."""

    WIRE_DOC: str = ""

    def to_wire(self, *, binary: bool = True) -> dict[str, Any]:
        """A plain dict ready for msgpack (``binary``) or JSON (lists instead of bytes)."""
        out: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
        for name, _, write, _, _ in _plan(type(self)):
            value = getattr(self, name)
            out[name] = None if value is None else write(value, binary)
        return out

    @classmethod
    def from_wire(cls, data: dict[str, Any], *, strict: bool = False, _path: str = ""):
        """Build the message from a decoded dict.

        Lenient by default (unknown fields ignored, for forward compatibility); ``strict``
        rejects leftovers. Every error names the field it is about.
        """
        prefix = f"{_path}." if _path else f"{cls.__name__.lower()}."
        if not isinstance(data, dict):
            raise _fail(prefix.rstrip("."), "an object", data)
        version = data.get("schema_version", SCHEMA_VERSION)
        if version is not None and (
            isinstance(version, bool) or not isinstance(version, int) or version > SCHEMA_VERSION
        ):
            raise SchemaError(
                f"{prefix}schema_version {version!r} is newer than this Agentarium understands "
                f"({SCHEMA_VERSION}): upgrade the reader",
                field=f"{prefix}schema_version",
            )
        values: dict[str, Any] = {}
        for name, read, _, required, nullable in _plan(cls):
            value = data.get(name)
            if value is None and (not nullable or name not in data):
                if required:
                    path = prefix + name
                    raise SchemaError(f"{path}: required field missing", field=path)
                continue
            values[name] = read(value, prefix + name)
        if strict:
            known = {"schema_version", *(name for name, *_ in _plan(cls))}
            extra = sorted(set(data) - known)
            if extra:
                raise SchemaError(
                    f"{prefix.rstrip('.')}: unknown fields {extra}", field=prefix + extra[0]
                )
        try:
            return cls(**values)
        except SchemaError:
            raise
        except (TypeError, ValueError) as exc:
            raise SchemaError(f"{prefix.rstrip('.')}: {exc}") from exc


_Plan = tuple[tuple[str, Callable, Callable, bool, bool], ...]
_PLANS: dict[type, _Plan] = {}


def _plan(cls: type) -> _Plan:
    """Per wire class, once: each field's name, reader, writer, whether it is required and
    whether null is a value of it (decoding and encoding run per message, on the hot path)."""
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = _make_plan(cls)
    return plan


def _make_plan(cls: type) -> _Plan:
    return tuple(
        (
            f.name,
            f.metadata["kind"].read,
            f.metadata["kind"].write,
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            _nullable(f),
        )
        for f in dataclasses.fields(cls)
    )


def _nullable(f: dataclasses.Field) -> bool:
    kind_type = f.metadata["kind"].json_schema.get("type")
    return isinstance(kind_type, list) and "null" in kind_type


def finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)
