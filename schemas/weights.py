"""WeightUpdate, a published policy version stored as JSON in the policy KV, and WeightIdentity,
the name of the weights an engine serves.

An engine's ``weight_version`` string is the identity of what it serves: ``"default"`` for the
weights it started with (SGLang's initial value; every run's version 0), or
``"<run>@<version>:<checksum>"`` for a version a trainer published, the checksum being the first
16 hex digits of the published file's sha256 (the whole weights file, or the LoRA adapter's).
Run names never hold ``@`` or ``:``, so the string parses back unambiguously. Versions are
compared only within one run: another run's version 31 is not newer than this run's 7, it is
other weights.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import SchemaError
from .fields import FLOAT, INT, NAME, STR, WireMessage, spec
from .names import check_name

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


BASE = "default"  # the weight_version of an engine's initial weights (SGLang's own initial value)
CHECKSUM_CHARS = 16  # hex digits of the file's sha256 an identity carries
_IDENTITY = re.compile(r"([A-Za-z0-9_-]{1,128})@(0|[1-9][0-9]{0,17}):([0-9a-f]{16})")


@dataclass(frozen=True)
class WeightIdentity:
    """What an engine serves: run, version and content, or the base weights (``run`` None).

    ``str()`` is the ``weight_version`` string engines are given and report; ``parse`` reads it
    back (None for a string no trainer wrote: a server's own label, a bare number).
    """

    run: str | None
    version: int
    checksum: str = ""

    @classmethod
    def base(cls) -> WeightIdentity:
        return cls(None, 0, "")

    @classmethod
    def of(cls, update: WeightUpdate) -> WeightIdentity:
        """The identity of a published version: its run, its version, its file's sha256."""
        return cls.named(update.run, update.version, update.sha256)

    @classmethod
    def named(cls, run: str, version: int, sha256: str) -> WeightIdentity:
        """The identity of ``run``'s ``version`` whose file has this sha256 (64 hex digits)."""
        return cls(run, version, sha256[:CHECKSUM_CHARS])

    @classmethod
    def parse(cls, weight_version: str | None) -> WeightIdentity | None:
        if weight_version is None:
            return None
        if weight_version in ("", BASE):
            return cls.base()
        m = _IDENTITY.fullmatch(weight_version)
        if m is None:
            return None
        return cls(m.group(1), int(m.group(2)), m.group(3))

    def __post_init__(self) -> None:
        if self.run is None:
            if self.version != 0 or self.checksum:
                raise SchemaError("the base weights have version 0 and no checksum")
            return
        check_name(self.run, "run")
        if self.version < 0:
            raise SchemaError(f"weight identity version must be >= 0, got {self.version}")
        if not re.fullmatch(r"[0-9a-f]{16}", self.checksum):
            raise SchemaError(
                f"weight identity checksum must be {CHECKSUM_CHARS} lowercase hex digits, "
                f"got {self.checksum!r}"
            )

    def __str__(self) -> str:
        if self.run is None:
            return BASE
        return f"{self.run}@{self.version}:{self.checksum}"

    @property
    def is_base(self) -> bool:
        return self.run is None

    def version_in(self, run: str) -> int | None:
        """This identity's version as one of ``run``'s: 0 for the base weights, the version for
        the run's own, None for another run's weights."""
        if self.run is None:
            return 0
        return self.version if self.run == run else None


def run_version(weight_version: str | None, run: str) -> int | None:
    """An engine's ``weight_version`` as a version of ``run``: 0 for the base weights, the
    version for the run's own identity, None for anything else (another run's weights, a string
    no trainer wrote, an engine that did not answer). The one comparison of versions: it never
    crosses runs."""
    identity = WeightIdentity.parse(weight_version)
    return None if identity is None else identity.version_in(run)


def versions_label(versions: Iterable[str]) -> str:
    """Weight versions as people read them: ``default`` (the base weights), ``A@3`` (run A's
    version 3; the checksum left out), ``A@3..A@5`` for several of one run, runs apart joined
    by "," (no space: one cell of a table) and strings no trainer wrote shown as they are; ""
    for none."""
    base = False
    runs: dict[str, set[int]] = {}
    other: set[str] = set()
    for version in versions:
        identity = WeightIdentity.parse(version)
        if identity is None:
            other.add(version)
        elif identity.run is None:
            base = True
        else:
            runs.setdefault(identity.run, set()).add(identity.version)
    parts = [BASE] if base else []
    for run, numbers in sorted(runs.items()):
        low, high = min(numbers), max(numbers)
        parts.append(f"{run}@{low}" if low == high else f"{run}@{low}..{run}@{high}")
    return ",".join(parts + sorted(other))
