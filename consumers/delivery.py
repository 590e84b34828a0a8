"""What to do with one delivery of a job, as data:
``DeliveryPolicy.decide(event, delivery, failures)``.

The worker reports what happened (an ``Event``), the delivery number and how many of the
job's runs failed so far; the policy answers with a ``Decision``: run it, ack, nak with a
delay, or dead-letter and term. Every rule lives in ``decide``, so the whole table can be read
(and is tested) in one place (tests/test_delivery_policy.py) instead of being spread through
the worker's control flow.

A job's agent may fail (raise) ``attempts`` times; each failure is counted in the attempts KV
before the job is naked for another run. A delivery that ends otherwise (its worker crashed
or was stopped, its ack timed out) is *lost*, not failed: it spends no attempt, so a storm
of consumer restarts dead-letters nothing. A job may lose ``lost_deliveries`` deliveries;
JetStream's ``max_deliver`` is ``attempts + lost_deliveries + 1``, and that last delivery is
never run, only dead-lettered and terminated (a job that crashes every worker that runs it
ends there), because a work-queue stream would otherwise keep a max-delivered job forever. For
the same reason no decision naks a job's last delivery: the server would never deliver it again.

A job *released* by a drain (SIGTERM: a scale-down, a rolling update) is neither: the worker
chose to give it back. It is requeued, published again as a fresh message (delivery count 1,
its failed-run count kept in the attempts KV) before this delivery is acked, so a long job
released by every scale-down of a day is never dead-lettered for it. Only when that publish
fails (a full queue, a broker going away) is it naked, spending a delivery as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from agentarium.broker import Backoff
from agentarium.schemas import check_settings, setting


class Event(Enum):
    """What the worker found out about one delivery. The dead-letter reasons reuse the values."""

    INVALID_JOB = "invalid_job"  # not a valid Job: retrying cannot fix the bytes
    WRONG_SUBJECT = "wrong_subject"  # a valid Job on another agent's subject: just as permanent
    RECEIVED = "received"  # a valid job, not run yet
    ALREADY_STORED = "already_stored"  # a redelivery whose trajectory exists: done before
    OK = "ok"  # the rollout returned a trajectory with this status...
    TIMEOUT = "timeout"  # ...its deadline passed: an outcome, rerunning would time out again
    ERROR = "error"  # ...the LLM backend failed after its own retries: recorded, not rerun
    AGENT_ERROR = "agent_error"  # the agent or its reward function raised
    ENV_UNAVAILABLE = "env_unavailable"  # an environment service failed under it: infrastructure
    WORKER_ERROR = "worker_error"  # the worker itself raised while handling the job
    RELEASED = "released"  # a drain (SIGTERM) cancelled it before it finished
    REQUEUE_FAILED = "requeue_failed"  # ...and publishing it again failed (queue full, broker gone)


class Action(Enum):
    RUN = "run"
    ACK = "ack"
    NAK = "nak"  # redelivered after ``delay_s``
    DEAD_LETTER = "dead_letter"  # published to DEAD with ``reason``, then term()ed
    REQUEUE = "requeue"  # published again as a fresh message, then this delivery acked


@dataclass(frozen=True, kw_only=True)
class Decision:
    action: Action
    delay_s: float = 0.0  # NAK: how long the server waits before delivering it again
    reason: str = ""  # DEAD_LETTER: the dead letter's reason
    detail: str = ""  # DEAD_LETTER: its error text, when the decision itself is the reason
    # DEAD_LETTER: also store an error trajectory, so whoever waits for the job's outcome
    # (the trainer's group, `results`) sees it end instead of waiting forever.
    record_error: bool = False
    # RUN / record_error: look up the job's trajectory first. A redelivery may follow a
    # delivery that stored it and then crashed before its ack.
    check_stored: bool = False
    # NAK: the run failed; count it (the attempts KV) before the nak, so that whoever runs the
    # job next knows which attempt it is.
    count_failure: bool = False

    @classmethod
    def run(cls, *, check_stored: bool) -> Decision:
        return _RUN_AGAIN if check_stored else _RUN_FIRST

    @classmethod
    def requeue(cls) -> Decision:
        return _REQUEUE

    @classmethod
    def ack(cls) -> Decision:
        return _ACK

    @classmethod
    def nak(cls, delay_s: float = 0.0, *, count_failure: bool = False) -> Decision:
        return cls(action=Action.NAK, delay_s=delay_s, count_failure=count_failure)

    @classmethod
    def dead_letter(
        cls,
        reason: str,
        *,
        detail: str = "",
        record_error: bool = False,
        check_stored: bool = False,
    ) -> Decision:
        return cls(
            action=Action.DEAD_LETTER,
            reason=reason,
            detail=detail,
            record_error=record_error,
            check_stored=check_stored,
        )


# The decisions every rollout takes, made once (frozen: sharing them is safe).
_RUN_FIRST = Decision(action=Action.RUN)
_RUN_AGAIN = Decision(action=Action.RUN, check_stored=True)
_ACK = Decision(action=Action.ACK)
_REQUEUE = Decision(action=Action.REQUEUE)


@dataclass(frozen=True, kw_only=True)
class DeliveryPolicy:
    """How many runs of a job may fail, how many deliveries it may lose besides, and how long
    it waits between runs (capped exponential backoff with jitter, so jobs that failed together
    do not all come back together)."""

    attempts: int = setting(
        3,
        ge=1,
        help="runs of a failing job before it is dead-lettered; a delivery lost to a crashed or "
        "drained worker spends none",
    )
    lost_deliveries: int = setting(
        5,
        ge=0,
        flagless="deliveries a job may lose to crashed or drained workers besides its attempts; "
        "a safety net, not a tuning knob",
    )
    base_delay_s: float = setting(
        1.0, ge=0, help="first retry delay; doubles per attempt, capped at --retry-max-delay"
    )
    max_delay_s: float = setting(60.0, ge=0, help="the longest wait between two runs of a job")
    jitter: float = setting(
        0.2,
        ge=0,
        flagless="the random share of each retry wait, so jobs that failed together come back apart",
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.max_delay_s < self.base_delay_s:
            raise ValueError("need 0 <= base_delay_s <= max_delay_s")
        if not 0 <= self.jitter < 1:
            raise ValueError("need 0 <= jitter < 1")

    @property
    def max_deliver(self) -> int:
        """JetStream's max_deliver for the agent's consumer: the attempts, the deliveries a
        job may lose, and one more that is never run."""
        return self.attempts + self.lost_deliveries + 1

    def delay_s(self, delivery: int) -> float:
        """Capped exponential backoff before the next delivery, jittered downwards."""
        backoff = Backoff(initial_s=self.base_delay_s, max_s=self.max_delay_s, jitter=self.jitter)
        return backoff.delay(delivery)

    def decide(
        self, event: Event, delivery: int, failures: int = 0, *, requeued: bool = False
    ) -> Decision:
        """The decision for ``event`` on the job's ``delivery``-th delivery (1-based), after
        ``failures`` of its runs failed (the attempts KV; the other earlier deliveries were
        lost). ``requeued``: this message is a released job published again, so even its first
        delivery may follow a run that stored the trajectory."""
        last_delivery = delivery >= self.max_deliver  # the server will not deliver it again
        match event:
            case Event.INVALID_JOB | Event.WRONG_SUBJECT:
                return Decision.dead_letter(event.value)
            case Event.RECEIVED if last_delivery:
                lost = max(0, delivery - 1 - failures)
                return Decision.dead_letter(
                    "max_deliveries",
                    detail=(
                        f"delivered {delivery} times without an outcome: {failures} runs "
                        f"failed, {lost} deliveries were lost (a worker crashed or was stopped, "
                        f"or an ack timed out; {self.lost_deliveries} may be): does the job "
                        "crash its workers?"
                    ),
                    record_error=True,
                    check_stored=True,
                )
            case Event.RECEIVED:
                return Decision.run(check_stored=delivery > 1 or requeued)
            case Event.ALREADY_STORED | Event.OK | Event.TIMEOUT | Event.ERROR:
                return Decision.ack()
            case Event.AGENT_ERROR if failures + 1 < self.attempts and not last_delivery:
                return Decision.nak(self.delay_s(failures + 1), count_failure=True)
            case Event.AGENT_ERROR:
                # The lookup was made before this run (check_stored on RUN): none needed here.
                return Decision.dead_letter(event.value, record_error=True)
            case Event.ENV_UNAVAILABLE if failures + 1 < self.attempts and not last_delivery:
                # No worker with room, or the session's worker died: another attempt (another
                # worker) can succeed, and nothing says the job is at fault. It ran and
                # failed, so it is counted as an attempt.
                return Decision.nak(self.delay_s(failures + 1), count_failure=True)
            case Event.ENV_UNAVAILABLE:
                return Decision.ack()  # the status error trajectory is stored: never reward 0
            case Event.WORKER_ERROR if not last_delivery:
                # A bug or an outage in the worker says nothing about the job: give it another
                # delivery, a lost one (the last delivery is judged as max_deliveries).
                return Decision.nak(self.delay_s(1))
            case Event.RELEASED:
                # Not a failure and not a loss: back in the queue without spending a delivery,
                # even on the last one (the requeued copy starts its count afresh).
                return Decision.requeue()
            case Event.REQUEUE_FAILED if not last_delivery:
                return Decision.nak()  # at once: another worker can take it now
            case Event.REQUEUE_FAILED:
                return Decision.dead_letter(Event.RELEASED.value)
            case Event.WORKER_ERROR:
                return Decision.dead_letter(event.value)
        raise ValueError(f"no decision for {event!r}")  # unreachable: every Event is matched
