"""The delivery decision as a table: (policy, what happened, delivery number) → decision.

Pure: no broker, no worker. The worker only carries these decisions out (tests/test_worker.py
checks that it does, against a real nats-server).
"""

from __future__ import annotations

import itertools

import pytest

from consumers.delivery import Action, Decision, DeliveryPolicy, Event

# attempts=3: JetStream's max_deliver is 4, and the 4th delivery is never run. No jitter, so
# every delay in the table is exact: base 1s doubling, capped at 60s.
THREE = DeliveryPolicy(attempts=3, base_delay_s=1.0, max_delay_s=60.0, jitter=0.0)
ONE = DeliveryPolicy(attempts=1, base_delay_s=1.0, max_delay_s=60.0, jitter=0.0)
CAPPED = DeliveryPolicy(attempts=10, base_delay_s=1.0, max_delay_s=5.0, jitter=0.0)
run, ack, nak, dead = Decision.run, Decision.ack, Decision.nak, Decision.dead_letter


def exhausted(delivery: int, attempts: int) -> Decision:
    return dead(
        "max_deliveries",
        detail=(
            f"delivered {delivery} times without an acknowledgement (worker crash or ack "
            f"timeout on the last of {attempts} attempts)"
        ),
        record_error=True,
        check_stored=True,
    )


CASES = [
    # -- the job cannot be run: permanent, whatever the delivery; its raw bytes are kept
    ("undecodable", THREE, Event.INVALID_JOB, 1, dead("invalid_job")),
    ("undecodable on its last delivery", THREE, Event.INVALID_JOB, 4, dead("invalid_job")),
    ("another agent's job", THREE, Event.WRONG_SUBJECT, 1, dead("wrong_subject")),
    # -- received: run it; a redelivery looks for a stored trajectory first
    ("first delivery runs", THREE, Event.RECEIVED, 1, run(check_stored=False)),
    ("redelivery looks up first", THREE, Event.RECEIVED, 2, run(check_stored=True)),
    ("last attempt runs", THREE, Event.RECEIVED, 3, run(check_stored=True)),
    # the delivery past the attempts (the last run crashed a worker) is never run
    ("past the attempts", THREE, Event.RECEIVED, 4, exhausted(4, 3)),
    ("far past (max_deliver lowered)", THREE, Event.RECEIVED, 7, exhausted(7, 3)),
    ("one attempt: first runs", ONE, Event.RECEIVED, 1, run(check_stored=False)),
    ("one attempt: second never runs", ONE, Event.RECEIVED, 2, exhausted(2, 1)),
    ("stored by an earlier delivery", THREE, Event.ALREADY_STORED, 2, ack()),
    # -- the rollout returned a trajectory: stored and acked, never rerun
    ("ok", THREE, Event.OK, 1, ack()),
    ("ok on the last attempt", THREE, Event.OK, 3, ack()),
    ("deadline passed", THREE, Event.TIMEOUT, 1, ack()),
    ("LLM fleet down: recorded", THREE, Event.ERROR, 1, ack()),
    ("LLM fleet down, last attempt", THREE, Event.ERROR, 3, ack()),
    # -- the agent raised: backoff, then an error trajectory and a dead letter
    ("agent error, 1st of 3", THREE, Event.AGENT_ERROR, 1, nak(1.0)),
    ("agent error, 2nd: doubled", THREE, Event.AGENT_ERROR, 2, nak(2.0)),
    ("agent error, 3rd of 3", THREE, Event.AGENT_ERROR, 3, dead("agent_error", record_error=True)),
    ("agent error, one attempt", ONE, Event.AGENT_ERROR, 1, dead("agent_error", record_error=True)),
    ("backoff below the cap", CAPPED, Event.AGENT_ERROR, 3, nak(4.0)),
    ("backoff capped", CAPPED, Event.AGENT_ERROR, 9, nak(5.0)),
    # -- an environment service failed under it: retried, the last attempt stored as error
    ("environment unavailable, 1st of 3", THREE, Event.ENV_UNAVAILABLE, 1, nak(1.0)),
    ("environment unavailable, 2nd: doubled", THREE, Event.ENV_UNAVAILABLE, 2, nak(2.0)),
    ("environment unavailable, 3rd of 3: stored", THREE, Event.ENV_UNAVAILABLE, 3, ack()),
    ("environment unavailable, one attempt", ONE, Event.ENV_UNAVAILABLE, 1, ack()),
    # -- the worker raised: another delivery while there is one, at the base delay
    ("worker error", THREE, Event.WORKER_ERROR, 1, nak(1.0)),
    ("worker error, last attempt", THREE, Event.WORKER_ERROR, 3, nak(1.0)),
    ("worker error, last delivery", THREE, Event.WORKER_ERROR, 4, dead("worker_error")),
    # -- a drain released it: back to the queue at once, unless the server would not redeliver
    ("released", THREE, Event.RELEASED, 1, nak()),
    ("released on the last attempt", THREE, Event.RELEASED, 3, nak()),
    ("released on its last delivery", THREE, Event.RELEASED, 4, dead("released")),
]


@pytest.mark.parametrize(
    ("policy", "event", "delivery", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_decision_table(policy, event, delivery, expected):
    assert policy.decide(event, delivery) == expected


def test_the_table_covers_every_event():
    assert {case[2] for case in CASES} == set(Event)


@pytest.mark.parametrize("attempts", [1, 2, 3, 5])
def test_no_decision_strands_a_job(attempts):
    """Over every event and delivery: a nak only while the server will deliver again (on the
    last delivery it would strand the job in the work queue forever), a run only within the
    attempts, and every dead letter says why."""
    policy = DeliveryPolicy(attempts=attempts)
    for event, delivery in itertools.product(Event, range(1, attempts + 4)):
        decision = policy.decide(event, delivery)
        if decision.action is Action.NAK:
            assert delivery < policy.max_deliver, (event, delivery)
            assert decision.delay_s >= 0
        if decision.action is Action.RUN:
            assert event is Event.RECEIVED and delivery <= attempts
        if decision.action is Action.DEAD_LETTER:
            assert decision.reason
        if decision.record_error:
            assert decision.action is Action.DEAD_LETTER


def test_jittered_delays_stay_within_the_jitter_of_the_capped_backoff():
    policy = DeliveryPolicy(attempts=20, base_delay_s=1.0, max_delay_s=8.0, jitter=0.2)
    for delivery in range(1, 20):
        exact = min(8.0, 2.0 ** (delivery - 1))
        for _ in range(20):
            assert exact * 0.8 <= policy.delay_s(delivery) <= exact * 1.2


def test_max_deliver_is_one_past_the_attempts():
    assert DeliveryPolicy(attempts=3).max_deliver == 4
    assert DeliveryPolicy(attempts=1).max_deliver == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"attempts": 0},
        {"base_delay_s": -1.0},
        {"base_delay_s": 10.0, "max_delay_s": 5.0},
        {"jitter": 1.0},
        {"jitter": -0.1},
    ],
)
def test_policy_refuses_impossible_settings(kwargs):
    with pytest.raises(ValueError):
        DeliveryPolicy(**kwargs)


def test_the_callers_keywords_still_build_one():
    # agentarium's consumer command and in-process consumers pass exactly these.
    policy = DeliveryPolicy(attempts=5, base_delay_s=0.5, max_delay_s=60.0)
    assert (policy.attempts, policy.max_deliver) == (5, 6)
