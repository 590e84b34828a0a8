"""An SGLang-shaped server for benchmarks: ``python bench/fake_fleet.py [--port 0] [--latency 0]``.

Answers ``POST /generate`` with the response the tests' fake builds (tests/fake_sglang.py:
SGLang's exact shapes; with ``"stream": true``, as one chunk, the whole, then ``data: [DONE]``),
after ``--latency`` seconds (0: at once), plus ``GET /health`` and
``GET /model_info`` at once (SGLang answers its health probe without generating). It speaks HTTP/1.1 with keep-alive on a bare asyncio protocol (uvloop when
installed) instead of aiohttp's server, so that at thousands of requests a second a benchmark
measures the consumer, not its fake: on the machine of docs/benchmarks.md it costs a few
tens of microseconds per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fake_sglang import FakeSGLang  # noqa: E402

try:
    import orjson

    def dumps(value) -> bytes:
        return orjson.dumps(value)

    loads = orjson.loads
except ImportError:  # pragma: no cover - orjson is a dependency

    def dumps(value) -> bytes:
        return json.dumps(value, separators=(",", ":")).encode()

    loads = json.loads


class _Server:
    def __init__(self, latency_s: float, output_ids: list[int], text: str) -> None:
        self.latency_s = latency_s
        self.shapes = FakeSGLang(output_ids=output_ids, text=text)  # builds SGLang's responses
        self.output_ids = output_ids
        self.text = text
        self.requests = 0
        self.open = 0
        self.peak_open = 0

    def answer(self, method: bytes, path: bytes, body: bytes) -> tuple[int, bytes]:
        if method == b"POST" and path == b"/generate":
            self.requests += 1
            request = loads(body)
            prompt = request.get("input_ids") or []
            max_new = request.get("sampling_params", {}).get("max_new_tokens", 1 << 30)
            output_ids = self.output_ids[:max_new]
            finish = (
                {"type": "length", "length": max_new}
                if len(self.output_ids) > max_new
                else {"type": "stop", "matched": output_ids[-1]}
            )
            answer = dumps(self.shapes._response(request, prompt, output_ids, self.text, finish))
            if request.get("stream"):  # SGLang's stream of one chunk: the whole, then the end
                return 200, b"data: " + answer + b"\n\ndata: [DONE]\n\n"
            return 200, answer
        if path == b"/health":
            return 200, b""
        if path in (b"/model_info", b"/get_model_info"):
            return 200, dumps({"model_path": "fake", "is_generation": True})
        return 404, b'{"detail":"Not Found"}'


class _Connection(asyncio.Protocol):
    def __init__(self, server: _Server) -> None:
        self.server = server
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport
        self.server.open += 1
        self.server.peak_open = max(self.server.peak_open, self.server.open)

    def connection_lost(self, exc) -> None:
        self.server.open -= 1

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].split(b"\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            method, path = head[0].split(b" ")[:2]
            status, payload = self.server.answer(method, path, body)
            response = (
                b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n"
                % (status, b"OK" if status == 200 else b"NO", len(payload))
            ) + payload
            if self.server.latency_s > 0 and path == b"/generate":  # /health answers at once
                self.loop.call_later(self.server.latency_s, self._write, response)
            else:
                self._write(response)

    def _write(self, response: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(response)


async def main(port: int, latency_s: float, servers: int, text: str = "1") -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # one socket per request in flight
    # one token per character: what is measured never decodes them
    server = _Server(latency_s, output_ids=[49] * len(text), text=text)
    loop = asyncio.get_running_loop()
    urls = []
    for i in range(servers):
        listener = await loop.create_server(
            lambda: _Connection(server), "127.0.0.1", port + i if port else 0, backlog=4096
        )
        urls.append(f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}")
    print(f"engine ready on {','.join(urls)}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before each answer")
    parser.add_argument(
        "--servers",
        type=int,
        default=1,
        help="listen on this many ports (a fleet; printed comma-separated): tens of thousands "
        "of connections to one address make the kernel search long for a free local port",
    )
    parser.add_argument("--text", default="1", help="the reply's text (one token a character)")
    args = parser.parse_args()
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    runner(main(args.port, args.latency, args.servers, args.text))
