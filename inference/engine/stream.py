"""A streamed `/generate` request: the chunks SGLang's server writes with
`--incremental-streaming-output`, one per engine step that added tokens to the request.

    {"text": <the text these tokens add>, "output_ids": [<this step's ids>],
     "meta_info": {"id", "finish_reason": null, "prompt_tokens", "completion_tokens" (so far),
                   "cached_tokens", "weight_version" (of the chunk's last token),
                   "output_token_logprobs"/"output_top_logprobs" (this chunk's tokens only)
                   and "input_token_logprobs"/"input_top_logprobs" (whole) with return_logprob}}

The last chunk is the unstreamed response cut down to what was not sent yet: its
`finish_reason`, `e2e_latency` and (when the weights changed mid-request) `weight_versions`
over the whole output. The chunks' texts add up to the unstreamed `text`: each step decodes a
window of its tokens and holds back what a stop string may still cut (formats/incremental.py).

The step runs on another thread: the scheduler calls `Sequence.on_step` on the event loop once
a step is over, and the stream notes there how many tokens it may read; entries before that
count are never written again, so a chunk built while the next step runs reads them safely.
A step that finishes the request is not noted: the last chunk waits for the response (the
future), which the scheduler sets after that step, or an abort between steps sets.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import AsyncGenerator

import structlog

from agentarium.formats import HeldText, IncrementalDecode

from .sequence import Sequence

log = structlog.get_logger("agentarium.engine")

# Output-side fields the last chunk carries for its own tokens only (SGLang's
# INCREMENTAL_STREAMING_META_INFO_KEYS)
_SLICED = ("output_token_logprobs", "output_top_logprobs")


class RequestStream:
    """The chunks of one streamed sequence. Create it before the sequence is submitted."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        params = seq.params
        # the text each step adds, a window decoded per step, a stop string's start held back
        self._decoded = IncrementalDecode(seq.decode)
        self._held = HeldText(() if params.no_stop_trim else params.stop)
        self._steps: deque[tuple[int, str]] = deque()  # (output length, last token's version)
        self._published = 0
        self._sent = 0  # output tokens already in a chunk
        self._wake = asyncio.Event()
        seq.on_step = self._stepped
        seq.future.add_done_callback(lambda _: self._wake.set())  # finished or aborted

    def _stepped(self) -> None:
        seq = self.seq
        n = len(seq.output_ids)
        # a finishing step's tokens go in the last chunk, built from the response
        if n > self._published and not seq.finished:
            self._published = n
            self._steps.append((n, seq.versions[-1][0]))
            self._wake.set()

    async def chunks(self) -> AsyncGenerator[dict, None]:
        """Every chunk, the last one (finish_reason set) included."""
        seq = self.seq
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._steps:
                yield self._chunk(*self._steps.popleft())
            if seq.future.done():
                yield self._last(seq.future.result())
                return

    def _chunk(self, end: int, version: str) -> dict:
        seq, start = self.seq, self._sent
        meta: dict = {
            "id": seq.rid,
            "finish_reason": None,
            "prompt_tokens": len(seq.request.input_ids),
            "completion_tokens": end,
            "cached_tokens": seq.cached_tokens,
            "weight_version": version,
        }
        if seq.request.return_logprob:
            meta.update(seq.logprob_meta(start, end))
        self._sent = end
        return {
            "text": self._held.release(self._decoded.add(seq.output_ids[start:end])),
            "output_ids": seq.output_ids[start:end],
            "meta_info": meta,
        }

    def _last(self, response: dict) -> dict:
        start = self._sent
        meta = dict(response["meta_info"])
        for key in _SLICED:
            if key in meta:
                meta[key] = meta[key][start:]
        final, sent = response["text"], self._decoded.text[: self._held.sent]
        if final.startswith(sent):
            text = final[len(sent) :]
        else:  # a decoder whose windows disagree with the whole: what was sent stays sent
            log.error(
                "streamed text diverged from the decoded text: its chunks do not add up",
                rid=self.seq.rid,
            )
            text = final[len(os.path.commonprefix([sent, final])) :]
        self._sent = len(response["output_ids"])
        return {"text": text, "output_ids": response["output_ids"][start:], "meta_info": meta}
