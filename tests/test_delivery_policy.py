"""The delivery decision as a table: (policy, what happened, delivery number, failed runs so
far) → decision.

Pure: no broker, no worker. The worker only carries these decisions out (tests/test_worker.py
checks that it does, against a real nats-server).
"""

from __future__ import annotations

import itertools

import pytest

from agentarium.consumers.delivery import Action, Decision, DeliveryPolicy, Event

# attempts=3, lost_deliveries=5: JetStream's max_deliver is 9, and the 9th delivery is never
# run. No jitter, so every delay in the table is exact: base 1s doubling, capped at 60s.
THREE = DeliveryPolicy(attempts=3, base_delay_s=1.0, max_delay_s=60.0, jitter=0.0)
ONE = DeliveryPolicy(attempts=1, base_delay_s=1.0, max_delay_s=60.0, jitter=0.0)
CAPPED = DeliveryPolicy(attempts=10, base_delay_s=1.0, max_delay_s=5.0, jitter=0.0)
# no lost delivery allowed: every delivery is a run, as before lost deliveries were told apart
STRICT = DeliveryPolicy(attempts=3, lost_deliveries=0, base_delay_s=1.0, jitter=0.0)
run, ack, nak, dead = Decision.run, Decision.ack, Decision.nak, Decision.dead_letter


def failed(delay_s: float) -> Decision:
    return nak(delay_s, count_failure=True)


def exhausted(delivery: int, failures: int, lost: int, allowed: int) -> Decision:
    return dead(
        "max_deliveries",
        detail=(
            f"delivered {delivery} times without an outcome: {failures} runs failed, {lost} "
            "deliveries were lost (a worker crashed or was stopped, or an ack timed out; "
            f"{allowed} may be): does the job crash its workers?"
        ),
        record_error=True,
        check_stored=True,
    )


# (name, policy, event, delivery, failed runs so far, decision)
CASES = [
    # -- the job cannot be run: permanent, whatever the delivery; its raw bytes are kept
    ("undecodable", THREE, Event.INVALID_JOB, 1, 0, dead("invalid_job")),
    ("undecodable on its last delivery", THREE, Event.INVALID_JOB, 9, 0, dead("invalid_job")),
    ("another agent's job", THREE, Event.WRONG_SUBJECT, 1, 0, dead("wrong_subject")),
    # -- received: run it; a redelivery looks for a stored trajectory first
    ("first delivery runs", THREE, Event.RECEIVED, 1, 0, run(check_stored=False)),
    ("redelivery looks up first", THREE, Event.RECEIVED, 2, 1, run(check_stored=True)),
    ("last attempt runs", THREE, Event.RECEIVED, 3, 2, run(check_stored=True)),
    # lost deliveries (crash, drain, ack timeout) spend no attempt: the job still runs
    ("lost three times, runs", THREE, Event.RECEIVED, 4, 0, run(check_stored=True)),
    ("lost five, failed twice", THREE, Event.RECEIVED, 8, 2, run(check_stored=True)),
    # the last delivery (a job that keeps crashing its workers) is never run
    ("last delivery", THREE, Event.RECEIVED, 9, 2, exhausted(9, 2, 6, 5)),
    ("last delivery, all lost", THREE, Event.RECEIVED, 9, 0, exhausted(9, 0, 8, 5)),
    ("far past (max_deliver lowered)", THREE, Event.RECEIVED, 12, 0, exhausted(12, 0, 11, 5)),
    ("one attempt: a lost one runs again", ONE, Event.RECEIVED, 2, 0, run(check_stored=True)),
    ("strict: past the attempts", STRICT, Event.RECEIVED, 4, 2, exhausted(4, 2, 1, 0)),
    ("stored by an earlier delivery", THREE, Event.ALREADY_STORED, 2, 0, ack()),
    # -- the rollout returned a trajectory: stored and acked, never rerun
    ("ok", THREE, Event.OK, 1, 0, ack()),
    ("ok on the last attempt", THREE, Event.OK, 3, 2, ack()),
    ("deadline passed", THREE, Event.TIMEOUT, 1, 0, ack()),
    ("LLM fleet down: recorded", THREE, Event.ERROR, 1, 0, ack()),
    ("LLM fleet down, last attempt", THREE, Event.ERROR, 3, 2, ack()),
    # -- the agent raised: counted, backoff, then an error trajectory and a dead letter
    ("agent error, 1st of 3", THREE, Event.AGENT_ERROR, 1, 0, failed(1.0)),
    ("agent error, 2nd: doubled", THREE, Event.AGENT_ERROR, 2, 1, failed(2.0)),
    (
        "agent error, 3rd of 3",
        THREE,
        Event.AGENT_ERROR,
        3,
        2,
        dead("agent_error", record_error=True),
    ),
    ("agent error after lost ones", THREE, Event.AGENT_ERROR, 5, 0, failed(1.0)),
    (
        "3rd failure after lost ones",
        THREE,
        Event.AGENT_ERROR,
        7,
        2,
        dead("agent_error", record_error=True),
    ),
    (
        "agent error, one attempt",
        ONE,
        Event.AGENT_ERROR,
        1,
        0,
        dead("agent_error", record_error=True),
    ),
    ("backoff below the cap", CAPPED, Event.AGENT_ERROR, 3, 2, failed(4.0)),
    ("backoff capped", CAPPED, Event.AGENT_ERROR, 9, 8, failed(5.0)),
    # -- an environment service failed under it: counted, retried, the last attempt stored
    ("environment unavailable, 1st of 3", THREE, Event.ENV_UNAVAILABLE, 1, 0, failed(1.0)),
    ("environment unavailable, 2nd: doubled", THREE, Event.ENV_UNAVAILABLE, 2, 1, failed(2.0)),
    ("environment unavailable, 3rd of 3: stored", THREE, Event.ENV_UNAVAILABLE, 3, 2, ack()),
    ("environment unavailable after lost ones", THREE, Event.ENV_UNAVAILABLE, 6, 1, failed(2.0)),
    ("environment unavailable, one attempt", ONE, Event.ENV_UNAVAILABLE, 1, 0, ack()),
    # -- the worker raised: another delivery (a lost one) while there is one, at the base delay
    ("worker error", THREE, Event.WORKER_ERROR, 1, 0, nak(1.0)),
    ("worker error, last attempt", THREE, Event.WORKER_ERROR, 3, 2, nak(1.0)),
    ("worker error, last delivery", THREE, Event.WORKER_ERROR, 9, 0, dead("worker_error")),
    # -- a drain released it: requeued (a fresh message), whatever its delivery: no delivery
    # spent, so a long job released by every scale-down is never dead-lettered for it
    ("released", THREE, Event.RELEASED, 1, 0, Decision.requeue()),
    ("released on the last attempt", THREE, Event.RELEASED, 3, 2, Decision.requeue()),
    ("released on its last delivery", THREE, Event.RELEASED, 9, 0, Decision.requeue()),
    # -- ...and the requeue publish failed: back at once, unless the server would not redeliver
    ("requeue failed", THREE, Event.REQUEUE_FAILED, 1, 0, nak()),
    ("requeue failed, last attempt", THREE, Event.REQUEUE_FAILED, 3, 2, nak()),
    ("requeue failed, last delivery", THREE, Event.REQUEUE_FAILED, 9, 0, dead("released")),
]


