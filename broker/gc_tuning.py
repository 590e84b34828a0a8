"""Garbage-collector settings for a long-running service such as the consumer.

A consumer allocates a few hundred container objects per rollout, nearly all freed by reference
counting within milliseconds. With CPython's default thresholds (700, 10, 10) the cyclic
collector runs every few rollouts, and every hundredth run walks every object the process
holds, imported modules included: about a tenth of a consumer's CPU on the one-call benchmark
(``perf record``: ``gc_collect_main``, ``visit_decref``, ``visit_reachable``). ``tune_gc()``
freezes what exists once the service is up (start-up objects are never scanned again) and lets
the young generation grow to ``gen0`` allocations before a collection. Cycles are still
collected, a little later. ``AGENTARIUM_GC=default`` keeps CPython's settings.
"""

from __future__ import annotations

import gc
import os

ENV = "AGENTARIUM_GC"
GEN0 = 50_000


def tune_gc(gen0: int = GEN0, *, freeze: bool = True) -> bool:
    """Raise the young generation's threshold (never lowering one set higher) and, with
    ``freeze``, freeze the heap as it is now; False (nothing done) when
    ``AGENTARIUM_GC=default``.

    ``freeze`` suits a process of our own (the consumer command). Inside someone else's
    process (the orchestrator in a training script) only the threshold is raised: a frozen
    object that later becomes cyclic garbage would never be collected."""
    if os.environ.get(ENV, "").strip().lower() == "default":
        return False
    if freeze:
        gc.collect()
        gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, gen0), middle, old)
    return True
