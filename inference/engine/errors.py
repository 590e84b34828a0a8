"""Errors of the local engine, grouped by what the caller should do.

EngineError          root of everything the local engine raises on purpose
├── InvalidRequest   the request itself is wrong (HTTP 400): fix it, do not retry it
└── WeightLoadError  new weights could not be loaded; the old ones stay in place
"""

from __future__ import annotations


class EngineError(Exception):
    """Root of the local engine's errors."""


class InvalidRequest(EngineError):
    """A request the engine refuses; the message says what to change."""


class WeightLoadError(EngineError):
    """Weights could not be loaded (missing files, another architecture, other shapes)."""
