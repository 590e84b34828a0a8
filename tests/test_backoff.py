"""The one backoff type: capped exponential waits, jittered downwards, retries from 1."""

from __future__ import annotations

import random

import pytest

from agentarium.broker import Backoff


@pytest.mark.parametrize(
    ("retry", "ceiling"), [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 5.0), (10_000, 5.0)]
)
def test_the_ceiling_doubles_from_the_first_retry_up_to_the_cap(retry, ceiling):
    assert Backoff(initial_s=0.5, max_s=5.0).ceiling(retry) == ceiling


def test_waits_fall_within_the_jitter_below_the_ceiling_and_never_above_the_cap():
    """Deterministic: ``random.Random(7)`` (Mersenne Twister, the same draws on every CPU and
    Python). Unseeded it would fail by chance only if 2000 uniform draws over a width of 1 all
    fell within 0.9 of each other: <= 2000 x 0.9^1999 ~ 1e-88."""
    backoff = Backoff(initial_s=1.0, max_s=8.0, jitter=0.25)
    rng = random.Random(7)
    waits = [backoff.delay(3, rng) for _ in range(2000)]
    assert 3.0 <= min(waits) and max(waits) <= 4.0
    assert max(waits) - min(waits) > 0.9  # spread, so clients that failed together part
    assert all(backoff.delay(50, rng) <= 8.0 for _ in range(100))
    assert Backoff(initial_s=1.0, max_s=8.0, jitter=0.0).delay(2) == 2.0


@pytest.mark.parametrize(
    "bad",
    [dict(initial_s=2.0, max_s=1.0), dict(initial_s=-1.0), dict(multiplier=0.5), dict(jitter=2)],
)
def test_bad_shapes_are_refused(bad):
    with pytest.raises(ValueError, match="Backoff"):
        Backoff(**bad)
