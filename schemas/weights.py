"""WeightUpdate: a published policy version, stored as JSON in the policy KV."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import SchemaError
from .fields import FLOAT, INT, NAME, STR, WireMessage, spec

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, kw_only=True)
class WeightUpdate(WireMessage):
    WIRE_DOC = (
        "A policy version published by the trainer (value of the agentarium-policy KV key <run>)."
    )

    run: str = spec(NAME, doc="run id")
    version: int = spec(INT, doc="policy version; engines get it as a decimal string")
    step: int = spec(INT, 0, doc="trainer step that produced it")
    object: str = spec(
        STR, doc="object store name (<run>/v<version>) or a path in shared-path mode"
    )
    sha256: str = spec(STR, doc="lowercase hex sha256 of the whole file")
    size: int = spec(INT, 0, doc="file size in bytes")
    format: str = spec(STR, "safetensors", doc="file format")
    created_at: float = spec(FLOAT, 0.0, doc="unix time of publication")

    def __post_init__(self) -> None:
        if self.version < 0:
            raise SchemaError("weightupdate.version must be >= 0", field="weightupdate.version")
        if not _SHA256.fullmatch(self.sha256):
            raise SchemaError(
                "weightupdate.sha256 must be 64 lowercase hex digits", field="weightupdate.sha256"
            )


def version_number(weight_version: str, *, other: int | None = None) -> int:
    """An engine's weight_version string as an int: "default" is 0, decimals are themselves.

    Any other string (a server's own "v1.2", a model hash: not a version a trainer published)
    raises, or is ``other`` when given (the trainer reads it as 0, the initial weights).
    """
    if weight_version in ("", "default"):
        return 0
    # digits only: int() would also take "-3", "+3", " 3" and "1_000"
    if not (weight_version.isascii() and weight_version.isdigit()):
        if other is not None:
            return other
        raise SchemaError(
            f"weight_version {weight_version!r} is not 'default' or a decimal integer >= 0"
        )
    return int(weight_version)
