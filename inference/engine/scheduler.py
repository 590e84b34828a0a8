"""Continuous batching: one loop steps every running sequence one token per forward pass.

Each step (on a worker thread, so the event loop keeps serving HTTP): one decode pass over the
running batch, then one prefill pass for newly admitted requests, which join the batch's
left-padded KV cache; finished rows leave it. A request arriving at an idle engine waits
`batch_window_s` for companions, so a burst starts as one batch. A row's result does not
depend on its companions: padding is masked, positions are per row, every row samples with
its own generator.

After each step a streamed request's `Sequence.on_step` runs on the event loop (stream.py),
before the next step begins; a cancelled row (its client went away) leaves the batch at the
start of the next step.

Prefix cache (prefix_cache.py): a joining request whose prompt starts with a finished
sequence's tokens (its previous turn) takes that KV and computes only the rest; each sequence
that finishes (not aborted) leaves its KV there. Joiners of one prefill that begin with the
same 16 tokens or more beyond what the cache holds for them (a GRPO group's prompt, few-shot
examples) have their common prefix computed once, as a row of its own, and read it as a cached
prefix; it is kept in the cache too. A weight change flushes it.

Each request's phases are stamped on its Sequence (admitted, each prefill pass) and every
weight update or pause it waits through is recorded on it as a stall (tracing.py turns them into
spans); a weight update is an ``engine.weight_update`` span of its own.

Control operations (pause, abort, weight reload, version change) take the step lock, so they
happen between steps, never during one:
- pause `abort`: every request in flight or waiting finishes with finish_reason abort.
- pause `in_place`: running rows keep their KV cache and resume on continue.
- pause `retract`: running rows drop their cache and re-run their prompt plus the tokens
  generated so far on continue (with the weights of that moment).
While paused, new requests wait. A weight reload without a pause holds new requests back
until the running ones finish, as SGLang's does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import structlog
import torch
from opentelemetry.trace import Status, StatusCode

from .errors import WeightLoadError
from .kv import PaddedKV, fill_order
from .model import EngineModel
from .prefix_cache import CachedPrefix, PrefixCache
from .sampling import sample
from .sequence import Sequence
from .tracing import Stall, stall_everyone, tracer

log = structlog.get_logger("agentarium.engine")

PAUSE_MODES = ("abort", "retract", "in_place")
# rows of one prefill that begin with at least this many equal tokens compute them once
SHARE_MIN_TOKENS = 16


class Scheduler:
    def __init__(
        self,
        model: EngineModel,
        *,
        max_batch: int = 64,
        batch_window_s: float = 0.002,
        max_prefill_tokens: int = 16384,
        prefix_cache_tokens: int = 0,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.model = model
        self.max_batch = max_batch
        self.batch_window_s = batch_window_s
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self.weight_version = "default"
        self.paused = False
        self.steps = 0
        self.tokens_generated = 0
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._kv: PaddedKV | None = None
        self._hold_admission = 0  # weight reloads waiting for the running batch to drain
        self._paused_since = 0  # time.time_ns() of the pause in effect
        self._step_lock = asyncio.Lock()
        self._changed = asyncio.Condition()
        self._task: asyncio.Task | None = None
        self._rng = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        # Every forward pass on one thread: each thread that runs torch ops leads a team of
        # OpenMP threads of its own, and asyncio.to_thread's pool would hand steps to several,
        # whose idle teams spin on the cores the working one needs
        self._forward = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-step")

    def __repr__(self) -> str:
        return (
            f"<Scheduler running={len(self._running)} waiting={len(self._waiting)} "
            f"paused={self.paused} steps={self.steps} tokens={self.tokens_generated} "
            f"weight_version={self.weight_version!r}>"
        )

    @property
    def step_lock(self) -> asyncio.Lock:
        """Held during every step and control operation: what holds it sees no step run."""
        return self._step_lock

    @property
    def busy(self) -> bool:
        return bool(self._running or self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    async def wait_for(self, predicate) -> None:
        """Wait until `predicate()` holds; it is re-checked after every step and state change."""
        async with self._changed:
            await self._changed.wait_for(predicate)

    def generator_for(self, seed: int | None) -> torch.Generator:
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
        return torch.Generator().manual_seed(seed)

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-loop")
            self._task.add_done_callback(_log_crash)

    async def close(self) -> None:
        """Abort whatever is in flight (after the current step) and stop the loop."""
        async with self._step_lock:
            self._abort_all("the engine is shutting down")
            task, self._task = self._task, None
            if task is not None:
                task.cancel()
        if task is not None:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._forward.shutdown(wait=False)

    # ---- requests -------------------------------------------------------------------------

    async def submit(self, seq: Sequence) -> None:
        self.start()
        self._waiting.append(seq)
        await self._notify()

    async def abort(self, rid: str | None = None, *, message: str) -> int:
        """Abort one request by rid, or all of them (rid None); returns how many."""
        async with self._step_lock:
            if rid is None:
                return self._abort_all(message)
            count = 0
            for seq in [*self._running, *self._waiting]:
                if seq.rid == rid:
                    self._finish_aborted(seq, message)
                    count += 1
            self._drop_finished_waiting()
        await self._notify()
        return count

    # ---- control --------------------------------------------------------------------------

    async def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        if not self.paused:
            self._paused_since = time.time_ns()
        self.paused = True
        async with self._step_lock:  # the step in flight, if any, ends first
            if mode == "abort":
                self._abort_all("aborted by pause_generation(mode='abort'); resubmit")
            elif mode == "retract":
                self._waiting.extendleft(reversed(self._running))
                self._running, self._kv = [], None
        log.info("engine paused", mode=mode, running=len(self._running))
        await self._notify()

    async def resume(self) -> None:
        if self.paused:
            stall = Stall("paused", self._paused_since, time.time_ns())
            stall_everyone([*self._running, *self._waiting], stall)
        self.paused = False
        log.info("engine continued", waiting=len(self._waiting), running=len(self._running))
        await self._notify()

    async def set_version(self, version: str, *, abort_all: bool = False) -> None:
        async with self._step_lock:
            if abort_all:
                self._abort_all("aborted by update_weight_version(abort_all_requests=true)")
            self.weight_version = version
        await self._notify()

    async def update_weights(
        self,
        path,
        *,
        version: str | None = None,
        abort_all: bool = False,
        then: Callable[[], None] | None = None,
    ) -> tuple[bool, str, int]:
        """Reload weights in place from disk; returns (success, message, num_paused_requests).
        ``then`` runs after a load that succeeded, before any request runs on the new weights."""

        def load() -> str:
            message = self.model.load_weights(path)
            if then is not None:
                then()
            return message

        return await self.apply_weights(
            load,
            version=version,
            abort_all=abort_all,
            abort_message="aborted by update_weights_from_disk(abort_all_requests=true)",
            what=str(path),
        )

    async def apply_weights(
        self,
        load: Callable[[], str],
        *,
        version: str | None = None,
        abort_all: bool = False,
        abort_message: str = "aborted by a weight update (abort_all_requests=true)",
        what: str = "",
    ) -> tuple[bool, str, int]:
        """Run ``load()`` (a worker thread) between steps, once the running batch has drained
        or the engine is paused; returns (success, message, num_paused_requests). ``load``
        returns a message, or raises WeightLoadError leaving the current weights in place."""
        if abort_all:
            await self.abort(message=abort_message)

        def drained() -> bool:
            return self.paused or not self._running

        # From here new requests are held back: the span covers the wait and the swap, and
        # each request in flight at its end records it as a stall linked to it.
        span = tracer.start_span(
            "engine.weight_update",
            attributes={"agentarium.engine.source": what, "agentarium.engine.paused": self.paused},
        )
        held_since = time.time_ns()
        self._hold_admission += 1
        try:
            while True:
                await self.wait_for(drained)
                async with self._step_lock:
                    # a step that admitted requests may have ended while we waited for the lock
                    if not drained():
                        continue
                    try:
                        message = await asyncio.get_running_loop().run_in_executor(
                            self._forward, load
                        )
                    except WeightLoadError as exc:
                        log.warning("weight update failed", source=what, error=str(exc))
                        span.set_status(Status(StatusCode.ERROR, str(exc)))
                        return False, str(exc), 0
                    self.prefix_cache.flush()  # KV of the old weights
                    if version is not None:
                        self.weight_version = str(version)
                        message += f" Weight version updated to {version}."
                    paused = len(self._running) if self.paused else 0
                    break
        finally:
            stall = Stall("weight update", held_since, time.time_ns(), span.get_span_context())
            stall_everyone([*self._running, *self._waiting], stall)
            span.set_attribute("agentarium.engine.weight_version", self.weight_version)
            span.end()
            self._hold_admission -= 1
            await self._notify()
        log.info("weights updated", source=what, weight_version=self.weight_version)
        return True, message, paused

    # ---- the loop -------------------------------------------------------------------------

    def _has_work(self) -> bool:
        if self.paused:
            return False
        return bool(self._running) or (bool(self._waiting) and not self._hold_admission)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _loop(self) -> None:
        while True:
            async with self._changed:
                await self._changed.wait_for(self._has_work)
            if (
                not self._running
                and self.batch_window_s > 0
                and len(self._waiting) < self.max_batch
            ):
                await asyncio.sleep(self.batch_window_s)  # let a burst arrive as one batch
            async with self._step_lock:
                if not self._has_work():
                    continue
                joiners = self._admit()
                stepped = [*self._running, *joiners]
                try:
                    finished = await asyncio.get_running_loop().run_in_executor(
                        self._forward, self._step, joiners
                    )
                except Exception as exc:  # a bug or OOM: fail these requests, keep serving
                    log.exception("engine step failed")
                    finished = list(stepped)
                    for seq in finished:
                        seq.abort(f"engine step failed: {exc}", status_code=500)
                    self._running, self._kv = [], None
                # the step's appends are over and the next step has not begun: a streamed row
                # notes here what it may read (stream.py)
                for seq in stepped:
                    if seq.on_step is not None:
                        seq.on_step()
            for seq in finished:
                if not seq.future.done():
                    seq.future.set_result(seq.response(self.weight_version))
            await self._notify()

    def _admit(self) -> list[Sequence]:
        joiners: list[Sequence] = []
        if self._hold_admission:
            return joiners
        width = 0
        while self._waiting and len(self._running) + len(joiners) < self.max_batch:
            seq = self._waiting[0]
            if seq.cancelled or seq.finished:
                self._waiting.popleft()
                continue
            new_width = max(width, len(seq.all_ids))
            if joiners and new_width * (len(joiners) + 1) > self.max_prefill_tokens:
                break
            joiners.append(self._waiting.popleft())
            width = new_width
        if joiners:
            now = time.time_ns()
            for seq in joiners:
                seq.admitted_ns = seq.admitted_ns or now
        return joiners

    def _step(self, joiners: list[Sequence]) -> list[Sequence]:
        """One forward step (worker thread). Returns the sequences that finished."""
        finished = self._drop_done_rows()
        version = self.weight_version
        if self._running:
            assert self._kv is not None, "running rows always have a KV cache (set together)"
            logits = self.model.decode(
                self._kv,
                [seq.output_ids[-1] for seq in self._running],
                [seq.last_position for seq in self._running],
            )
            self._append(self._running, logits, version)
        # A request that wants prompt logprobs needs logits at every prompt position: prefill it
        # on its own, so the rest of the batch keeps last-position logits (B, 1, V) only.
        scoring = [[seq] for seq in joiners if seq.wants_input_logprobs]
        plain = [seq for seq in joiners if not seq.wants_input_logprobs]
        for group in scoring + ([plain] if plain else []):
            self._prefill(group, version)
        self.steps += 1
        return finished + self._drop_done_rows()

    def _prefill(self, group: list[Sequence], version: str) -> None:
        scoring = group[0].wants_input_logprobs  # then the group is this one sequence
        prompts = [seq.all_ids for seq in group]
        # prompt logprobs need logits at every prompt position: computed, not looked up
        prefixes = [None if scoring else self.prefix_cache.lookup(ids) for ids in prompts]
        skipped = [0 if prefix is None else prefix.length for prefix in prefixes]
        if not scoring and self.prefix_cache.max_tokens:
            self._share_prefixes(prompts, prefixes, skipped)
        for seq, skip in zip(group, skipped, strict=True):
            seq.kv_epoch = self.prefix_cache.epoch
            if not seq.output_ids:  # a retracted row re-runs its prompt: counted once
                seq.cached_tokens = skip
        started = time.time_ns()
        logits, kv = self.model.prefill(prompts, all_logits=scoring, prefixes=prefixes)
        pass_ns = (started, time.time_ns())
        for seq in group:
            seq.prefills.append(pass_ns)
            seq.prefill_batch = len(group)
        if scoring:
            seq = group[0]
            seq.set_input_logprobs(
                torch.log_softmax(logits[0], dim=-1), seq.request.top_logprobs_num
            )
        fresh = {id(seq) for seq in group if seq.params.max_new_tokens == 0}
        for seq in group:
            if id(seq) in fresh:
                seq.finish_reason = {"type": "length", "length": 0}
        self._append(group, logits[:, -1], version, skip=fresh)
        self._kv = kv if self._kv is None else PaddedKV.concat(self._kv, kv)
        self._running.extend(group)

    def _share_prefixes(
        self, prompts: list[list[int]], prefixes: list[CachedPrefix | None], skipped: list[int]
    ) -> None:
        """Rows of one prefill that begin with the same ``SHARE_MIN_TOKENS`` tokens or more (a
        GRPO group's prompt, few-shot examples every prompt repeats), beyond what the prefix
        cache holds for them: compute their common prefix once, as a row of its own, and give
        it to each of them as a cached prefix. In place: ``prefixes[i]`` becomes the shared
        one where it is longer, ``skipped[i]`` the tokens row i does not compute (the row whose
        prefix pass it was counts only what that pass found cached, as SGLang's first request
        of a prefix counts 0 and the next ones read it from its radix cache). The prefix is
        kept in the prefix cache too, for later arrivals."""
        clusters: dict[tuple[int, ...], list[int]] = {}
        for row, ids in enumerate(prompts):
            if len(ids) > SHARE_MIN_TOKENS:
                clusters.setdefault(tuple(ids[:SHARE_MIN_TOKENS]), []).append(row)
        for rows in clusters.values():
            length = _common_length([prompts[r] for r in rows])
            rows = [r for r in rows if skipped[r] < length]
            length = _common_length([prompts[r] for r in rows])  # rows needing it may share more
            if len(rows) < 2 or length < SHARE_MIN_TOKENS:
                continue
            ids = prompts[rows[0]][:length]
            base = self.prefix_cache.lookup(ids)
            _, kv = self.model.prefill([ids], all_logits=False, prefixes=[base])
            keys, values = [k[0] for k in kv.keys], [v[0] for v in kv.values]  # (H_kv, L, D)
            shared = CachedPrefix(keys=keys, values=values, length=length)
            self.prefix_cache.store(ids, keys, values, self.prefix_cache.epoch)
            for r in rows:
                prefixes[r], skipped[r] = shared, length
            skipped[rows[0]] = 0 if base is None else base.length

    def _append(self, seqs: list[Sequence], logits: torch.Tensor, version: str, skip=()) -> None:
        draws = sample(
            logits,
            [seq.params for seq in seqs],
            [seq.generator for seq in seqs],
            [seq.request.top_logprobs_num if seq.request.return_logprob else 0 for seq in seqs],
        )
        for seq, draw in zip(seqs, draws, strict=True):
            if id(seq) not in skip and not seq.finished:
                seq.append(draw, version)
                self.tokens_generated += 1

    def _drop_done_rows(self) -> list[Sequence]:
        """Remove finished and cancelled rows from the batch; return the finished ones."""
        keep = [i for i, seq in enumerate(self._running) if not (seq.finished or seq.cancelled)]
        if len(keep) == len(self._running):
            return []
        done = [seq for seq in self._running if seq.finished and not seq.cancelled]
        if self.prefix_cache.max_tokens and self._kv is not None:
            for row, seq in enumerate(self._running):
                ended = (seq.finish_reason or {}).get("type")
                if ended is not None and ended != "abort" and not seq.cancelled:
                    self._keep_prefix(seq, row)
        order = fill_order(keep, len(self._running))  # as few rows move in the cache as left
        self._running = [self._running[i] for i in order]
        self._kv = self._kv.select(order) if order and self._kv is not None else None
        return done

    def _keep_prefix(self, seq: Sequence, row: int) -> None:
        assert self._kv is not None
        keys, values = self._kv.row(row)
        computed = keys[0].shape[1]  # every token but the last sampled one
        ids = seq.all_ids
        if computed <= len(ids):
            self.prefix_cache.store(ids[:computed], keys, values, seq.kv_epoch)

    def _abort_all(self, message: str) -> int:
        seqs = [*self._running, *self._waiting]
        for seq in seqs:
            self._finish_aborted(seq, message)
        self._running, self._kv = [], None
        self._waiting.clear()
        if seqs:
            log.info("requests aborted", count=len(seqs), reason=message)
        return len(seqs)

    def _finish_aborted(self, seq: Sequence, message: str) -> None:
        seq.abort(message)
        if not seq.future.done():
            seq.future.set_result(seq.response(self.weight_version))

    def _drop_finished_waiting(self) -> None:
        self._waiting = deque(s for s in self._waiting if not s.finished)


def _common_length(prompts: list[list[int]]) -> int:
    """The length of the prompts' common prefix, short of the shortest one's last token (whose
    logits each row's prefill must produce). Compared in numpy: a long agent's prompts hold tens
    of thousands of tokens, which a Python loop would walk for every prefill."""
    if not prompts:
        return 0
    length = min(len(p) for p in prompts) - 1
    if length <= 0:
        return 0
    first = np.asarray(prompts[0][:length], dtype=np.int64)
    for ids in prompts[1:]:
        differ = np.flatnonzero(np.asarray(ids[:length], dtype=np.int64) != first[:length])
        if differ.size:
            length = int(differ[0])
            if length == 0:
                break
    return length


def _log_crash(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("engine loop crashed", exc_info=task.exception())
