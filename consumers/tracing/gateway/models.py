"""Model listing: ``GET /v1/models`` and ``/v1/models/{id}`` in OpenAI's or Anthropic's shape.

Both APIs share the path; Anthropic's clients send ``anthropic-version`` on every request, so
that header picks Anthropic's shape. The one model is the rollout's policy, by its served name.
"""

from __future__ import annotations

from aiohttp import web

from .errors import GatewayError, anthropic_error, openai_error
from .route import Route

_EPOCH = "1970-01-01T00:00:00Z"


def is_anthropic(request: web.Request) -> bool:
    return "anthropic-version" in request.headers


def _openai_model(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "agentarium"}


def _anthropic_model(name: str) -> dict:
    return {"type": "model", "id": name, "display_name": name, "created_at": _EPOCH}


def listing(request: web.Request, route: Route) -> web.Response:
    name = route.llm.model_name
    if is_anthropic(request):
        body = {
            "data": [_anthropic_model(name)],
            "has_more": False,
            "first_id": name,
            "last_id": name,
        }
        return web.json_response(body)
    return web.json_response({"object": "list", "data": [_openai_model(name)]})


def one(request: web.Request, route: Route) -> web.Response:
    name, wanted = route.llm.model_name, request.match_info["model"]
    anthropic = is_anthropic(request)
    if wanted != name:
        error = GatewayError(
            f"model {wanted!r} not found: this rollout's policy is served as {name!r}",
            kind="not_found",
            param="model",
        )
        return anthropic_error(error) if anthropic else openai_error(error)
    return web.json_response(_anthropic_model(name) if anthropic else _openai_model(name))
