"""What to do with one delivery of a job, as data: ``DeliveryPolicy.decide(event, delivery)``.

The worker reports what happened (an ``Event``) and the delivery number; the policy answers
with a ``Decision``: run it, ack, nak with a delay, or dead-letter and term. Every rule lives
in ``decide``, so the whole table can be read (and is tested) in one place
(tests/test_delivery_policy.py) instead of being spread through the worker's control flow.

A job is run at most ``attempts`` times. JetStream's ``max_deliver`` is set to
``attempts + 1`` so that a job whose last run crashed the worker (or missed its ack)
is delivered once more: that delivery is never run, only dead-lettered and terminated,
because a work-queue stream would otherwise keep a max-delivered job forever. For the same
reason no decision naks a job's last delivery: the server would never deliver it again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum


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


class Action(Enum):
    RUN = "run"
    ACK = "ack"
    NAK = "nak"  # redelivered after ``delay_s``
    DEAD_LETTER = "dead_letter"  # published to DEAD with ``reason``, then term()ed


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

    @classmethod
    def run(cls, *, check_stored: bool) -> Decision:
        return _RUN_AGAIN if check_stored else _RUN_FIRST

    @classmethod
    def ack(cls) -> Decision:
        return _ACK

    @classmethod
    def nak(cls, delay_s: float = 0.0) -> Decision:
        return cls(action=Action.NAK, delay_s=delay_s)

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


@dataclass(frozen=True, kw_only=True)
class DeliveryPolicy:
    """How many times a job is run, and how long it waits between runs (capped exponential
    backoff with jitter, so jobs that failed together do not all come back together)."""

    attempts: int = 3
    base_delay_s: float = 1.0
    max_delay_s: float = 60.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be >= 1")
        if self.base_delay_s < 0 or self.max_delay_s < self.base_delay_s:
            raise ValueError("need 0 <= base_delay_s <= max_delay_s")
        if not 0 <= self.jitter < 1:
            raise ValueError("need 0 <= jitter < 1")

    @property
    def max_deliver(self) -> int:
        """JetStream's max_deliver for the agent's consumer: one delivery past the attempts."""
        return self.attempts + 1

    def delay_s(self, delivery: int) -> float:
        """Capped exponential backoff before the next delivery, with jitter."""
        delay = min(self.max_delay_s, self.base_delay_s * 2 ** max(0, delivery - 1))
        return delay * (1 + random.uniform(-self.jitter, self.jitter))

    def decide(self, event: Event, delivery: int) -> Decision:
        """The decision for ``event`` on the job's ``delivery``-th delivery (1-based)."""
        last_delivery = delivery >= self.max_deliver  # the server will not deliver it again
        match event:
            case Event.INVALID_JOB | Event.WRONG_SUBJECT:
                return Decision.dead_letter(event.value)
            case Event.RECEIVED if delivery > self.attempts:
                return Decision.dead_letter(
                    "max_deliveries",
                    detail=(
                        f"delivered {delivery} times without an acknowledgement (worker crash "
                        f"or ack timeout on the last of {self.attempts} attempts)"
                    ),
                    record_error=True,
                    check_stored=True,
                )
            case Event.RECEIVED:
                return Decision.run(check_stored=delivery > 1)
            case Event.ALREADY_STORED | Event.OK | Event.TIMEOUT | Event.ERROR:
                return Decision.ack()
            case Event.AGENT_ERROR if delivery < self.attempts:
                return Decision.nak(self.delay_s(delivery))
            case Event.AGENT_ERROR:
                # The lookup was made before this run (check_stored on RUN): none needed here.
                return Decision.dead_letter(event.value, record_error=True)
            case Event.ENV_UNAVAILABLE if delivery < self.attempts:
                # No worker with room, or the session's worker died: another attempt (another
                # worker) can succeed, and nothing says the job is at fault.
                return Decision.nak(self.delay_s(delivery))
            case Event.ENV_UNAVAILABLE:
                return Decision.ack()  # the status error trajectory is stored: never reward 0
            case Event.WORKER_ERROR if not last_delivery:
                # A bug or an outage in the worker says nothing about the job: give it another
                # delivery (the one past the attempts is judged as max_deliveries).
                return Decision.nak(self.delay_s(1))
            case Event.RELEASED if not last_delivery:
                return Decision.nak()  # at once: another worker can take it now
            case Event.WORKER_ERROR | Event.RELEASED:
                return Decision.dead_letter(event.value)
        raise ValueError(f"no decision for {event!r}")  # unreachable: every Event is matched