@pytest.mark.parametrize(
    ("policy", "event", "delivery", "failures", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_decision_table(policy, event, delivery, failures, expected):
    assert policy.decide(event, delivery, failures) == expected


def test_the_table_covers_every_event():
    assert {case[2] for case in CASES} == set(Event)


@pytest.mark.parametrize("attempts", [1, 2, 3, 5])
def test_no_decision_strands_a_job(attempts):
    """Over every event and delivery: a nak only while the server will deliver again (on the
    last delivery it would strand the job in the work queue forever), a run only within the
    attempts, and every dead letter says why."""
    policy = DeliveryPolicy(attempts=attempts)
    deliveries = range(1, policy.max_deliver + 3)
    for event, delivery, failures in itertools.product(Event, deliveries, range(attempts)):
        if failures >= delivery:
            continue  # each failed run took a delivery
        decision = policy.decide(event, delivery, failures)
        if decision.action is Action.NAK:
            assert delivery < policy.max_deliver, (event, delivery)
            assert decision.delay_s >= 0
            # a run that failed is counted; a lost delivery (worker error, drain) is not
            assert decision.count_failure == (event in (Event.AGENT_ERROR, Event.ENV_UNAVAILABLE))
        if decision.action is Action.RUN:
            assert event is Event.RECEIVED and delivery < policy.max_deliver
        if decision.action is Action.DEAD_LETTER:
            assert decision.reason
            # an agent error is final only on its last attempt (or on the job's last
            # delivery, where nothing runs), however many deliveries were lost
            assert event is not Event.AGENT_ERROR or (
                failures + 1 == attempts or delivery >= policy.max_deliver
            )
        if decision.record_error:
            assert decision.action is Action.DEAD_LETTER


def test_jittered_delays_stay_within_the_jitter_of_the_capped_backoff():
    policy = DeliveryPolicy(attempts=20, base_delay_s=1.0, max_delay_s=8.0, jitter=0.2)
    for delivery in range(1, 20):
        exact = min(8.0, 2.0 ** (delivery - 1))
        for _ in range(20):
            assert exact * 0.8 <= policy.delay_s(delivery) <= exact * 1.2


def test_max_deliver_is_the_attempts_the_lost_deliveries_and_one():
    assert DeliveryPolicy(attempts=3).max_deliver == 9
    assert DeliveryPolicy(attempts=1).max_deliver == 7
    assert DeliveryPolicy(attempts=3, lost_deliveries=0).max_deliver == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        {"attempts": 0},
        {"lost_deliveries": -1},
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
    assert (policy.attempts, policy.max_deliver) == (5, 11)


def test_a_requeued_copy_looks_for_its_trajectory_on_its_first_delivery():
    """A released job published again starts at delivery 1, but a run before it may have
    stored the trajectory (the ack of the released delivery lost): it looks first."""
    assert THREE.decide(Event.RECEIVED, 1, 0, requeued=True) == run(check_stored=True)
    assert THREE.decide(Event.RECEIVED, 1, 2, requeued=True) == run(check_stored=True)


def test_a_release_never_spends_a_delivery():
    """However often a job is released, on whatever delivery, it is requeued: never naked
    (which would spend one of its deliveries) nor dead-lettered."""
    for policy, delivery in itertools.product((ONE, THREE, STRICT), range(1, 12)):
        assert policy.decide(Event.RELEASED, delivery).action is Action.REQUEUE
