"""JSON Schema export of the wire messages, for producers and readers in other languages.

A schema describes the message's JSON encoding exactly; its ``x-encodings`` says how the
msgpack encoding differs (``x-msgpack`` on the packed arrays: dtype, byte order, item size).

python -m agentarium.schemas.jsonschema          write schemas/json/*.schema.json
python -m agentarium.schemas.jsonschema --check  exit 1 if the checked-in files are stale
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from .codec import JSON_CONTENT_TYPE, MSGPACK_CONTENT_TYPE
from .deadletter import DeadLetter
from .demand import GroupDemand, GroupSupply
from .env import EnvCall, EnvError, EnvStart, EnvStarted, EnvWorkerStats, SessionOutcome, StepResult
from .fields import SCHEMA_VERSION, WireMessage
from .job import Job
from .trajectory import Trajectory
from .weights import WeightUpdate

OUT_DIR = Path(__file__).parent / "json"
# Every message says its encoding in its Content-Type header; this schema is the JSON one,
# and the msgpack one differs only where a property carries ``x-msgpack``.
ENCODINGS_DOC = {
    JSON_CONTENT_TYPE: "this schema as it is",
    MSGPACK_CONTENT_TYPE: "a msgpack map holding the same keys and values, except that a "
    "property with an x-msgpack annotation is a msgpack bin of packed values of that dtype "
    "and byte order (itemsize bytes each) instead of an array",
}
EXPORTED = {
    "job": Job,
    "trajectory": Trajectory,
    "weight_update": WeightUpdate,
    "dead_letter": DeadLetter,
    "env_start": EnvStart,
    "env_started": EnvStarted,
    "env_call": EnvCall,
    "env_step_result": StepResult,
    "env_outcome": SessionOutcome,
    "env_error": EnvError,
    "env_worker_stats": EnvWorkerStats,
    "group_demand": GroupDemand,
    "group_supply": GroupSupply,
}


def _object_schema(cls: type[WireMessage], defs: dict[str, Any]) -> dict[str, Any]:
    props: dict[str, Any] = {
        "schema_version": {
            "type": "integer",
            "maximum": SCHEMA_VERSION,
            "description": f"wire format version; optional, {SCHEMA_VERSION} if absent",
        }
    }
    required = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # every WireMessage is a dataclass
        kind = f.metadata["kind"]
        schema = {k: v for k, v in kind.json_schema.items() if k != "x-nested"}
        nested = kind.json_schema.get("x-nested")
        if nested is not None and nested.__name__ not in defs:
            defs[nested.__name__] = {}  # reserve the name before recursing
            defs[nested.__name__] = _object_schema(nested, defs)
        encoded = schema.get("description")  # how the kind travels in each encoding
        schema["description"] = f"{f.metadata['doc']}; {encoded}" if encoded else f.metadata["doc"]
        if f.default is not dataclasses.MISSING and isinstance(
            f.default, (str, int, float, bool, type(None), tuple)
        ):
            schema["default"] = list(f.default) if isinstance(f.default, tuple) else f.default
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
        props[f.name] = schema
    out = {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": True,
    }
    if cls.WIRE_DOC:
        out["description"] = cls.WIRE_DOC
    return out


def schema_for(cls: type[WireMessage]) -> dict[str, Any]:
    defs: dict[str, Any] = {}
    body = _object_schema(cls, defs)
    doc = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://agentarium.dev/schemas/v{SCHEMA_VERSION}/{cls.__name__}.json",
        "title": cls.__name__,
        **body,
        "x-encodings": ENCODINGS_DOC,
    }
    if defs:
        doc["$defs"] = defs
    return doc


def render_all() -> dict[str, str]:
    return {
        f"{name}.schema.json": json.dumps(schema_for(cls), indent=2, sort_keys=False) + "\n"
        for name, cls in EXPORTED.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="fail if the files on disk are out of date"
    )
    args = parser.parse_args(argv)
    stale = []
    for name, text in render_all().items():
        path = OUT_DIR / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            OUT_DIR.mkdir(exist_ok=True)
            path.write_text(text)
    if stale:
        print(
            f"stale JSON Schema files: {stale}; run python -m agentarium.schemas.jsonschema",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
