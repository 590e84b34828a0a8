"""One request in flight: its tokens so far, when it stops, and its SGLang-shaped response.

Stop rules follow SGLang's `Req.check_finished`, in its order: max_new_tokens first
(`{"type": "length", "length": N}`), then stop_token_ids and EOS ids unless `ignore_eos`
(`{"type": "stop", "matched": <id>}`), then stop strings (`{"type": "stop", "matched": <str>}`).
`output_ids` keep the matched token; `text` drops it, and a matched stop string is cut from
`text` (unless `no_stop_trim`).

The scheduler's step thread appends to `output_ids`, `logprobs` and `top_logprobs` and never
changes an entry once written, so the event loop may read entries a finished step wrote while the
next step runs (stream.py does, for a streamed request).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import torch
from tokenizers import Tokenizer

from .request import GenerateRequest
from .sampling import Draw


class Sequence:
    """Mutable state of one generate request; owned by the scheduler."""

    def __init__(
        self,
        request: GenerateRequest,
        *,
        tokenizer: Tokenizer,
        eos_token_ids: frozenset[int],
        generator: torch.Generator,
        future: asyncio.Future,
    ) -> None:
        self.request = request
        self.params = request.sampling
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.generator = generator
        self.future = future
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[float, int]]] = []
        self.input_logprobs: list[float | None] | None = None
        self.input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
        self.versions: list[list] = []  # [[version, first output index], ...]
        self.finish_reason: dict | None = None
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.kv_epoch = -1  # the prefix cache's epoch when this row's KV was computed
        self.cancelled = False
        # A streamed request's hook (stream.py): the scheduler calls it on the event loop after
        # each step this row took part in, before the next step starts.
        self.on_step: Callable[[], None] | None = None
        self._input_meta: dict | None = None  # its prompt logprobs as answered, once computed
        self.started = time.monotonic()
        # Wall-clock stamps of its phases, for its spans (tracing.py): a few per request.
        self.arrived_ns = time.time_ns()
        self.admitted_ns = 0  # first taken into a step
        self.prefills: list[tuple[int, int]] = []  # (start, end) of each prefill pass
        self.prefill_batch = 0  # requests prefilled together with it, itself included
        self.finished_ns = 0
        self.stalls: list = []  # tracing.Stall: weight updates and pauses it waited through
        bytes_needed = max((len(s.encode()) for s in self.params.stop), default=0)
        self._stop_tail = bytes_needed + 1  # tokens to decode: each token is at least one byte

    @property
    def rid(self) -> str:
        return self.request.rid

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_ids(self) -> list[int]:
        return [*self.request.input_ids, *self.output_ids]

    @property
    def last_position(self) -> int:
        """Position of the last token, the one the next decode step feeds in."""
        return len(self.request.input_ids) + len(self.output_ids) - 1

    @property
    def wants_input_logprobs(self) -> bool:
        r = self.request
        return r.return_logprob and r.logprob_start_len >= 0 and self.input_logprobs is None

    def append(self, draw: Draw, version: str) -> None:
        if not self.versions or self.versions[-1][0] != version:
            self.versions.append([version, len(self.output_ids)])
        self.output_ids.append(draw.token)
        self.logprobs.append(draw.logprob)
        if draw.top is not None:
            self.top_logprobs.append(draw.top)
        self._check_finished()

    def set_input_logprobs(self, logprobs: torch.Tensor, top_n: int) -> None:
        """`logprobs` (T, V): log-softmax of the prompt's logits at temperature 1."""
        ids = self.request.input_ids
        start = self.request.logprob_start_len
        values: list[float | None] = []
        tops: list[list[tuple[float, int]] | None] = []
        for pos in range(start, len(ids)):
            if pos == 0:  # nothing predicts the first token
                values.append(None)
                tops.append(None)
                continue
            row = logprobs[pos - 1]
            values.append(float(row[ids[pos]]))
            if top_n:
                v, i = torch.topk(row, top_n)
                tops.append([(float(a), int(b)) for a, b in zip(v, i, strict=True)])
        self.input_logprobs = values
        self.input_top_logprobs = tops if top_n else None

    def abort(self, message: str, status_code: int = 503) -> None:
        if self.finish_reason is None:
            self.finish_reason = {
                "type": "abort",
                "message": message,
                "status_code": status_code,
                "err_type": None,
            }

    def _check_finished(self) -> None:
        p = self.params
        if len(self.output_ids) >= p.max_new_tokens:
            self.finish_reason = {"type": "length", "length": p.max_new_tokens}
            return
        last = self.output_ids[-1]
        if not p.ignore_eos and (last in p.stop_token_ids or last in self.eos_token_ids):
            self.finish_reason = {"type": "stop", "matched": last}
            return
        if p.stop:
            tail = self.decode(self.output_ids[-self._stop_tail :])
            for stop in p.stop:
                if stop in tail:
                    self.finish_reason = {"type": "stop", "matched": stop}
                    return

    def decode(self, ids: list[int]) -> str:
        """Output ids as text, the way this request's `text` is decoded."""
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def text(self) -> str:
        ids, matched = self.output_ids, (self.finish_reason or {}).get("matched")
        if self.params.no_stop_trim:
            return self.decode(ids)
        if isinstance(matched, int):
            return self.decode(ids[:-1])
        text = self.decode(ids)
        if isinstance(matched, str) and matched in text:
            text = text[: text.find(matched)]
        return text

    def response(self, current_version: str) -> dict:
        """The SGLang `/generate` response for this finished (or aborted) request."""
        self.finished_ns = self.finished_ns or time.time_ns()
        r = self.request
        version = self.versions[-1][0] if self.versions else current_version
        meta: dict = {
            "id": r.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(r.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "weight_version": version,
        }
        if len(self.versions) > 1:
            ends = [start for _, start in self.versions[1:]] + [len(self.output_ids)]
            meta["weight_versions"] = [
                {"version": v, "start": start, "end": end}
                for (v, start), end in zip(self.versions, ends, strict=True)
            ]
        if r.return_logprob:
            meta.update(self.logprob_meta(0, len(self.output_ids)))
        meta["e2e_latency"] = time.monotonic() - self.started
        return {"text": self.text(), "output_ids": list(self.output_ids), "meta_info": meta}

    def logprob_meta(self, start: int, end: int) -> dict:
        """The logprob fields of `meta_info` for output tokens [start, end): a streamed chunk
        carries its own tokens' (stream.py), the response all of them; both carry the prompt's."""
        meta: dict = {
            "output_token_logprobs": [
                [lp, tid, self._token_text(tid)]
                for lp, tid in zip(
                    self.logprobs[start:end], self.output_ids[start:end], strict=True
                )
            ]
        }
        meta.update(self._input_logprob_meta())
        if self.request.top_logprobs_num:
            meta["output_top_logprobs"] = [
                [[lp, tid, self._token_text(tid)] for lp, tid in top]
                for top in self.top_logprobs[start:end]
            ]
        return meta

    def _input_logprob_meta(self) -> dict:
        if self._input_meta is not None:
            return self._input_meta
        r = self.request
        if r.logprob_start_len < 0:
            return {}
        meta: dict = {
            "input_token_logprobs": [
                [lp, tid, self._token_text(tid)]
                for lp, tid in zip(
                    self.input_logprobs or [], r.input_ids[r.logprob_start_len :], strict=False
                )
            ]
        }
        if r.top_logprobs_num:
            meta["input_top_logprobs"] = [
                None if top is None else [[lp, t, self._token_text(t)] for lp, t in top]
                for top in (self.input_top_logprobs or [])
            ]
        if self.input_logprobs is not None:  # computed once, at its prefill: answered alike after
            self._input_meta = meta
        return meta

    def _token_text(self, token_id: int) -> str | None:
        if not self.request.return_text_in_logprobs:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
