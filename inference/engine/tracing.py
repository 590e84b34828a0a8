"""The local engine's spans: each request's server span continuing the caller's ``traceparent``,
its phases (queue, prefill, decode) and the stalls a weight update or a pause put it through.

A request's phases are timed by the scheduler as plain ``time.time_ns()`` stamps on its
``Sequence`` (a few per request, none per token) and turned into spans once the request is
over, under its server span: the scheduler's loop never touches the tracer, and with tracing
off (no exporter: the server span does not record) nothing but the stamps is done.

    POST /generate                (SERVER, continues the caller's traceparent)
      engine.queue                arrival -> admitted to a step
      engine.prefill              the prefill pass that computed its prompt (again after a retract)
      engine.decode               end of the first prefill -> last token
      engine.stalled              a weight update or pause it waited through, linked to the
                                  update's engine.weight_update span (POST /update_weights_*)

Control routes get a server span too (``POST /update_weights_from_disk`` and the rest), and a
weight update an ``engine.weight_update`` span under it, from the moment it holds new requests
back to the swap's end. GET routes (health probes, /metrics, /model_info) are not traced: a
probe every few seconds would be a trace of its own each time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode

from agentarium.broker import CurrentSpan, extract_context

from .sequence import Sequence

tracer = trace.get_tracer("agentarium.engine")


@dataclass(frozen=True, slots=True)
class Stall:
    """A stretch of time a request spent held by a weight update or a pause."""

    what: str  # "weight update" | "paused"
    start_ns: int
    end_ns: int
    cause: SpanContext | None = None  # the engine.weight_update span, when there is one


def stall_everyone(seqs: list[Sequence], stall: Stall) -> None:
    """Record ``stall`` on every request in flight, clipped to each one's arrival."""
    for seq in seqs:
        start = max(stall.start_ns, seq.arrived_ns)
        if start < stall.end_ns:
            seq.stalls.append(Stall(stall.what, start, stall.end_ns, stall.cause))


@web.middleware
async def traced(request: web.Request, handler) -> web.StreamResponse:
    """A SERVER span per POST/PUT request, continuing the ``traceparent`` it carries."""
    if request.method == "GET":
        return await handler(request)
    route = request.match_info.route.resource
    path = route.canonical if route is not None else request.path
    parent = extract_context(request.headers) if "traceparent" in request.headers else None
    with CurrentSpan(
        tracer,
        f"{request.method} {path}",
        context=parent,
        kind=SpanKind.SERVER,
        attributes={"http.request.method": request.method, "http.route": path},
    ) as span:
        response = await handler(request)
        if span.is_recording():
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 500:
                span.set_status(Status(StatusCode.ERROR))
        return response


def record_request(seq: Sequence, response: dict) -> None:
    """The finished request's phases as child spans of the current span (its server span),
    and what it was and how it ended as that span's attributes."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    meta = response["meta_info"]
    finish = meta.get("finish_reason") or {}
    stalled_ns = sum(s.end_ns - s.start_ns for s in seq.stalls)
    span.set_attributes(
        {
            "agentarium.engine.rid": seq.rid,
            "agentarium.engine.finish_reason": str(finish.get("type", "")),
            "agentarium.engine.prompt_tokens": meta["prompt_tokens"],
            "agentarium.engine.completion_tokens": meta["completion_tokens"],
            "agentarium.engine.cached_tokens": meta["cached_tokens"],
            "agentarium.engine.weight_version": str(meta["weight_version"]),
            "agentarium.engine.stalls": len(seq.stalls),
            "agentarium.engine.stalled_s": stalled_ns / 1e9,
        }
    )
    end = seq.finished_ns or time.time_ns()
    _child("engine.queue", seq.arrived_ns, seq.admitted_ns or end)
    for i, (start, stop) in enumerate(seq.prefills):
        _child(
            "engine.prefill",
            start,
            stop,
            {
                "agentarium.engine.batch_size": seq.prefill_batch,
                "agentarium.engine.prompt_tokens": meta["prompt_tokens"],
                "agentarium.engine.cached_tokens": meta["cached_tokens"],
                "agentarium.engine.recomputed": i > 0,  # a retracted row's prompt again
            },
        )
    if seq.prefills:
        _child(
            "engine.decode",
            seq.prefills[0][1],
            end,
            {"agentarium.engine.completion_tokens": meta["completion_tokens"]},
        )
    for stall in seq.stalls:
        _child(
            "engine.stalled",
            stall.start_ns,
            stall.end_ns,
            {"agentarium.engine.stall": stall.what},
            links=[Link(stall.cause)] if stall.cause is not None else None,
        )


def _child(
    name: str,
    start_ns: int,
    end_ns: int,
    attributes: dict | None = None,
    links: list[Link] | None = None,
) -> None:
    tracer.start_span(name, attributes=attributes, links=links, start_time=start_ns).end(
        end_time=max(start_ns, end_ns)
    )
