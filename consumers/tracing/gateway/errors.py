"""GatewayError: a request the gateway refuses or could not serve, in each API's own shape.

One exception carries what went wrong as a kind; each API renders it the way its clients parse
errors: OpenAI's ``{"error": {"message", "type", "param", "code"}}`` and Anthropic's
``{"type": "error", "error": {"type", "message"}}``, with the status that API uses for it. The
tracing client's errors are translated here once (``from_llm_error``), keeping the cause.
"""

from __future__ import annotations

from typing import Any, Literal

from aiohttp import web

from ...errors import BackendUnavailable, BadRequest, LLMError

Kind = Literal["invalid_request", "authentication", "not_found", "unavailable", "backend"]

# kind -> (HTTP status, OpenAI error type), and the same for Anthropic. Anthropic's clients back
# off on 529 overloaded_error, which is what an engine fleet that is down is.
_OPENAI: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "authentication": (401, "authentication_error"),
    "not_found": (404, "invalid_request_error"),
    "unavailable": (503, "server_error"),
    "backend": (502, "server_error"),
}
_ANTHROPIC: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "authentication": (401, "authentication_error"),
    "not_found": (404, "not_found_error"),
    "unavailable": (529, "overloaded_error"),
    "backend": (502, "api_error"),
}


class GatewayError(Exception):
    """What the gateway answers instead of a completion; ``param`` names the request field."""

    def __init__(
        self,
        message: str,
        *,
        kind: Kind = "invalid_request",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code

    @property
    def openai_status(self) -> int:
        return _OPENAI[self.kind][0]

    def openai_body(self) -> dict[str, Any]:
        return {
            "message": self.message,
            "type": _OPENAI[self.kind][1],
            "param": self.param,
            "code": self.code,
        }

    @property
    def anthropic_status(self) -> int:
        return _ANTHROPIC[self.kind][0]

    def anthropic_body(self) -> dict[str, Any]:
        return {
            "type": "error",
            "error": {"type": _ANTHROPIC[self.kind][1], "message": self.message},
        }


def openai_error(error: GatewayError) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if error.kind == "authentication" else None
    return web.json_response(
        {"error": error.openai_body()}, status=error.openai_status, headers=headers
    )


def anthropic_error(error: GatewayError) -> web.Response:
    return web.json_response(error.anthropic_body(), status=error.anthropic_status)


def from_llm_error(exc: Exception) -> GatewayError:
    """The tracing client's failure as the gateway answers it: the backend's 4xx and a bad
    sampling option are the request's fault (400), a fleet that is down is 503/529."""
    if isinstance(exc, BadRequest):
        return GatewayError(str(exc))
    if isinstance(exc, BackendUnavailable):
        return GatewayError(str(exc), kind="unavailable")
    if isinstance(exc, LLMError):
        return GatewayError(str(exc), kind="backend")
    return GatewayError(f"invalid request: {exc}")


def refuse_unknown(body: dict, known: frozenset[str], api: str) -> None:
    """Refuse the first field the gateway does not know: it may change the result, and
    dropping it silently would train on answers to another request."""
    unknown = sorted(key for key in body if key not in known)
    if unknown:
        raise GatewayError(
            f"{api} request field {unknown[0]!r} is not supported by the Agentarium gateway "
            "(it cannot tell whether it changes the reply): remove it",
            param=unknown[0],
        )


def refuse_set(body: dict, fields: dict[str, str]) -> None:
    """Refuse each field of ``fields`` that is set (not None, false or empty), with its reason."""
    for key, why in fields.items():
        if body.get(key) not in (None, False, [], {}):
            raise GatewayError(
                f"{key} is not supported by the Agentarium gateway: {why}", param=key
            )
