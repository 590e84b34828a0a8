"""Error texts fit for a log line: credentials masked, cut short.

Logs travel further than the trajectory or dead letter that keep an error's full text, so
what they show of an error is its last line with any credential it may carry masked.
"""

from __future__ import annotations

import re

# Credentials an error text may carry: in a URL (user:password@host, ?api_key=...) or in an
# echoed header.
_URL_USERINFO = re.compile(r"(?<=://)[^/\s@]+@")
_SECRET_PARAM = re.compile(
    r"(?i)\b((?:api[_-]?key|access[_-]?token|token|secret|password|passwd|auth)=)[^&\s'\"]+"
)
_BEARER = re.compile(r"(?i)\b(bearer\s+)[^\s'\"]+")
# A tracing proxy endpoint's per-rollout secret (consumers/tracing/proxy.py: .../r/<secret>/v1).
_PROXY_SECRET = re.compile(r"(/r/)[A-Za-z0-9_-]{16,}")
LOG_ERROR_CHARS = 300


def log_safe(error: str, limit: int = LOG_ERROR_CHARS) -> str:
    """An error text fit for one log line: its last line (a traceback's names the exception),
    credentials masked, cut to ``limit`` characters."""
    lines = error.strip().splitlines()
    line = lines[-1].strip() if lines else ""
    line = _URL_USERINFO.sub("***@", line)
    line = _SECRET_PARAM.sub(r"\1***", line)
    line = _BEARER.sub(r"\1***", line)
    line = _PROXY_SECRET.sub(r"\1***", line)
    return line if len(line) <= limit else line[: limit - 1] + "…"
