"""The order the suite's tests are handed to pytest-xdist's workers in.

``ops/test.sh`` runs the first pass with ``--dist worksteal``: the collection is split into
one contiguous run of tests per worker, and a worker that runs dry steals the back half of the
longest queue. A test that takes minutes and sits late in its run starts late and ends the
pass alone on one core. Tests marked ``long(seconds)`` (their measured time on 2 loaded cores)
are therefore dealt out, longest first, each to the run with the least long work so far, and
put at the heads of the runs, where nothing steals them; the rest keep their order.

The reordering runs last among the collection hooks (``trylast``), after ``-m`` has
deselected what the pass leaves out: worksteal cuts its runs from the final list, and a
reorder made before ``-m "not chaos"`` dropped the chaos tests had every boundary shifted by
their number, which put the real-model learning test 401 tests deep into the first run (it
started 13 minutes into the pass and ended it alone for six).
"""

from __future__ import annotations

import os

import pytest


def seconds_of(item) -> float:
    mark = item.get_closest_marker("long")
    return float(mark.args[0]) if mark is not None and mark.args else 0.0


def spread_long_tests(items: list, workers: int) -> list:
    """``items`` reordered so that worksteal's initial runs each begin with their share of
    the long tests (the runs are worksteal's: ``remaining // workers_left`` tests each)."""
    long = sorted((i for i in items if seconds_of(i) > 0), key=seconds_of, reverse=True)
    if workers < 2 or not long:
        return list(items)
    heads: list[list] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for item in long:
        k = loads.index(min(loads))
        heads[k].append(item)
        loads[k] += seconds_of(item)
    rest = iter(i for i in items if seconds_of(i) == 0)
    ordered, remaining = [], len(items)
    for k in range(workers):
        size = remaining // (workers - k)
        run = heads[k] + [next(rest) for _ in range(max(0, size - len(heads[k])))]
        ordered += run
        remaining -= len(run)
    ordered += list(rest)
    return ordered


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """conftest.py registers this hook: the pass's own workers (xdist sets the count)."""
    items[:] = spread_long_tests(items, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")))
